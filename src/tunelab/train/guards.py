"""The non-finite guard: never keep training on a NaN/inf loss or gradient norm.

Per optimizer step, TunelabTrainer feeds the guard every micro-batch loss (training_step) and the
gradient norm the Trainer computes before clipping (_get_grad_norm). Just before the optimizer step
(the `on_pre_optimizer_step` event) the guard decides, with one device sync per step:

    finite                          → the step runs; the run of bad steps resets
    non-finite, nan_policy: stop    → the gradients are dropped (the optimizer step changes nothing),
                                      training stops, and TunelabTrainer.train raises TrainingError
                                      with one line naming the step and the likely causes
    non-finite, nan_policy: skip    → the gradients are dropped, the step is counted (logged as
                                      skipped_nonfinite_steps) and training goes on; the
                                      nan_max_consecutive-th bad step in a row stops as above

Dropping the gradients (grad = None) makes torch optimizers leave those parameters and their
moments untouched, so the weights stay those of the last good step. The scheduler and the step
counter still advance, and the batch is consumed: a skipped step is one the data had, not one
retried. Under fp16 with a gradient scaler an infinite gradient norm is the scaler's own business
(it skips the step and lowers the scale), so only the loss is checked there. In distributed runs
the verdict is reduced across ranks, so every rank skips or stops together. Under DeepSpeed the
engine steps inside backward, before this check: the run stops (or counts), the step is not held back.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Literal

import torch
import transformers

logger = logging.getLogger(__name__)

Verdict = Literal["ok", "skip", "stop"]


@dataclass
class NonFiniteGuard:
    policy: Literal["stop", "skip"] = "stop"
    max_consecutive: int = 5
    skipped: int = 0  # steps skipped in this run, over resumes
    consecutive: int = 0
    stop_message: str | None = None
    _loss_bad: torch.Tensor | None = field(default=None, repr=False)
    _losses: list[torch.Tensor] = field(default_factory=list, repr=False)
    _grad_norm: torch.Tensor | float | None = field(default=None, repr=False)

    def observe_loss(self, loss: torch.Tensor) -> None:
        bad = ~torch.isfinite(loss.detach()).all()
        self._loss_bad = bad if self._loss_bad is None else self._loss_bad | bad
        self._losses.append(loss.detach())

    def observe_grad_norm(self, grad_norm) -> None:
        # Under FSDP2 (model/sharding.py) the norm of sharded gradients is a DTensor: its full value, a plain tensor
        # that the cross-rank reduction of the verdict can take.
        full_tensor = getattr(grad_norm, "full_tensor", None)
        self._grad_norm = full_tensor() if callable(full_tensor) else grad_norm

    def decide(
        self, step: int, check_grad_norm: bool = True, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
        hint: str = "",
    ) -> Verdict:
        """The verdict on optimizer step `step` (1-based) from what was observed since the last call."""
        loss_bad, losses, grad_norm = self._loss_bad, self._losses, self._grad_norm
        self._loss_bad, self._losses, self._grad_norm = None, [], None
        flags = [loss_bad if loss_bad is not None else torch.tensor(False)]
        if check_grad_norm and grad_norm is not None:
            norm = grad_norm if isinstance(grad_norm, torch.Tensor) else torch.tensor(float(grad_norm))
            flags.append(~torch.isfinite(norm.detach()))
        device = flags[0].device
        bad = torch.stack([f.to(device) for f in flags]).any().to(torch.int32)
        if reduce is not None:
            bad = reduce(bad)
        if not int(bad):  # the one device sync per step
            self.consecutive = 0
            return "ok"
        self.consecutive += 1
        what = self._describe(losses, grad_norm if check_grad_norm else None)
        if self.policy == "skip" and self.consecutive < self.max_consecutive:
            self.skipped += 1
            logger.warning(
                "step %d: %s; skipped this optimizer step (nan_policy: skip; %d skipped so far, %d in a row, "
                "stopping at %d in a row)", step, what, self.skipped, self.consecutive, self.max_consecutive,
            )
            return "skip"
        in_a_row = (
            f" ({self.consecutive} non-finite steps in a row, nan_max_consecutive: {self.max_consecutive})"
            if self.policy == "skip" else ""
        )
        self.stop_message = (
            f"training stopped at step {step}: {what}{in_a_row}; the step was not applied, so the weights are those "
            f"of step {step - 1}. Likely causes: {hint or 'learning_rate too high, or a bad data row'}"
        )
        return "stop"

    @staticmethod
    def _describe(losses: list[torch.Tensor], grad_norm) -> str:
        values = [float(x) for x in losses]
        bad = [v for v in values if not math.isfinite(v)]
        if bad:
            return f"the loss is {bad[0]}"
        norm = float(grad_norm) if grad_norm is not None else float("nan")
        return f"the gradient norm is {norm} (loss {values[-1]:.4g})" if values else f"the gradient norm is {norm}"

    def state_dict(self) -> dict:
        return {"skipped": self.skipped, "consecutive": self.consecutive}

    def load_state_dict(self, state: dict) -> None:
        self.skipped = int(state.get("skipped", 0))
        self.consecutive = int(state.get("consecutive", 0))


def likely_causes(args) -> str:
    """The causes worth naming for this run's settings, most likely first."""
    causes = [f"learning_rate {args.learning_rate:g} too high (lower it, or add warmup_steps)"]
    if getattr(args, "fp16", False):
        causes.append("fp16 overflow (use bf16 where the hardware supports it)")
    causes.append("a bad data row (check with `tunelab data verify`)")
    if args.max_grad_norm is None or args.max_grad_norm <= 0:
        causes.append("no gradient clipping (set max_grad_norm: 1.0)")
    return ", ".join(causes)


class NonFiniteCallback(transformers.TrainerCallback):
    """Applies the guard's verdict just before the optimizer step."""

    def __init__(self, guard: NonFiniteGuard, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 scaler_active: Callable[[], bool] = lambda: False):
        self.guard = guard
        self.reduce = reduce
        self.scaler_active = scaler_active

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        verdict = self.guard.decide(
            state.global_step + 1, check_grad_norm=not self.scaler_active(), reduce=self.reduce,
            hint=likely_causes(args),
        )
        if verdict == "ok":
            return
        for parameter in model.parameters():  # the optimizer step then leaves weights and moments as they are
            parameter.grad = None
        if verdict == "stop":
            control.should_training_stop = True
