"""Trainer callbacks: the JSON-lines training log, early stopping, evaluation metrics of our own, and the user's
callbacks named in the config (the plots drawn from the log are in plots.py).

trainer_log.jsonl gets one object per log event: step, epoch, loss / eval metrics, learning rate, grad norm,
tokens seen and tokens per second (all and supervised) since the previous line, elapsed seconds and ETA, and the
process's memory (train/memory.py): the line exactly as the Trainer's log hands it to every callback, the trackers
of `report_to` included (RunProgress adds tunelab's fields first). Only the main process writes. A resumed run
keeps the lines up to its checkpoint's step and goes on from there, so the file reads as one run.

The callbacks a stage hands to the Trainer come from `run_callbacks(args, finetuning)`: the log, QAT's start switch
(`qat_start_step`, QATStartCallback), the stage's own, EarlyStopping when `early_stopping_patience` is set, then the
user's `callbacks` in their order. User callbacks are imported
by the opt-in rule of tunelab/user_code.py: nothing runs unless the config names it.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import transformers

from tunelab import run_folder
from tunelab.errors import ConfigError
from tunelab.model import qat
from tunelab.train.memory import memory_metrics
from tunelab.user_code import import_user_module, is_user_spec, split_user_spec

logger = logging.getLogger(__name__)


class QATStartCallback(transformers.TrainerCallback):
    """qat_start_step: the first `start_step` optimizer steps train in full precision, then fake quantisation
    switches on for good. Decided from the step count alone, so a resumed run switches exactly where the
    uninterrupted one did."""

    def __init__(self, start_step: int):
        self.start_step = start_step
        self.on: bool | None = None

    def _sync(self, state, model) -> None:
        on = state.global_step >= self.start_step
        if on != self.on and model is not None:
            qat.set_fake_quant(model, on)
            if on:
                logger.info("qat: fake quantisation on from step %d", state.global_step + 1)
            self.on = on

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if state.max_steps and self.start_step >= state.max_steps:
            logger.warning("qat_start_step: %d is not before the run's last step (%d): fake quantisation never "
                           "switches on; lower qat_start_step", self.start_step, state.max_steps)
        self._sync(state, model)

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self._sync(state, model)


def qat_callbacks(finetuning_args) -> list[transformers.TrainerCallback]:
    """The callbacks a training stage adds for `qat` (none without qat_start_step)."""
    if finetuning_args.qat and finetuning_args.qat_start_step > 0:
        return [QATStartCallback(finetuning_args.qat_start_step)]
    return []


class RunProgress:
    """What tunelab adds to a log line before any callback sees it, so that trainer_log.jsonl and every tracker of
    `report_to` (train/trackers.py) get the same numbers: tokens per second, all and supervised, since the previous
    line that counted tokens (from the line's tokens_seen / supervised_tokens_seen), elapsed seconds and the ETA, and
    the process's memory (train/memory.py). TunelabTrainer.log and the RL loop call `add_to` on every line."""

    def __init__(self):
        self.start: float | None = None
        self.last_time: float | None = None
        self.last_tokens = (0, 0)  # a resumed run sets the counts its checkpoint saved

    def begin(self) -> None:
        self.start = self.last_time = time.time()

    def add_to(self, logs: dict, state, device) -> None:
        now = time.time()
        if "tokens_seen" in logs:
            tokens, supervised = logs["tokens_seen"], logs["supervised_tokens_seen"]
            window = max(now - (self.last_time or now), 1e-9)
            logs["tokens_per_second"] = round((tokens - self.last_tokens[0]) / window, 1)
            logs["supervised_tokens_per_second"] = round((supervised - self.last_tokens[1]) / window, 1)
            self.last_tokens, self.last_time = (tokens, supervised), now
        elapsed = now - (self.start or now)
        logs["elapsed_seconds"] = round(elapsed, 2)
        if state.global_step and state.max_steps:
            logs["eta_seconds"] = round(elapsed / state.global_step * (state.max_steps - state.global_step), 2)
        logs.update(memory_metrics(device))


class JsonlLogCallback(transformers.TrainerCallback):
    """trainer_log.jsonl: each log line as logged (RunProgress's fields included), after the step, max_steps and
    epoch."""

    def __init__(self, output_dir: str):
        self.folder = Path(output_dir)

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.folder.mkdir(parents=True, exist_ok=True)
            # A fresh run starts an empty log; a resumed one drops what the stopped run logged after its checkpoint.
            kept = [r for r in run_folder.read_log(self.folder) if r.get("step", 0) <= state.global_step]
            run_folder.rewrite_log(self.folder, kept if state.global_step else [])

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        record = {"step": state.global_step, "max_steps": state.max_steps, "epoch": round(state.epoch or 0.0, 4)}
        run_folder.append_log(self.folder, {**record, **logs})


# ---- the user's callbacks -------------------------------------------------------------------------------------


def resolve_user_callbacks(
    specs: Sequence[str], kwargs_by_name: dict[str, dict[str, Any]] | None = None, base_dir: str | Path | None = None
) -> list[tuple[type, dict[str, Any]]]:
    """(class, keyword arguments) of each `callbacks` entry, checked without building anything: the module
    imports, the class exists and is a transformers.TrainerCallback, its constructor takes the arguments."""
    kwargs_by_name = dict(kwargs_by_name or {})
    resolved = []
    for spec in specs:
        if not is_user_spec(spec):
            raise ConfigError(
                f"callbacks: '{spec}' names no class; write path/to/file.py:Class or package.module:Class"
            )
        where, name = split_user_spec(spec)
        module = import_user_module(where, "callbacks", base_dir, fix_name=name)
        cls = getattr(module, name, None)
        if cls is None:
            raise ConfigError(f"callbacks: {where} has no class '{name}'; define class {name}(transformers.TrainerCallback)")
        if not (inspect.isclass(cls) and issubclass(cls, transformers.TrainerCallback)):
            what = f"a {type(cls).__name__}" if not inspect.isclass(cls) else "a class that does not subclass it"
            raise ConfigError(
                f"callbacks: {where}:{name} is {what}, not a transformers.TrainerCallback; "
                f"define class {name}(transformers.TrainerCallback)"
            )
        kwargs = kwargs_by_name.pop(spec, None)
        by_class = kwargs_by_name.pop(name, None)
        if kwargs is not None and by_class is not None:
            raise ConfigError(f"callback_kwargs: both '{spec}' and '{name}' are set: keep one")
        kwargs = kwargs if kwargs is not None else (by_class or {})
        if not isinstance(kwargs, dict):
            raise ConfigError(f"callback_kwargs: the arguments of {name} must be a mapping, got {kwargs!r}")
        try:
            inspect.signature(cls).bind(**kwargs)
        except TypeError as exc:
            raise ConfigError(f"callback_kwargs: {name}({', '.join(f'{k}=...' for k in kwargs)}): {exc}") from None
        resolved.append((cls, kwargs))
    if kwargs_by_name:
        raise ConfigError(
            f"callback_kwargs: {', '.join(repr(k) for k in kwargs_by_name)} names no entry of callbacks "
            f"({', '.join(specs)}); key them by class name"
        )
    return resolved


def build_user_callbacks(resolved: Sequence[tuple[type, dict[str, Any]]]) -> list[transformers.TrainerCallback]:
    """The user's callbacks, built from `resolve_user_callbacks`'s (class, kwargs) (constructors run here, once per
    process)."""
    built = []
    for cls, kwargs in resolved:
        try:
            built.append(cls(**kwargs))
        except Exception as exc:  # noqa: BLE001  (the user's constructor failed: say which)
            raise ConfigError(f"callbacks: building {cls.__name__} failed: {type(exc).__name__}: {exc}") from None
    if built:
        logger.info("callbacks: %s", ", ".join(type(c).__name__ for c in built))
    return built


# ---- early stopping -------------------------------------------------------------------------------------------


class EarlyStopping(transformers.EarlyStoppingCallback):
    """transformers' EarlyStoppingCallback (should_training_stop after `early_stopping_patience` evaluations
    without an improvement of more than `early_stopping_threshold` on metric_for_best_model, compared with
    the best so far), which also records why it stopped: `stopped` holds the step, the metric, its best value
    and the step of that best, and `reason` says it in words (logged, and written by the trainer into the run
    summary). With several eval sets each is evaluated on its own; only the one holding the metric counts."""

    def __init__(self, early_stopping_patience: int = 1, early_stopping_threshold: float = 0.0):
        super().__init__(early_stopping_patience, early_stopping_threshold)
        self.best_step: int | None = None
        self.stopped: dict[str, Any] | None = None

    @staticmethod
    def watched_metric(args) -> str:
        metric = args.metric_for_best_model or "eval_loss"
        return metric if metric.startswith("eval_") else f"eval_{metric}"

    def on_evaluate(self, args, state, control, metrics, **kwargs):
        metric = self.watched_metric(args)
        if metric not in metrics:  # another eval set's evaluation
            return
        super().on_evaluate(args, state, control, metrics, **kwargs)
        if self.early_stopping_patience_counter == 0:
            self.best_step = state.global_step
        # should_training_stop alone is also the normal end (max_steps): only the patience running out is ours.
        if self.early_stopping_patience_counter >= self.early_stopping_patience and self.stopped is None:
            best = state.best_metric
            self.stopped = {
                "step": state.global_step, "metric": metric, "last": float(metrics[metric]),
                "best": float(best) if best is not None else None, "best_step": self.best_step,
            }
            logger.info("%s", self.reason)

    @property
    def reason(self) -> str | None:
        if self.stopped is None:
            return None
        s = self.stopped
        threshold = f" by more than {self.early_stopping_threshold:g}" if self.early_stopping_threshold else ""
        return (
            f"early stopping at step {s['step']}: {s['metric']} has not improved{threshold} on its best "
            f"{s['best']:.6g} (step {s['best_step']}) for {self.early_stopping_patience} evaluation"
            f"{'s' if self.early_stopping_patience != 1 else ''} (last {s['last']:.6g}; early_stopping_patience: "
            f"{self.early_stopping_patience})"
        )

    def summary(self) -> dict[str, Any]:
        """What the run summary (the last log line, all_results.json) says about early stopping."""
        if self.stopped is None:
            return {}
        return {"early_stopping_step": self.stopped["step"], "early_stopping_reason": self.reason}

    def state(self) -> dict:
        state = super().state()
        state["attributes"]["best_step"] = self.best_step
        return state


class EvalMetricsCallback(transformers.TrainerCallback):
    """A callback that adds metrics to every evaluation: TunelabTrainer asks each one for
    `evaluation_metrics(model, metric_key_prefix)` when an eval set has been evaluated, and logs what it
    returns in the same line as eval_loss (so metric_for_best_model and early stopping can use it)."""

    def evaluation_metrics(self, model, metric_key_prefix: str) -> dict[str, float]:
        return {}


def run_callbacks(
    args, finetuning, user_callbacks: Sequence[tuple[type, dict[str, Any]]] = (), *extra: transformers.TrainerCallback
) -> list[transformers.TrainerCallback]:
    """The callbacks a stage hands to the Trainer: the jsonl log, QAT's start switch (qat_start_step), `extra`
    (the stage's own), EarlyStopping when configured, then the user's `callbacks` in their order (`user_callbacks`:
    the classes and arguments tunelab/preflight.py resolved). `args`: the run's TrainingArguments, `finetuning` its
    FinetuningArguments."""
    callbacks: list[transformers.TrainerCallback] = [
        JsonlLogCallback(args.output_dir), *qat_callbacks(finetuning), *extra,
    ]
    if args.early_stopping_patience is not None:
        callbacks.append(EarlyStopping(args.early_stopping_patience, args.early_stopping_threshold))
    return callbacks + build_user_callbacks(user_callbacks)
