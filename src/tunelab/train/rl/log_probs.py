"""Per-token log-probabilities of sampled tokens, and the position ids of a left-padded batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tunelab.train import losses


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """0, 1, 2... from each row's first real token (pads get 0): what `generate` uses for left padding."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def tempered_log_probs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, output_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / T) at `targets` (logits … × V, targets …), float32, through the training loss's chunked
    log-probs (losses.token_log_probs), and when asked the entropy of each distribution (detached)."""
    scaled = logits.float() / temperature
    log_probs = losses.token_log_probs(scaled.reshape(-1, scaled.shape[-1]), targets.reshape(-1))[0]
    log_probs = log_probs.view(targets.shape)
    if not output_entropy:
        return log_probs, None
    with torch.no_grad():  # of the sampled (temperature-scaled) distribution at each position
        all_log_probs = F.log_softmax(scaled, dim=-1)
        return log_probs, -(all_log_probs.exp() * all_log_probs).sum(-1)
