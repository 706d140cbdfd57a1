"""The Trainer of stage kd: TunelabTrainer (every reliability, logging and accounting piece of train/trainer.py) with
a frozen teacher beside the trained student and the distillation loss (train/distillation_losses.py) in place of the
token cross-entropy.

Each batch, training or evaluation, goes to both models with the same inputs: input ids, the attention mask of a
padded batch, or the position ids (and flash-attention's sequence boundaries) of a packed or padding-free one. Both
keep logits only at the positions whose next label is supervised (`logits_to_keep`, a bool mask; where a model's
forward does not take it, its logits of every position are picked there), so the loss reads exactly the answer
tokens the labels' mask marks, as sft's does. The teacher runs under no_grad; its parameters are frozen and it is not
the Trainer's model, so the optimizer never sees it, and the checkpoints hold the student only. eval_loss is the
divergence per answer token (a mean over the eval batches, each a mean over its tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tunelab.train.distillation_losses import distillation_loss
from tunelab.train.losses import next_token_mask
from tunelab.train.trainer import TunelabTrainer, takes_logits_to_keep


@dataclass(frozen=True)
class DistillationLoss:
    """The run's divergence (beta, temperature) of student and teacher logits, per supervised token of the step."""

    beta: float
    temperature: float

    def __call__(self, student_logits, teacher_logits, labels, num_items_in_batch=None) -> torch.Tensor:
        return distillation_loss(student_logits, teacher_logits, labels, self.beta, self.temperature,
                                 num_items_in_batch)


class DistillationTrainer(TunelabTrainer):
    def __init__(self, *args, teacher: nn.Module, beta: float, temperature: float, **kwargs):
        # A compute_loss_func that is not None also tells transformers' Trainer to count the step's supervised
        # tokens (num_items_in_batch) and that the loss is already normalised by them under accumulation.
        super().__init__(*args, compute_loss_func=DistillationLoss(beta, temperature), **kwargs)
        teacher.requires_grad_(False)
        self.teacher = teacher.eval()
        self._teacher_keeps_logits = takes_logits_to_keep(teacher)
        self._student_keeps_logits: bool | None = None  # looked up at the first batch (the model is wrapped by then)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs["labels"]
        forward = {key: value for key, value in inputs.items() if key not in ("labels", "logits_to_keep")}
        keep = next_token_mask(labels)
        with torch.no_grad():
            teacher_logits = self.teacher(
                **forward, **({"logits_to_keep": keep} if self._teacher_keeps_logits else {})
            ).logits
        if self._student_keeps_logits is None:
            self._student_keeps_logits = takes_logits_to_keep(self.accelerator.unwrap_model(model))
        outputs = model(**forward, **({"logits_to_keep": keep} if self._student_keeps_logits else {}))
        loss = self.compute_loss_func(outputs.logits, teacher_logits, labels, num_items_in_batch)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            # num_items_in_batch counts every process's tokens and DDP averages the gradients: as transformers' own.
            loss = loss * self.accelerator.num_processes
        return (loss, outputs) if return_outputs else loss
