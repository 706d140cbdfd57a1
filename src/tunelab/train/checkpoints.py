"""Checkpoints: what tunelab adds to the Trainer's, the manifest that marks one complete, rotation, a run's start.

transformers.Trainer (5.x) writes a checkpoint straight into `output_dir/checkpoint-N` (model or adapter,
optimizer, scheduler, scaler, RNG states, trainer_state.json), then fires `on_save`. CheckpointCallback.on_save
finishes it, on every process, through public events only:

    output_dir/checkpoint-N/   the Trainer's files, every process's part (a barrier waits for all of them)
                               + tunelab_state.json, the run's tunelab_config.yaml
                               every file fsynced, then tunelab_manifest.json LAST: the size and SHA-256 of
                               every other file (run_folder.write_manifest), fsynced with its folders

A checkpoint is complete when its manifest is there, so a crash at any moment of a save leaves a folder that
`resume_from_checkpoint: true` skips (resume.py) and rotation neither counts nor deletes. Around that:

- when a run starts, incomplete `checkpoint-N` folders above the step it starts from (saves a killed run did not
  finish, none of them resumable) are deleted, and so are `tmp-checkpoint-N` folders older tunelab versions staged
  saves in;
- before a save (`on_step_end` / `on_epoch_end` asking for one, a signal's save included), a folder already at
  that step, left by the run resumed from an older checkpoint, is deleted, so none of its files or its manifest
  outlive the new save. Under `save_strategy: best` the save is decided after the last event: such a folder is
  then written over, and its old manifest's checksums reject it if that save is cut short;
- rotation (`save_total_limit`) is ours: the Trainer's own runs inside its save, before the new manifest exists,
  and counts half-written folders, so the Trainer is given TrainingArguments without the limit, copied once when
  TunelabTrainer is built, and CheckpointCallback holds the run's (its TrainingArguments offer no other switch; a
  checkpoint's training_args.bin therefore records none; the plan's own TrainingArguments keep it). `rotate`
  runs after the manifest, counts complete checkpoints only, and never deletes the one just written or the best
  one; with `load_best_model_at_end` and `save_total_limit: 1` the end of training keeps only the best one, as
  transformers does;
- a save that fails (a full disk) leaves its half-written folder, which `managed_saves` deletes before raising the
  OSError the failure is (a full disk surfaces from torch.save as a RuntimeError without an errno).

Which checkpoint a run resumes from is resume.py's. tunelab_state.json carries what the Trainer does not save:
our token counters, the non-finite-step counters (guards.py) and the loss summed since the last log line, so the
log continues as if the run had never stopped; the copy of tunelab_config.yaml lets resume.py refuse to continue a
checkpoint of another run.

What this module does not own: the data position (the Trainer fast-forwards its DataLoader, see
docs/reliability.md), the signal handling (signals.py) and the NaN guard (guards.py).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import transformers
from accelerate.utils import broadcast_object_list

from tunelab.errors import as_os_error
from tunelab.run_folder import (
    CHECKPOINT_PREFIX, MANIFEST, RUN_RECORD, RUN_STATE, STAGING_PREFIX, TRAINER_STATE, checkpoint_folders,
    checkpoint_step, complete_checkpoints, is_complete, write_manifest,
)
from tunelab.train.resume import resolve_resume

logger = logging.getLogger(__name__)

# Test hook: seconds to sleep in every save once the Trainer has written its files, before the manifest, so a test
# can kill the process mid-save. Read only here; unset in normal runs.
SLOW_SAVE_ENV = "TUNELAB_TEST_SLOW_CHECKPOINT_SAVE"


# --- writing ----------------------------------------------------------------------------------


def fsync_tree(folder: Path) -> None:
    """Flush every file under folder, then the folders themselves, to disk."""
    for root, _dirs, files in os.walk(folder):
        for name in files:
            _fsync_file(Path(root) / name)
        _fsync_dir(Path(root))


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # some platforms cannot open folders
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def checkpoint_folder(args, state) -> Path:
    """Where the Trainer saves the checkpoint of the current step (`output_dir/checkpoint-N`)."""
    return Path(args.output_dir) / f"{CHECKPOINT_PREFIX}-{state.global_step}"


def unfinished_saves(output_dir: str | Path, after_step: int) -> list[Path]:
    """Folders of saves that did not finish: incomplete `checkpoint-N` folders with N above `after_step` (the step
    a run starts from; at or below it an incomplete folder may be a checkpoint written by transformers or an older
    tunelab, which a run can still be pointed at), and any `tmp-checkpoint-N` staging folder of an older tunelab."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    staged = [p for p in out.iterdir() if p.is_dir() and p.name.startswith(STAGING_PREFIX + "-")]
    cut_short = [p for p in checkpoint_folders(out) if checkpoint_step(p) > after_step and not is_complete(p)]
    return staged + cut_short


def remove_unfinished_saves(output_dir: str | Path, after_step: int) -> list[Path]:
    """Delete `unfinished_saves` (never a complete checkpoint)."""
    leftovers = unfinished_saves(output_dir, after_step)
    for path in leftovers:
        logger.info("removing %s, left by a save that did not finish", path)
        shutil.rmtree(path, ignore_errors=True)
    return leftovers


def rotate(output_dir: str | Path, limit: int | None, keep: list[Path]) -> list[Path]:
    """Delete the oldest complete checkpoints beyond `limit`; never one in `keep` (the one just
    written, the best one). Half-written folders are neither counted nor deleted."""
    if not limit or limit <= 0:
        return []
    keep_names = {Path(p).name for p in keep}
    checkpoints = complete_checkpoints(output_dir)
    excess = len(checkpoints) - max(limit, len(keep_names))
    deleted = []
    for path in checkpoints:
        if excess <= 0:
            break
        if path.name in keep_names:
            continue
        logger.info("deleting %s (save_total_limit: %d)", path, limit)
        shutil.rmtree(path, ignore_errors=True)
        deleted.append(path)
        excess -= 1
    return deleted


def finish_checkpoint(trainer, limit: int | None) -> Path:
    """Complete the checkpoint the Trainer just saved (called from on_save on every process): tunelab_state.json,
    the run record, the manifest last, then rotation down to `limit`."""
    args, state = trainer.args, trainer.state
    run_dir, folder = Path(args.output_dir), checkpoint_folder(args, state)
    trainer.accelerator.wait_for_everyone()  # every process has written its part (its RNG state, its shards)
    run_state = trainer.run_state()  # on every process: it reduces counters across them
    if args.should_save:
        (folder / RUN_STATE).write_text(json.dumps(run_state, indent=2) + "\n", encoding="utf-8")
        if (run_dir / RUN_RECORD).is_file():  # what resume.py compares a resume against
            shutil.copyfile(run_dir / RUN_RECORD, folder / RUN_RECORD)
        _slow_save_hook(folder)
        fsync_tree(folder)  # every file on disk before the manifest says it is there
        write_manifest(folder, state.global_step, optimizer_state=not args.save_only_model)  # last: marks it complete
        _fsync_file(folder / MANIFEST)
        _fsync_dir(folder)
        _fsync_dir(run_dir)
        best = [Path(state.best_model_checkpoint)] if state.best_model_checkpoint else []
        rotate(run_dir, limit, keep=[folder, *best])
        logger.info("checkpoint saved: %s", folder)
    trainer.accelerator.wait_for_everyone()
    return folder


def _slow_save_hook(folder: Path) -> None:
    delay = os.environ.get(SLOW_SAVE_ENV)
    if delay:
        logger.warning("%s=%s: sleeping mid-save in %s (test hook)", SLOW_SAVE_ENV, delay, folder)
        time.sleep(float(delay))


class CheckpointCallback(transformers.TrainerCallback):
    """tunelab's part of the Trainer's checkpoints (the module docstring), and at train begin, after the Trainer
    reset its counters, what tunelab_state.json saved. `limit`: the run's save_total_limit, which the Trainer's own
    TrainingArguments do not hold (TunelabTrainer)."""

    def __init__(self, trainer, limit: int | None = None):
        self.trainer = trainer
        self.limit = limit

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer.restore_run_state()

    def on_step_end(self, args, state, control, **kwargs):
        self._clear_folder_of_this_step(args, state, control)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._clear_folder_of_this_step(args, state, control)

    def _clear_folder_of_this_step(self, args, state, control) -> None:
        if not control.should_save:
            return
        folder = checkpoint_folder(args, state)
        if args.should_save and folder.exists():
            logger.info("deleting %s, left by an earlier run, before this run saves step %d", folder, state.global_step)
            shutil.rmtree(folder)
        self.trainer.accelerator.wait_for_everyone()  # no process writes its part into the old folder

    def on_save(self, args, state, control, **kwargs):
        self.trainer.last_checkpoint = str(finish_checkpoint(self.trainer, self.limit))

    def on_train_end(self, args, state, control, **kwargs):
        # transformers' own end-of-training rule for the limit it does not hold: save_total_limit 1 keeps the best only
        if self.limit != 1 or not args.should_save or not state.best_model_checkpoint:
            return
        for path in complete_checkpoints(args.output_dir):
            if path.name != Path(state.best_model_checkpoint).name:
                logger.info("deleting %s (save_total_limit: 1 keeps the best checkpoint only)", path)
                shutil.rmtree(path, ignore_errors=True)


@contextmanager
def managed_saves(trainer, checkpoint: str | None) -> Iterator[None]:
    """Around Trainer.train: a save that fails turned into the OSError it is once its half-written folder is gone.
    `checkpoint`: the one the run resumes from (None: a fresh start); every incomplete folder above its step is this
    run's (resume_point removed the older ones)."""
    args = trainer.args
    start = checkpoint_global_step(checkpoint) if checkpoint else 0
    try:
        yield
    except Exception as exc:
        error = as_os_error(exc, str(args.output_dir))  # before the folder goes: a full disk is still full
        unfinished = unfinished_saves(args.output_dir, start)
        if args.should_save:
            remove_unfinished_saves(args.output_dir, start)
        if unfinished and error is not exc:
            raise error from exc
        raise


def read_run_state(checkpoint: str | Path) -> dict[str, Any]:
    path = Path(checkpoint) / RUN_STATE
    if not path.is_file():  # a checkpoint written by plain transformers
        return {}
    return json.loads(path.read_text(encoding="utf-8"))


class NothingToTrain(Exception):
    """Resuming a checkpoint at or past the run's last step. Not an error: the CLI says so and exits 0, and
    nothing in output_dir changes (no step, no checkpoint, no final save)."""

    def __init__(self, checkpoint: str, step: int, max_steps: int):
        self.checkpoint, self.step, self.max_steps = checkpoint, step, max_steps
        super().__init__(
            f"{checkpoint} is at step {step} and this run ends at step {max_steps}: nothing is left to train "
            "and the weights in output_dir are unchanged; raise max_steps (or num_train_epochs) to train further"
        )


def checkpoint_global_step(checkpoint: str | Path) -> int:
    return int(json.loads((Path(checkpoint) / TRAINER_STATE).read_text(encoding="utf-8")).get("global_step", 0))


def resume_point(trainer, value: Any) -> str | None:
    """The checkpoint TunelabTrainer.train resumes from (None: a fresh start), the same on every process.

    The main process resolves `value` (config/checks.py verified the checksums before anything loaded; here
    the files are checked again by size) and tells the others. Raises NothingToTrain when the checkpoint
    already reached the run's last step.
    """
    args = trainer.args
    checkpoint = None
    if args.process_index == 0:
        checkpoint = resolve_resume(
            value, args.output_dir, weights_only=getattr(args, "resume_weights_only", False), checksums=False
        )
    if args.world_size > 1:
        checkpoint = broadcast_object_list([checkpoint], from_process=0)[0]
    done = checkpoint_global_step(checkpoint) if checkpoint is not None else 0
    if args.should_save:
        remove_unfinished_saves(args.output_dir, after_step=done)
    if checkpoint is not None:
        # set_initial_training_values is public; its last value is max_steps (tests/test_private_names.py pins that)
        total = args.max_steps if args.max_steps > 0 else trainer.set_initial_training_values(
            args, trainer.get_train_dataloader()
        )[-1]
        if done >= total:
            raise NothingToTrain(checkpoint, done, total)
    return checkpoint
