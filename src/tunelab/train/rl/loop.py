"""The training loop grpo and ppo share, written out on `accelerate.Accelerator`.

One round: take `gradient_accumulation_steps` batches of prompts, roll each out (generate, score,
compute old / reference log-probs — no gradients), then take `num_iterations` optimizer steps on
those rollouts, accumulating the micro-batches' gradients into each step:

    for round:
        started = [algorithm.start_rollout(prompts) for prompts in next accum batches]   # generate
        rollouts = [algorithm.finish_rollout(batch) for batch in started]   # scores, log-probs, statistics
        algorithm.begin_round(rollouts)              # what spans the round (grpo: dapo's token count)
        repeat num_iterations:                       # μ in the GRPO paper
            for rollout in rollouts: backward(algorithm.loss(rollout) / accum)
            clip gradients, optimizer step, scheduler step          → global_step += 1

A rollout is started and finished in two calls so that what does not need the model can run while the model
works: grpo scores each batch's completions on a background thread while the round's next batches generate
(grpo.py says why that cannot change results). Everything that touches the model runs here, in batch order.

Steps are optimizer steps: max_steps when set, else num_train_epochs passes over the prompts
(× num_iterations). DDP comes from the Accelerator the launcher set up (torchrun / accelerate
launch): each process draws its own prompts; gradients are averaged. Dropout stays off (the model is
in eval mode throughout) so that the policy ratio compares the same function before and after a step.

Each log line gets the fields the Trainer's lines get (callbacks.RunProgress: rates, ETA, memory) and goes to
the same callbacks a Trainer would hand it to: JsonlLogCallback (trainer_log.jsonl) and the trackers of `report_to`
(transformers' integrations, train/trackers.py), which also see on_train_begin and on_train_end. No other
TrainerCallback event fires here, so the config refuses `callbacks` and early stopping (which need the Trainer's
events and evaluations) for grpo and ppo with one line each (config/checks.py).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
import transformers
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader
from transformers.integrations import get_reporting_integration_callbacks

from tunelab import run_folder
from tunelab.config.args import FinetuningArguments
from tunelab.errors import DataError
from tunelab.train.callbacks import JsonlLogCallback, RunProgress
from tunelab.train.console import console_line
from tunelab.train.optimizers import build_optimizer, default_optimizer

if TYPE_CHECKING:
    from tunelab.config.training_args import TrainingArguments

logger = logging.getLogger(__name__)


class Algorithm(Protocol):
    def start_rollout(self, rows: list[dict]) -> object: ...  # generate; may start work in the background

    def finish_rollout(self, started: object) -> object: ...  # no gradients; records its own statistics

    def begin_round(self, rollouts: list) -> None: ...  # what spans the round (grpo: dapo's token count)

    def loss(self, rollout: object) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...

    def close(self) -> None: ...  # the run is over (or failed): stop what start_rollout left in the background


def build_accelerator(args: TrainingArguments) -> Accelerator:
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "no"
    return Accelerator(mixed_precision=precision, cpu=args.use_cpu)


def loop_optimizer(model: nn.Module, args: TrainingArguments,
                   finetuning: FinetuningArguments) -> torch.optim.Optimizer:
    """The optimizer the options ask for (train/optimizers.py), else the one transformers.Trainer would build."""
    optimizer = build_optimizer(model, args, finetuning)
    return default_optimizer(model, args) if optimizer is None else optimizer


class RLLoop:
    """Prompt batches, optimizer and scheduler, step counting and logging for one run."""

    def __init__(self, args: TrainingArguments, finetuning: FinetuningArguments, accelerator: Accelerator,
                 model: nn.Module, prompts, num_iterations: int):
        self.args, self.accelerator, self.num_iterations = args, accelerator, num_iterations
        self.accum = args.gradient_accumulation_steps
        generator = torch.Generator().manual_seed(args.seed)
        loader = DataLoader(
            prompts, batch_size=args.per_device_train_batch_size, shuffle=True, drop_last=True,
            collate_fn=list, generator=generator,
        )
        self.loader = accelerator.prepare(loader)  # each process gets its own share of the prompts
        self.rounds_per_epoch = len(self.loader) // self.accum
        if self.rounds_per_epoch == 0:
            raise DataError(
                f"{len(prompts)} prompts are fewer than one step takes (per_device_train_batch_size × "
                "gradient_accumulation_steps × processes); add data or lower the batch size"
            )
        if args.max_steps > 0:
            self.max_steps = args.max_steps
        else:
            self.max_steps = math.ceil(args.num_train_epochs * self.rounds_per_epoch) * num_iterations
        optimizer = loop_optimizer(model, args, finetuning)
        scheduler = transformers.get_scheduler(
            args.lr_scheduler_type, optimizer, num_warmup_steps=args.get_warmup_steps(self.max_steps),
            num_training_steps=self.max_steps, scheduler_specific_kwargs=args.lr_scheduler_kwargs or {},
        )
        self.model, self.optimizer, self.scheduler = accelerator.prepare(model, optimizer, scheduler)
        self.state = transformers.TrainerState(
            max_steps=self.max_steps, logging_steps=args.logging_steps,
            is_world_process_zero=accelerator.is_main_process, is_local_process_zero=accelerator.is_local_main_process,
        )
        trackers = [tracker() for tracker in get_reporting_integration_callbacks(args.report_to)]
        self.callbacks: list[transformers.TrainerCallback] = [JsonlLogCallback(args.output_dir), *trackers]
        self.control = transformers.TrainerControl()
        self.progress = RunProgress()
        self.rounds = 0
        self.pending: dict[str, list[float]] = defaultdict(list)
        self._batches = self._endless_batches()

    def _endless_batches(self) -> Iterator[list[dict]]:
        epoch = 0
        while True:
            if hasattr(self.loader, "set_epoch"):
                self.loader.set_epoch(epoch)
            yield from self.loader
            epoch += 1

    def train(self, algorithm: Algorithm) -> dict[str, float]:
        """Run to max_steps; returns the train metrics of the whole run."""
        self.progress.begin()
        if self.accelerator.is_main_process:  # a fresh run's samples only (rl stages do not resume)
            (Path(self.args.output_dir) / run_folder.COMPLETIONS).unlink(missing_ok=True)
        self._event("on_train_begin")
        self.model.eval()  # dropout off: see the module docstring
        try:
            while self.state.global_step < self.max_steps:
                started = [algorithm.start_rollout(next(self._batches)) for _ in range(self.accum)]
                rollouts = [algorithm.finish_rollout(batch) for batch in started]
                algorithm.begin_round(rollouts)
                self.rounds += 1
                for _ in range(min(self.num_iterations, self.max_steps - self.state.global_step)):
                    for index, rollout in enumerate(rollouts):
                        last = index == len(rollouts) - 1
                        with self.accelerator.no_sync(self.model) if not last else contextlib.nullcontext():
                            loss, stats = algorithm.loss(rollout)
                            self.accelerator.backward(loss / self.accum)
                        self.record({"loss": loss.detach(), **stats})
                    self._optimizer_step()
        finally:
            algorithm.close()
        self._event("on_train_end")
        return {"train_steps": self.state.global_step, "train_rounds": self.rounds}

    def _event(self, event: str, **kwargs) -> None:
        """Call `event` of each callback with what the Trainer's handler passes (the policy as the model)."""
        model = self.accelerator.unwrap_model(self.model)
        model = getattr(model, "policy", model)  # ppo trains the policy and its value head as one module
        for callback in self.callbacks:
            getattr(callback, event)(self.args, self.state, self.control, model=model, optimizer=self.optimizer,
                                     lr_scheduler=self.scheduler, **kwargs)

    def _optimizer_step(self) -> None:
        if self.args.max_grad_norm and self.args.max_grad_norm > 0:
            grad_norm = self.accelerator.clip_grad_norm_(self.model.parameters(), self.args.max_grad_norm)
            self.record({"grad_norm": grad_norm})
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.global_step += 1
        self.state.epoch = self.rounds / self.rounds_per_epoch
        if self.state.global_step % self.args.logging_steps == 0 or self.state.global_step == self.max_steps:
            self._log()

    def record_samples(self, samples: list[dict]) -> None:
        """Append the main process's rollouts of the step being made to completions.jsonl (grpo)."""
        if self.accelerator.is_main_process:
            step = self.state.global_step + 1
            run_folder.append_records(self.args.output_dir, run_folder.COMPLETIONS,
                                      [{"step": step, **sample} for sample in samples])

    def record(self, stats: dict[str, float | torch.Tensor]) -> None:
        """Add statistics to the running averages of the next log line."""
        for key, value in stats.items():
            self.pending[key].append(float(value))

    def _log(self) -> None:
        keys = sorted(self.pending)
        local = torch.tensor([sum(self.pending[k]) / len(self.pending[k]) for k in keys], device=self.accelerator.device)
        values = self.accelerator.reduce(local, reduction="mean") if self.accelerator.num_processes > 1 else local
        logs = {k: round(float(v), 6) for k, v in zip(keys, values)}
        logs["learning_rate"] = self.scheduler.get_last_lr()[0]
        self.pending.clear()
        logs["epoch"] = self.state.epoch
        self.progress.add_to(logs, self.state, self.accelerator.device)
        if self.accelerator.is_main_process:  # the line the Trainer's stages print (console.py)
            logger.info("%s", console_line(logs, self.state.global_step, self.max_steps))
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self._event("on_log", logs=logs)

    def final_metrics(self, keys: tuple[str, ...]) -> dict[str, float]:
        """`<key>_first` / `<key>_last`: the value on the first and the last log line, to show a trend."""
        out = {}
        for key in keys:
            values = [record[key] for record in self.state.log_history if key in record]
            if values:
                out[f"{key}_first"], out[f"{key}_last"] = values[0], values[-1]
        return out
