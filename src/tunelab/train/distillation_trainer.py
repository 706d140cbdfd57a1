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

On-policy examples (GKD's `lmbda` > 0): before a training micro-batch goes through the models, each of its examples
is drawn with probability lmbda (a generator seeded by the run's seed) and a drawn example's last answer is replaced by
the student's own, sampled at `temperature` from the same prompt up to `max_new_tokens` by the rollout code of the
RL stages (train/rl/rollout.py); the sampled tokens through the end-of-turn token are trained. The batch is collated
again by the run's collator (packed runs: side by side, as padding-free batches are). The Trainer counted the step's
answer tokens before any answer was sampled, so a micro-batch holding sampled answers is normalised by its own answer
tokens (TRL's per-batch mean) instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tunelab.data.collate import PackedCollator, PaddingFreeCollator
from tunelab.data.encode import IGNORE_INDEX
from tunelab.train.distillation_losses import distillation_loss
from tunelab.train.losses import next_token_mask
from tunelab.train.rl.rollout import generate_rollout
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
    def __init__(self, *args, teacher: nn.Module, beta: float, temperature: float, lmbda: float = 0.0,
                 stop_ids: tuple[int, ...] | list[int] = (), max_new_tokens: int = 64, **kwargs):
        # A compute_loss_func that is not None also tells transformers' Trainer to count the step's supervised
        # tokens (num_items_in_batch) and that the loss is already normalised by them under accumulation.
        super().__init__(*args, compute_loss_func=DistillationLoss(beta, temperature), **kwargs)
        teacher.requires_grad_(False)
        self.teacher = teacher.eval()
        self._teacher_keeps_logits = takes_logits_to_keep(teacher)
        self._student_keeps_logits: bool | None = None  # looked up at the first batch (the model is wrapped by then)
        self.lmbda, self.temperature = lmbda, temperature
        self.stop_ids, self.max_new_tokens = list(stop_ids), max_new_tokens
        self._draws = torch.Generator().manual_seed(self.args.seed + self.args.process_index)
        self._own_mean = False  # the next training loss is its micro-batch's mean (it holds sampled answers)
        self.on_policy_examples = 0  # examples trained on the student's own answers, this process

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.lmbda > 0:
            inputs, sampled = self.with_student_answers(model, inputs)
            self._own_mean = sampled > 0
        return super().training_step(model, inputs, num_items_in_batch)

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
        own_mean, self._own_mean = self._own_mean, False
        if own_mean:  # the mean over this micro-batch's answer tokens, one micro-batch's share of the step
            steps = getattr(self, "current_gradient_accumulation_steps", 1)
            loss = self.compute_loss_func(outputs.logits, teacher_logits, labels) / steps
        else:
            loss = self.compute_loss_func(outputs.logits, teacher_logits, labels, num_items_in_batch)
            if self.args.average_tokens_across_devices and num_items_in_batch is not None:
                # num_items_in_batch counts every process's tokens and DDP averages the gradients: as transformers'.
                loss = loss * self.accelerator.num_processes
        return (loss, outputs) if return_outputs else loss

    def with_student_answers(self, model, inputs: dict) -> tuple[dict, int]:
        """(the batch with the drawn examples' last answers sampled from the student, how many were drawn): module
        docstring. An example whose sample came back empty keeps the dataset's answer."""
        examples = split_examples(inputs)
        drawn = (torch.rand(len(examples), generator=self._draws) < self.lmbda).nonzero().flatten().tolist()
        if not drawn:
            return inputs, 0
        starts = [last_answer_start(examples[i]["labels"]) for i in drawn]
        prompts = [examples[i]["input_ids"][:start] for i, start in zip(drawn, starts)]
        policy = self.accelerator.unwrap_model(model)
        training = policy.training
        policy.eval()  # no dropout while sampling, as the RL stages sample
        try:
            rollout = generate_rollout(policy, self.processing_class, prompts, self.stop_ids, self.max_new_tokens,
                                       self.temperature, self.processing_class.pad_token_id)
        finally:
            policy.train(training)
        lengths = rollout.completion_mask.sum(-1).long().tolist()
        answers = rollout.input_ids[:, rollout.prompt_width:].tolist()
        for i, start, prompt, answer, length in zip(drawn, starts, prompts, answers, lengths):
            if length > 0:
                examples[i] = {"input_ids": prompt + answer[:length],
                               "labels": examples[i]["labels"][:start] + answer[:length]}
        self.on_policy_examples += len(drawn)
        collator = self.data_collator
        if isinstance(collator, PackedCollator):  # rows were packed before training: lay these out side by side
            collator = PaddingFreeCollator(collator)
        return collator(examples), len(drawn)




def split_examples(batch: dict) -> list[dict]:
    """The examples of a collated batch as {"input_ids", "labels"} lists: a row each when padded (attention_mask),
    else the pieces where the position ids restart (packed, padding-free, flattened rows); a piece with no label (a
    packed row's padding) is none."""
    ids, labels = batch["input_ids"].tolist(), batch["labels"].tolist()
    if "position_ids" not in batch:
        lengths = batch["attention_mask"].sum(-1).tolist()
        return [{"input_ids": i[:n], "labels": l[:n]} for i, l, n in zip(ids, labels, lengths)]
    examples = []
    for row_ids, row_labels, positions in zip(ids, labels, batch["position_ids"].tolist()):
        starts = [t for t, p in enumerate(positions) if p == 0] + [len(positions)]
        for start, end in zip(starts, starts[1:]):
            if any(label != IGNORE_INDEX for label in row_labels[start:end]):
                examples.append({"input_ids": row_ids[start:end], "labels": row_labels[start:end]})
    return examples


def last_answer_start(labels: list[int]) -> int:
    """Where the example's last trained answer starts (its prompt is everything before: earlier turns included)."""
    t = len(labels) - 1
    while t >= 0 and labels[t] == IGNORE_INDEX:  # what follows the end-of-turn token (a newline) is not trained
        t -= 1
    while t >= 0 and labels[t] != IGNORE_INDEX:
        t -= 1
    return t + 1
