"""Per-token log-probabilities from logits, and the position ids of a left-padded batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """0, 1, 2... from each row's first real token (pads get 0): what `generate` uses for left padding."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def token_log_probs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, output_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / T) at `targets` (logits … × V, targets …) in float32 and, when asked, the entropy of
    each distribution (detached). A log-prob is the target's logit less the logsumexp, so no … × V tensor of
    log-probs is kept for the backward."""
    scaled = logits.float() / temperature
    log_probs = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - scaled.logsumexp(-1)
    if not output_entropy:
        return log_probs, None
    with torch.no_grad():  # of the sampled (temperature-scaled) distribution at each position
        all_log_probs = F.log_softmax(scaled, dim=-1)
        return log_probs, -(all_log_probs.exp() * all_log_probs).sum(-1)
