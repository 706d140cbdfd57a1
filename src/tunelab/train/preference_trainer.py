"""The Trainer of the preference stages: rm (Bradley–Terry), dpo and its relatives, kto.

Batches come from collate.PairedCollator: 2B sequences, the first B chosen answers (kto: the
examples) and the last B rejected answers (kto: the KL examples), so one forward pass scores both
halves. dpo and kto batches are padding-free where the model supports it (the sequences laid side by
side, summed by `sequence_ids`); rm's are padded rows, scored at their last token.
The loss maths is train/preference_losses.py's; this class runs the forward passes, picks the
reference, and logs the rewards.

Reference log-probs come, in this order, from: precomputed columns (`ref_chosen_logps` /
`ref_rejected_logps`, kto `ref_logps` / `ref_kl_logps`, see `precompute_reference_log_probs`); a
frozen reference model (full / freeze fine-tuning); or the policy itself with its LoRA adapter
disabled (no second copy). orpo and simpo use none.

Loss scale: every loss is the mean over this micro-batch's pairs (examples), and
`loss_is_scaled_for_ga = False` makes the Trainer divide it by the accumulation steps — exact when
micro-batches are equally large (all but maybe the last of an epoch). `num_items_in_batch` counts
tokens and is not a preference loss's unit, so it is ignored.

Logged (train, and with the eval prefix at evaluation), each a mean over all pairs since the last log:
  rm:  accuracy (r_chosen > r_rejected), margin (r_chosen - r_rejected), rewards/chosen, rewards/rejected
  dpo: rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies (implicit rewards,
       beta * log-ratio; orpo/simpo beta * avg log-prob), logps/chosen, logps/rejected,
       logps/accuracies (the policy gives the chosen answer the higher log-prob)
  kto: rewards/chosen (desirable), rewards/rejected (undesirable), kl (z0)
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import datasets
import torch
from torch import nn

from tunelab.config.args import FinetuningArguments
from tunelab.config.stages import stage_row
from tunelab.train import preference_losses as losses
from tunelab.train.losses import next_token_mask
from tunelab.train.trainer import TunelabTrainer, takes_logits_to_keep

PAIR_REFERENCE_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")
KTO_REFERENCE_COLUMNS = ("ref_logps", "ref_kl_logps")
# What a PairedCollator batch passes to the model: padded (input_ids, attention_mask) or padding-free
# (data/collate.py's packed keys); labels, sequence_ids and per-pair columns stay with the loss.
MODEL_INPUTS = (
    "input_ids", "attention_mask", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
    # vision-language models (data/vision.py's VisionCollator): the pairs' images
    "pixel_values", "image_sizes", "image_grid_thw", "pixel_attention_mask", "token_type_ids", "mm_token_type_ids",
    "image_attention_mask",
)


@contextlib.contextmanager
def reference_view(model: nn.Module, ref_model: nn.Module | None):
    """The module whose forward gives reference log-probs: the frozen copy, else the policy with its
    LoRA adapter disabled. (A full/freeze policy without a copy is the reference only before training:
    `precompute_reference_log_probs` uses that.)"""
    if ref_model is not None:
        yield ref_model
    elif hasattr(model, "disable_adapter"):
        with model.disable_adapter():
            yield model
    else:
        yield model


def batch_log_probs(model: nn.Module, batch: dict, keep_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-prob, supervised token count) of every sequence of a PairedCollator batch, padded
    (a row each) or padding-free (`sequence_ids`; the model gets the packed keys of PackedCollator).
    With `keep_logits` (the model takes logits_to_keep) only positions that predict a label get logits: by the
    batch's `logits_to_keep` index when the trainer built one on the host (PreferenceTrainer._with_kept_logits),
    else by the labels' mask."""
    inputs = {key: batch[key] for key in MODEL_INPUTS if key in batch}
    if keep_logits:
        index = batch.get("logits_to_keep")
        inputs["logits_to_keep"] = index if index is not None else next_token_mask(batch["labels"])
    outputs = model(**inputs, use_cache=False)
    return losses.sequence_log_probs(outputs.logits, batch["labels"], batch.get("sequence_ids"),
                                     batch.get("sequence_count"))


@torch.no_grad()
def precompute_reference_log_probs(
    dataset: datasets.Dataset, model: nn.Module, ref_model: nn.Module | None, collator, columns: tuple[str, str],
    batch_size: int, device: torch.device,
) -> datasets.Dataset:
    """The dataset with two float columns: the reference's summed log-probs of each row's first and
    second sequence, in dataset order. Run before training (the policy then still is the reference)."""
    was_training = model.training
    model.eval()
    first, second = [], []
    with reference_view(model, ref_model) as reference:
        for start in range(0, len(dataset), batch_size):
            rows = dataset.select(range(start, min(start + batch_size, len(dataset))))
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in collator(list(rows)).items()}
            logps, _ = batch_log_probs(reference, batch, takes_logits_to_keep(reference))
            half = len(rows)
            first += logps[:half].tolist()
            second += logps[half:].tolist()
    model.train(was_training)
    dataset = dataset.remove_columns([c for c in columns if c in dataset.column_names])
    return dataset.add_column(columns[0], first).add_column(columns[1], second)


class PreferenceTrainer(TunelabTrainer):
    """stage: a pair stage (rm, dpo, kto); `ref_model` only for reference-based losses without LoRA or precompute."""

    loss_is_scaled_for_ga = False  # our losses are per-micro-batch means; the Trainer divides by accumulation

    def __init__(self, *args, stage: str, finetuning: FinetuningArguments, ref_model: nn.Module | None = None, **kwargs):
        super().__init__(*args, compute_loss_func=None, finetuning=finetuning, **kwargs)
        self.stage, self.row = stage, stage_row(stage)
        self.ref_model = ref_model.to(self.args.device) if ref_model is not None else None
        # mode ("train" / "eval") -> metric name -> [sum (a device tensor once recorded), count]
        self._metric_sums: dict[str, dict[str, list]] = defaultdict(dict)

    def _with_kept_logits(self, model, inputs: dict) -> dict:
        """A pair batch still on the host gets what lets its loss run without a GPU reporting back: the number of
        sequences (`sequence_count`, of a padding-free batch's sequence_ids) and, when the policy takes
        logits_to_keep, an index of the positions to keep (losses.next_token_index; None when filling rows to
        equal widths would waste too many head rows, and then batch_log_probs keeps by mask)."""
        labels = inputs.get("labels")
        if self.row.head == "reward" or labels is None or labels.device.type != "cpu" or "logits_to_keep" in inputs:
            return inputs
        extra = {}
        if "sequence_ids" in inputs:
            extra["sequence_count"] = int(inputs["sequence_ids"].max()) + 1
        index = self._host_index(labels) if self._keeps_logits(model) else None
        if index is not None:
            extra["logits_to_keep"] = index
        return {**inputs, **extra}

    # ---- losses --------------------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if model.training else "eval"
        row = self.row  # a reward head's Bradley–Terry loss, KTO on unpaired examples, else the DPO family
        loss_fn = (self._reward_loss if row.head == "reward" else self._kto_loss if row.reads == "unpaired"
                   else self._dpo_loss)
        loss = loss_fn(model, inputs, mode)
        return (loss, None) if return_outputs else loss

    def _reward_loss(self, model, batch: dict, mode: str) -> torch.Tensor:
        rewards = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1).float()
        chosen, rejected = rewards.chunk(2)
        self._record(mode, {
            "accuracy": (chosen > rejected).float(), "margin": chosen - rejected,
            "rewards/chosen": chosen, "rewards/rejected": rejected,
        })
        return losses.bradley_terry_loss(chosen, rejected).mean()

    def _reference_log_probs(self, model, batch: dict, columns: tuple[str, str]) -> torch.Tensor:
        if columns[0] in batch:
            return torch.cat([batch[columns[0]], batch[columns[1]]]).to(self.args.device).float()
        with torch.no_grad(), reference_view(model, self.ref_model) as reference:
            return batch_log_probs(reference, batch, takes_logits_to_keep(self.accelerator.unwrap_model(reference)))[0]

    def _dpo_loss(self, model, batch: dict, mode: str) -> torch.Tensor:
        ft = self.finetuning
        logps, counts = batch_log_probs(model, batch, self._keeps_logits(model))
        averaged = ft.pref_loss in losses.AVERAGED_LOSSES
        policy = logps / counts if averaged else logps
        pc, pr = policy.chunk(2)
        if ft.pref_loss == "orpo":
            pair_losses, chosen_rewards, rejected_rewards = losses.orpo_loss(pc, pr, ft.pref_beta)
        elif ft.pref_loss == "simpo":
            pair_losses, chosen_rewards, rejected_rewards = losses.simpo_loss(pc, pr, ft.pref_beta, ft.simpo_gamma)
        else:
            reference = self._reference_log_probs(model, batch, PAIR_REFERENCE_COLUMNS)
            if averaged:
                reference = reference / counts
            rc, rr = reference.chunk(2)
            pair_losses, chosen_rewards, rejected_rewards = losses.dpo_loss(
                pc, pr, rc, rr, ft.pref_beta, ft.pref_loss, ft.dpo_label_smoothing
            )
        if ft.pref_ftx > 0:  # SFT term: mean token NLL of the chosen answer
            chosen_logps, chosen_counts = logps.chunk(2)[0], counts.chunk(2)[0]
            pair_losses = pair_losses + ft.pref_ftx * (-chosen_logps / chosen_counts)
        sum_chosen, sum_rejected = logps.detach().chunk(2)
        self._record(mode, {
            "rewards/chosen": chosen_rewards, "rewards/rejected": rejected_rewards,
            "rewards/margins": chosen_rewards - rejected_rewards,
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
            "logps/chosen": sum_chosen, "logps/rejected": sum_rejected,
            "logps/accuracies": (sum_chosen > sum_rejected).float(),
        })
        return pair_losses.mean()

    def _kto_loss(self, model, batch: dict, mode: str) -> torch.Tensor:
        ft = self.finetuning
        logps, _ = batch_log_probs(model, batch, self._keeps_logits(model))
        reference = self._reference_log_probs(model, batch, KTO_REFERENCE_COLUMNS)
        policy_logps, policy_kl = logps.chunk(2)
        reference_logps, reference_kl = reference.chunk(2)
        kl = losses.kto_kl_estimate(policy_kl, reference_kl)
        desirable = batch["kto_tag"].to(logps.device).bool()
        example_losses, rewards = losses.kto_loss(
            policy_logps, reference_logps, desirable, kl, ft.pref_beta, ft.kto_desirable_weight, ft.kto_undesirable_weight
        )
        self._record(mode, {"rewards/chosen": rewards[desirable], "rewards/rejected": rewards[~desirable], "kl": kl.reshape(1)})
        return example_losses.mean()

    # ---- evaluation and logging ------------------------------------------------------------------------------

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Evaluation: the loss only (metrics are recorded by compute_loss); no logits are gathered."""
        inputs = self._prepare_inputs(self._with_kept_logits(model, inputs))
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def _record(self, mode: str, values: dict[str, torch.Tensor]) -> None:
        sums = self._metric_sums[mode]
        for name, tensor in values.items():
            if tensor.numel():  # summed on the device; read once, at the log line
                total = sums.setdefault(name, [0.0, 0])
                total[0] = total[0] + tensor.detach().float().sum()
                total[1] += tensor.numel()

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add the recorded metrics: train ones to the training log line, eval ones (prefixed like the
        eval loss: eval_, or the prefix given to evaluate) to the evaluation's."""
        if "loss" in logs:
            mode, prefix = "train", ""
        else:
            loss_keys = [k for k in logs if k.endswith("_loss")]
            mode, prefix = "eval", (loss_keys[0][: -len("loss")] if loss_keys else "eval_")
        for name, (total, count) in self._metric_sums.pop(mode, {}).items():
            logs[f"{prefix}{name}"] = float(total) / count
        super().log(logs, start_time)
