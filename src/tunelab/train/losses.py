"""Loss functions. Each takes model outputs and targets and returns a scalar tensor.

The causal-LM loss is a sum of token cross-entropies divided by the number of supervised tokens of
the whole optimizer step (`num_items_in_batch`, counted by the Trainer over every micro-batch and
every process). So `accumulation 4 x micro-batch 2` gives the same loss and gradients as
`batch 8`, whatever the lengths of the examples — unlike a mean per micro-batch.

Label smoothing (`label_smoothing_factor` ε) replaces each supervised token's one-hot target with
(1 - ε) on the label plus ε spread evenly over the vocabulary, as torch's `cross_entropy(...,
label_smoothing=ε)`: per token, (1 - ε)·(-log p[label]) + ε·mean over the vocabulary of -log p. It is
summed and normalised exactly as the plain loss, so the accumulation equality holds unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tunelab.data.encode import IGNORE_INDEX


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    num_items_in_batch: torch.Tensor | int | None = None,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Next-token cross-entropy over supervised positions.

    logits: (batch, seq, vocab); labels: (batch, seq) with -100 where nothing is supervised.
    Token t's logits predict label t+1. Without num_items_in_batch (evaluation), the mean over this
    batch's supervised tokens.
    """
    shift_logits = logits[:, :-1, :].float()
    shift_labels = labels[:, 1:].to(shift_logits.device)
    total = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX, reduction="sum", label_smoothing=label_smoothing,
    )
    if num_items_in_batch is None:
        num_items_in_batch = (shift_labels != IGNORE_INDEX).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


@dataclass(frozen=True)
class CausalLMLoss:
    """The `compute_loss_func` transformers.Trainer calls: causal_lm_loss with the run's label smoothing."""

    label_smoothing: float = 0.0

    def __call__(self, outputs, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        return causal_lm_loss(logits, labels, num_items_in_batch, self.label_smoothing)


causal_lm_loss_func = CausalLMLoss()  # no smoothing: the Trainer's default in TunelabTrainer
