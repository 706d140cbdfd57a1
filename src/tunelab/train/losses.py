"""Loss functions. Each takes model outputs and targets and returns a scalar tensor.

The causal-LM loss is a sum of token cross-entropies divided by the number of supervised tokens of
the whole optimizer step (`num_items_in_batch`, counted by the Trainer over every micro-batch and
every process). So `accumulation 4 x micro-batch 2` gives the same loss and gradients as
`batch 8`, whatever the lengths of the examples — unlike a mean per micro-batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tunelab.data.encode import IGNORE_INDEX


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
    """Next-token cross-entropy over supervised positions.

    logits: (batch, seq, vocab); labels: (batch, seq) with -100 where nothing is supervised.
    Token t's logits predict label t+1. Without num_items_in_batch (evaluation), the mean over this
    batch's supervised tokens.
    """
    shift_logits = logits[:, :-1, :].float()
    shift_labels = labels[:, 1:].to(shift_logits.device)
    total = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX, reduction="sum",
    )
    if num_items_in_batch is None:
        num_items_in_batch = (shift_labels != IGNORE_INDEX).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def causal_lm_loss_func(outputs, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """The `compute_loss_func` signature transformers.Trainer calls."""
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
    return causal_lm_loss(logits, labels, num_items_in_batch)
