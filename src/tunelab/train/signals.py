"""SIGTERM / SIGINT during training: finish the step, save a checkpoint, stop, say how to resume.

While TunelabTrainer.train runs, `StopOnSignal` replaces the SIGTERM and SIGINT handlers with one
that only records the signal. At the next optimizer-step boundary (`on_step_end`) the callback asks
the Trainer to save a checkpoint (complete once its manifest is written, checkpoints.py) and stop; TunelabTrainer.train then
raises TrainingInterrupted, which the CLI prints as one line with the exact command to resume and
turns into exit code 128 + the signal number (143 for SIGTERM, 130 for SIGINT), the code a shell
reports for a process the signal ended, so `tunelab train ... && next-step` does not go on.

A second signal does not wait: SIGINT raises KeyboardInterrupt, SIGTERM gets its default action
(the process ends at once; the last complete checkpoint is still intact). In distributed runs the
flag is reduced across ranks at every step boundary, so all ranks save and stop at the same step
even when only one received the signal. Handlers are only installed from the main thread and are
restored when train() returns.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Callable

import torch
import transformers

logger = logging.getLogger(__name__)

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class TrainingInterrupted(Exception):
    """Training stopped on a signal after saving a checkpoint; resumable with resume_from_checkpoint.

    Not a TunelabError: nothing is wrong with the run; the CLI prints how to resume (exit_code)."""

    def __init__(self, signum: int, step: int, checkpoint: str | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        name = signal.Signals(signum).name
        where = f"checkpoint saved to {checkpoint}" if checkpoint else "no checkpoint could be saved"
        super().__init__(f"{name} received: training stopped at step {step}, {where}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopOnSignal(transformers.TrainerCallback):
    def __init__(self, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.reduce = reduce
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        self.received = None
        if threading.current_thread() is not threading.main_thread():
            logger.debug("training runs outside the main thread: SIGTERM/SIGINT keep their handlers")
            return
        for signum in HANDLED_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.received is not None:  # the second signal: stop now
            self.uninstall()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.received = signum
        logger.warning(
            "%s received: finishing this step, then saving a checkpoint and stopping (send it again to stop now)",
            signal.Signals(signum).name,
        )

    def on_step_end(self, args, state, control, **kwargs):
        signum = self.received or 0
        if self.reduce is not None:  # every rank stops at the same step (one collective per step)
            signum = int(self.reduce(torch.tensor(signum, dtype=torch.int32)))
        if signum:
            self.received = self.received or signum
            control.should_save = True
            control.should_training_stop = True
