"""The one Trainer subclass every stage uses.

transformers.Trainer already runs the loop, gradient accumulation, mixed precision, distributed
engines and checkpointing, and already leaves biases and norm weights out of weight decay. We add:
- the loss: a `compute_loss_func` (train/losses.py) normalised by the supervised tokens of the whole
  optimizer step, which the Trainer counts across micro-batches and processes, with the run's
  `label_smoothing_factor` (transformers' own LabelSmoother is never reached past a compute_loss_func);
  the model computes logits only at positions that predict a label (`logits_to_keep`, where its
  forward takes it; losses.py's docstring), in training and evaluation;
- token accounting (all tokens and supervised tokens seen), logged with every training log line, and
  callbacks.RunProgress's fields (tokens per second, ETA, memory) in every line, before the callbacks see it, so
  the trackers of `report_to` (trackers.py) get what trainer_log.jsonl gets; the console shows each line as one
  short readable line (console.py) instead of the Trainer's printed dict;
- evaluation metrics per eval set, counted batch by batch (logits are never gathered across the set):
  `eval[_{name}]_loss` is the mean cross-entropy per supervised token of the whole set (not a mean of
  batch means), `eval[_{name}]_perplexity` its exp, and with `compute_token_accuracy` the share of
  supervised tokens whose argmax prediction is the label (`eval[_{name}]_token_accuracy`);
- reliability (docs/reliability.md): checkpoints the Trainer saves, completed by a manifest written last from
  `on_save`, and `resume_from_checkpoint: true` (checkpoints.py), save-and-stop on SIGTERM/SIGINT
  (signals.py), the NaN/inf guard (guards.py); transformers' private names used are listed, with why, in
  tests/test_private_names.py;
- what the loop tells a user (docs/training.md): the metrics of EvalMetricsCallback callbacks in each
  evaluation's line (generate_at_eval), why early stopping stopped (and which checkpoint
  load_best_model_at_end loads) in the run summary, and a warning before training when the open-file limit
  is too low for the DataLoader workers (open_files.py);
- the optimizer the run's options ask for (GaLore, APOLLO, BAdam, Adam-mini, Muon, LoRA+: optimizers.py), through
  the Trainer's public create_optimizer; otherwise transformers' own.
"""

from __future__ import annotations

import inspect
import logging
import math
import time

import torch
import transformers

from tunelab.config.training_values import training_with
from tunelab.errors import TrainingError
from tunelab.model import sharding
from tunelab.train import checkpoints
from tunelab.train.callbacks import EarlyStopping, EvalMetricsCallback, RunProgress
from tunelab.train.console import use_console_lines
from tunelab.train.guards import NonFiniteCallback, NonFiniteGuard
from tunelab.train.losses import (
    IGNORE_INDEX,
    CausalLMLoss,
    causal_lm_loss_func,
    kept_pairs,
    max_index_waste,
    next_token_mask,
    next_token_index,
    token_log_probs,
)
from tunelab.train.open_files import check_open_file_budget
from tunelab.train.optimizers import build_optimizer
from tunelab.train.signals import StopOnSignal, TrainingInterrupted


class TunelabTrainer(transformers.Trainer):
    def __init__(self, model=None, args=None, *rest, compute_loss_func=causal_lm_loss_func, finetuning=None, **kwargs):
        # The Trainer's own TrainingArguments, made once here: a copy without save_total_limit, which tunelab's
        # rotation holds instead (checkpoints.py). The plan's TrainingArguments stay as they were through the run.
        rotation_limit = getattr(args, "save_total_limit", None)
        if args is not None:
            args = training_with(args, save_total_limit=None)
        super().__init__(model, args, *rest, compute_loss_func=compute_loss_func, **kwargs)
        use_console_lines(self)  # one readable line per log line on the console, not the printed dict
        self.finetuning = finetuning  # FinetuningArguments: the optimizer options (None: transformers' optimizer)
        if compute_loss_func is causal_lm_loss_func and self.args.label_smoothing_factor:
            self.compute_loss_func = CausalLMLoss(self.args.label_smoothing_factor)
        self.tokens_seen = 0
        self.supervised_tokens_seen = 0
        self.progress = RunProgress()  # tunelab's fields of every log line (rates, ETA, memory)
        # [tokens, supervised tokens] counted on the batch's device since the last log line: reading them is a
        # host sync, so it happens only when a line is logged or a checkpoint saved (_flush_token_counts).
        self._token_counts: torch.Tensor | None = None
        self.train_start_time: float | None = None
        # [summed cross-entropy, supervised tokens, correct argmax predictions] of the running evaluation.
        self._eval_token_stats: torch.Tensor | None = None
        self._model_keeps_logits: bool | None = None  # whether the model's forward takes logits_to_keep (first batch)
        reduce = self._reduce_max if self.args.world_size > 1 else None
        self.nonfinite = NonFiniteGuard(
            policy=getattr(self.args, "nan_policy", "stop"),
            max_consecutive=getattr(self.args, "nan_max_consecutive", 5),
        )
        self.stop_on_signal = StopOnSignal(reduce)
        self.last_checkpoint: str | None = None
        self._run_state_to_restore: dict = {}
        # The training loss summed since the last log line, as the Trainer sums it, and that line's step: kept here
        # because tunelab_state.json saves them (_add_to_loss_window).
        self._loss_since_log: torch.Tensor | None = None
        self._last_logged_step = 0
        self._resumed_loss_window = False  # the first log line after a resume averages steps from before it
        self.checkpointing = checkpoints.CheckpointCallback(self, rotation_limit)
        self.add_callback(NonFiniteCallback(self.nonfinite, reduce, scaler_active=self._has_grad_scaler))
        self.add_callback(self.stop_on_signal)
        self.add_callback(self.checkpointing)  # after StopOnSignal: it sees the save a signal asks for

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            self.optimizer = build_optimizer(self.model if model is None else model, self.args, self.finetuning)
        return super().create_optimizer(model)  # transformers' own when the options chose none

    # ---- reliability: resume, checkpoints, signals, the non-finite guard (docs/reliability.md) ----------------

    def train(self, resume_from_checkpoint=None, trial=None, **kwargs):
        """Trainer.train, resuming from `resume_from_checkpoint` (argument, else the training argument):
        true → the newest checkpoint of output_dir that verifies. Raises NothingToTrain when that checkpoint
        already reached the last step, TrainingError when the non-finite guard stopped the run,
        TrainingInterrupted after a signal (a checkpoint is saved first)."""
        if resume_from_checkpoint is None:
            resume_from_checkpoint = getattr(self.args, "resume_from_checkpoint", None)
        checkpoint = checkpoints.resume_point(self, resume_from_checkpoint)  # raises NothingToTrain when done
        self._run_state_to_restore = checkpoints.read_run_state(checkpoint) if checkpoint else {}
        check_open_file_budget(self.args.dataloader_num_workers, self.args.dataloader_prefetch_factor)
        self.stop_on_signal.install()
        try:
            with checkpoints.managed_saves(self, checkpoint):  # a failed save as its OSError
                output = super().train(resume_from_checkpoint=checkpoint, trial=trial, **kwargs)
        finally:
            self.stop_on_signal.uninstall()
        if self.nonfinite.stop_message:
            raise TrainingError(self.nonfinite.stop_message)
        if self.stop_on_signal.received:
            raise TrainingInterrupted(self.stop_on_signal.received, self.state.global_step, self.last_checkpoint)
        return output

    # Private override kept (tests/test_private_names.py): the Trainer's only point of loading resumed weights.
    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        # A model sharded at load (fsdp on CPU, model/sharding.py) takes the checkpoint's gathered weights through
        # torch's FSDP2 state-dict API: the Trainer's plain load_state_dict cannot copy full tensors into shards.

        if not sharding.load_gathered_weights(model or self.model, resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def run_state(self) -> dict:
        """What tunelab_state.json keeps beside the Trainer's own state (called on every process)."""
        self._flush_token_counts()
        window = self._loss_since_log if self._loss_since_log is not None else 0.0
        values = torch.tensor(
            [self.tokens_seen, self.supervised_tokens_seen, float(window)], dtype=torch.float64, device=self.args.device,
        )
        if self.args.world_size > 1:
            values = self.accelerator.reduce(values, reduction="sum")
        return {
            "global_step": self.state.global_step,
            "tokens_seen": int(values[0]),
            "supervised_tokens_seen": int(values[1]),
            # the loss summed since the last log line (mean over processes), so the next line averages the same steps
            "loss_since_last_log": float(values[2]) / max(self.args.world_size, 1),
            "last_logged_step": self._last_logged_step,
            "nonfinite": self.nonfinite.state_dict(),
        }

    def restore_run_state(self) -> None:
        """Called at train begin (after the Trainer reset its counters): a new loss window, and when resuming what
        tunelab_state.json saved."""
        self._loss_since_log = torch.zeros((), device=self.args.device)  # float32, as the Trainer's own sum
        self._last_logged_step, self._resumed_loss_window = self.state.global_step, False
        self.progress.begin()
        saved = self._run_state_to_restore
        if not saved:
            return
        main = self.args.process_index == 0  # the log sums counters over processes
        self.tokens_seen = saved.get("tokens_seen", 0) if main else 0
        self.supervised_tokens_seen = saved.get("supervised_tokens_seen", 0) if main else 0
        self._token_counts = None
        self.nonfinite.load_state_dict(saved.get("nonfinite", {}))
        if "loss_since_last_log" in saved and saved.get("global_step") == self.state.global_step:
            self._loss_since_log = torch.tensor(saved["loss_since_last_log"], device=self.args.device)
            self._last_logged_step = saved["last_logged_step"]
            self._resumed_loss_window = self._last_logged_step < self.state.global_step
        self.progress.last_tokens = (self.tokens_seen, self.supervised_tokens_seen)

    # Private override kept (tests/test_private_names.py): the only place the Trainer hands over the gradient norm it
    # computed before clipping, reduced the way each engine (DDP, FSDP, DeepSpeed) needs.
    def _get_grad_norm(self, model, grad_norm=None):
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        self.nonfinite.observe_grad_norm(grad_norm)
        return grad_norm

    def _has_grad_scaler(self) -> bool:
        return getattr(self.accelerator, "scaler", None) is not None

    def _reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.to(self.args.device)
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
        return tensor

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.train_start_time is None:
            self.train_start_time = time.time()
        self._count_tokens(inputs)
        loss = super().training_step(model, self._with_kept_logits(model, inputs), num_items_in_batch)
        self.nonfinite.observe_loss(loss)
        self._add_to_loss_window(loss)
        return loss

    def _add_to_loss_window(self, loss: torch.Tensor) -> None:
        """Sum the micro-batch loss as the Trainer sums the loss it logs (with logging_nan_inf_filter a non-finite
        loss adds the window's mean instead), on the device: no host sync."""
        window = self._loss_since_log
        if window is None:  # a training_step outside train()
            return
        if self.args.logging_nan_inf_filter:
            steps = 1 + self.state.global_step - self._last_logged_step
            self._loss_since_log = torch.where(torch.isfinite(loss), window + loss, window + window / steps)
        else:
            self._loss_since_log = window + loss

    def _close_loss_window(self, logs: dict[str, float]) -> None:
        """At a log line with the training loss. After a resume from a checkpoint saved between log lines, the
        first line averages the steps since the line before that checkpoint, as the uninterrupted run's line does
        (the Trainer's average starts at the resumed step). Then a new window starts."""
        if self._resumed_loss_window and self._loss_since_log is not None:
            window = self._loss_since_log
            if self.args.world_size > 1:  # the mean over processes, as the Trainer's log line takes it
                window = self.accelerator.gather(window).mean()
            logs["loss"] = window.item() / (self.state.global_step - self._last_logged_step)
        self._resumed_loss_window = False
        self._loss_since_log = torch.zeros((), device=self.args.device)
        self._last_logged_step = self.state.global_step

    def _count_tokens(self, inputs) -> None:
        """Add the batch's real and supervised tokens to the running counts without reading them back: on a GPU
        every int(tensor) waits for the device, so the sums stay tensors until the next log line.

        Real tokens are those that are not padding: padded batches say so in their 2-D attention mask; packed
        batches have none (or a 4-D block mask), and their row padding is pad ids that nothing learns."""
        input_ids, labels, mask = inputs["input_ids"], inputs.get("labels"), inputs.get("attention_mask")
        pad_id = getattr(self.processing_class, "pad_token_id", None)
        if mask is not None and mask.dim() == 2:
            real = mask.sum()
        elif pad_id is None or labels is None:
            real = torch.full((), input_ids.numel(), device=input_ids.device)
        else:
            real = ((input_ids != pad_id) | (labels != IGNORE_INDEX)).sum()
        supervised = (labels[:, 1:] != IGNORE_INDEX).sum() if labels is not None else torch.zeros_like(real)
        counts = torch.stack([real.to(torch.int64), supervised.to(device=real.device, dtype=torch.int64)])
        self._token_counts = counts if self._token_counts is None else self._token_counts + counts

    def _flush_token_counts(self) -> None:
        """Move the device-side counts into tokens_seen / supervised_tokens_seen (one host sync)."""
        if self._token_counts is not None:
            tokens, supervised = self._token_counts.tolist()
            self.tokens_seen += tokens
            self.supervised_tokens_seen += supervised
            self._token_counts = None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:
            self._close_loss_window(logs)
            self._flush_token_counts()
            tokens = torch.tensor([self.tokens_seen, self.supervised_tokens_seen], device=self.args.device)
            if self.args.world_size > 1:
                tokens = self.accelerator.reduce(tokens, reduction="sum")
            logs["tokens_seen"] = int(tokens[0])
            logs["supervised_tokens_seen"] = int(tokens[1])
            if self.nonfinite.policy == "skip":
                logs["skipped_nonfinite_steps"] = self.nonfinite.skipped
        if "train_runtime" in logs:  # the run summary: the Trainer's last line, and the metrics train() returns
            logs.update(self._stop_summary())
        # Before the Trainer hands the line to the callbacks: trainer_log.jsonl and report_to's trackers see it whole.
        self.progress.add_to(logs, self.state, self.args.device)
        super().log(logs, start_time)

    def _stop_summary(self) -> dict:
        """Why training ended early, and which checkpoint load_best_model_at_end is about to load."""
        summary: dict = {}
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, EarlyStopping):
                summary.update(callback.summary())
        if self.args.load_best_model_at_end and self.state.best_model_checkpoint is not None:
            summary["best_model_checkpoint"] = self.state.best_model_checkpoint
            summary["best_metric"] = self.state.best_metric
            logging.getLogger(__name__).info(
                "load_best_model_at_end: the final model is %s (%s %.6g)", self.state.best_model_checkpoint,
                EarlyStopping.watched_metric(self.args), self.state.best_metric,
            )
        return summary

    # ---- evaluation: token-level metrics accumulated per batch ----------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = self._with_kept_logits(model, inputs)
        if self._eval_token_stats is None or model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        labels = inputs.get("labels")  # the parent pops them from `inputs`
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        logits = outputs.get("logits") if isinstance(outputs, dict) else None
        if torch.is_tensor(logits) and torch.is_tensor(labels) and (
            (logits.dim() == 3 and logits.shape[0] == labels.shape[0]) or logits.dim() == 2
        ):
            self._eval_token_stats += token_stats(logits.detach(), labels, self._with_token_accuracy)
        return (loss, outputs) if return_outputs else loss

    def _with_kept_logits(self, model, inputs: dict) -> dict:
        """The batch with `logits_to_keep`: only positions whose next label is supervised get logits, when our
        causal-LM loss reads them and the model's forward takes the argument (losses.py's docstring). Called
        before the batch moves to the device (training_step) and again after (compute_loss, which evaluation
        reaches directly). A batch still on the host gets a (batch, W) index of positions counted there (a bool mask
        would make a GPU report the count back every micro-batch), unless equal widths would waste head rows
        (losses.next_token_index); it and every other batch get the bool mask."""
        labels = inputs.get("labels")
        if not isinstance(self.compute_loss_func, CausalLMLoss) or labels is None or "logits_to_keep" in inputs:
            return inputs
        if not self._keeps_logits(model):
            return inputs
        index = self._host_index(labels)
        return {**inputs, "logits_to_keep": index if index is not None else next_token_mask(labels)}

    def _host_index(self, labels: torch.Tensor) -> torch.Tensor | None:
        """next_token_index of labels still on the host, with the waste the training device allows; else None."""
        if labels.dim() != 2 or labels.device.type != "cpu":
            return None
        return next_token_index(labels, max_index_waste(self.args.device))

    def _keeps_logits(self, model) -> bool:
        """takes_logits_to_keep of the trained model, looked up once (at its first batch)."""
        if self._model_keeps_logits is None:
            self._model_keeps_logits = takes_logits_to_keep(self.accelerator.unwrap_model(model))
        return self._model_keeps_logits

    @property
    def _with_token_accuracy(self) -> bool:
        return bool(getattr(self.args, "compute_token_accuracy", False))

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"):
        self._eval_token_stats = torch.zeros(3, dtype=torch.float64, device=self.args.device)
        try:
            output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
            stats = self._eval_token_stats
        finally:
            self._eval_token_stats = None
        if self.args.world_size > 1:
            stats = self.accelerator.reduce(stats, reduction="sum")
        output.metrics.update(token_metrics(stats.tolist(), metric_key_prefix, self._with_token_accuracy))
        model = self.accelerator.unwrap_model(self.model)
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, EvalMetricsCallback):
                output.metrics.update(callback.evaluation_metrics(model, metric_key_prefix))
        return output


def token_stats(logits: torch.Tensor, labels: torch.Tensor, with_accuracy: bool) -> torch.Tensor:
    """[summed next-token cross-entropy, supervised tokens, correct argmax predictions] of one batch (float64).

    logits predict labels shifted by one, of every position or of the supervised positions only
    (logits_to_keep; losses.kept_pairs); -100 labels do not count.
    """
    kept, targets = kept_pairs(logits, labels)
    nll = -token_log_probs(kept, targets)[0].sum()
    correct = (kept.argmax(-1) == targets).sum() if with_accuracy else torch.zeros((), device=nll.device)
    counted = (targets != IGNORE_INDEX).sum()
    return torch.stack([nll.double(), counted.double().to(nll.device), correct.double().to(nll.device)])


def takes_logits_to_keep(model) -> bool:
    """Whether the model (PEFT-wrapped or not) is transformers' own code with a forward that takes
    `logits_to_keep`: those slice their last hidden states with a 2-D bool tensor before the output layer
    (`slice_logits_to_keep`). Remote code may slice it differently, so it keeps every position. The forward is
    read from the instance: Liger (`use_liger_kernel`) replaces it there with one that takes only an int or a slice.
    Wrappers that name what they wrap (`__wrapped__`: accelerate's autocast and float32 outputs under bf16) are
    looked through."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    forward = inspect.unwrap(getattr(base.forward, "__func__", base.forward))
    native = type(base).__module__.startswith("transformers.") and forward.__module__.startswith("transformers.")
    return native and "logits_to_keep" in inspect.signature(forward).parameters


def token_metrics(stats: list[float], prefix: str, with_accuracy: bool) -> dict[str, float]:
    """`{prefix}_loss`, `{prefix}_perplexity` (and `{prefix}_token_accuracy`) from summed token stats."""
    nll, tokens, correct = stats
    if tokens == 0:
        return {}
    loss = nll / tokens
    metrics = {f"{prefix}_loss": loss, f"{prefix}_perplexity": math.exp(loss) if loss < 700 else math.inf}
    if with_accuracy:
        metrics[f"{prefix}_token_accuracy"] = correct / tokens
    return metrics
