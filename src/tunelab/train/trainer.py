"""The one Trainer subclass every stage uses.

transformers.Trainer already runs the loop, gradient accumulation, mixed precision, distributed
engines and checkpointing, and already leaves biases and norm weights out of weight decay. We add:
- the loss: a `compute_loss_func` (train/losses.py) normalised by the supervised tokens of the whole
  optimizer step, which the Trainer counts across micro-batches and processes;
- token accounting (all tokens and supervised tokens seen), logged with every training log line.
"""

from __future__ import annotations

import time

import torch
import transformers

from tunelab.train.losses import IGNORE_INDEX, causal_lm_loss_func


class TunelabTrainer(transformers.Trainer):
    def __init__(self, *args, compute_loss_func=causal_lm_loss_func, **kwargs):
        super().__init__(*args, compute_loss_func=compute_loss_func, **kwargs)
        self.tokens_seen = 0
        self.supervised_tokens_seen = 0
        self.train_start_time: float | None = None

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.train_start_time is None:
            self.train_start_time = time.time()
        self.tokens_seen += self._real_tokens(inputs)
        labels = inputs.get("labels")
        if labels is not None:
            self.supervised_tokens_seen += int((labels[:, 1:] != IGNORE_INDEX).sum())
        return super().training_step(model, inputs, num_items_in_batch)

    def _real_tokens(self, inputs) -> int:
        """Tokens that are not padding. Padded batches say so in their 2-D attention mask; packed
        batches have none (or a 4-D block mask), and their row padding is pad ids that nothing learns."""
        mask = inputs.get("attention_mask")
        if mask is not None and mask.dim() == 2:
            return int(mask.sum())
        input_ids, labels = inputs["input_ids"], inputs.get("labels")
        pad_id = getattr(self.processing_class, "pad_token_id", None)
        if pad_id is None or labels is None:
            return input_ids.numel()
        return int(((input_ids != pad_id) | (labels != IGNORE_INDEX)).sum())

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:
            tokens = torch.tensor([self.tokens_seen, self.supervised_tokens_seen], device=self.args.device)
            if self.args.world_size > 1:
                tokens = self.accelerator.reduce(tokens, reduction="sum")
            logs["tokens_seen"] = int(tokens[0])
            logs["supervised_tokens_seen"] = int(tokens[1])
        super().log(logs, start_time)
