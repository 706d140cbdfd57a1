"""Checkpoints: atomic writes checked by a manifest, finding the newest sound one, what tunelab adds to them.

transformers.Trainer (5.x) writes a checkpoint straight into `output_dir/checkpoint-N`: a kill during
the save leaves a half-written folder with the newest step number, which `get_last_checkpoint` then
picks. TunelabTrainer._save_checkpoint calls `save_checkpoint` below instead, which writes the same
files with the same Trainer methods, but

    output_dir/tmp-checkpoint-N/   every file written (model or adapter, optimizer, scheduler, scaler,
                                   RNG states, trainer_state.json, tunelab_state.json, the run's
                                   tunelab_config.yaml), then tunelab_manifest.json last: the size and
                                   SHA-256 of every other file; then everything fsynced
         │ rename (atomic on one filesystem), then the parent folder fsynced
         ▼
    output_dir/checkpoint-N/       exists only complete

so a crash at any moment leaves every `checkpoint-N` loadable; a leftover `tmp-checkpoint-N` is
deleted when the next run starts. A save that fails (a full disk) removes its staging folder and
raises the OSError it is. Old checkpoints are rotated (`save_total_limit`) only after the rename,
counting complete checkpoints only, and never the one just written.

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
from pathlib import Path
from typing import Any

import transformers

from tunelab.errors import as_os_error
from tunelab.run_folder import (
    CHECKPOINT_PREFIX, RUN_RECORD, RUN_STATE, STAGING_PREFIX, TRAINER_STATE, complete_checkpoints, write_manifest,
)
from tunelab.train.resume import resolve_resume

logger = logging.getLogger(__name__)

# Test hook: seconds to sleep after the weights are written into the staging folder, so a test can
# kill the process mid-save. Read only here; unset in normal runs.
SLOW_SAVE_ENV = "TUNELAB_TEST_SLOW_CHECKPOINT_SAVE"


# --- writing ----------------------------------------------------------------------------------


def fsync_tree(folder: Path) -> None:
    """Flush every file under folder, then the folders themselves, to disk."""
    for root, _dirs, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(root))


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # some platforms cannot open folders; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def publish(staging: Path, final: Path) -> None:
    """Make a fully written, fsynced staging folder the checkpoint `final`, atomically.

    A folder of that name may exist (a save at the same step, or a half-written folder left by
    another tool): it is moved aside first and deleted once the new one is in place.
    """
    fsync_tree(staging)
    old = None
    if final.exists():
        old = final.with_name(f"{STAGING_PREFIX}-replaced-{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(staging, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def remove_staging_leftovers(output_dir: str | Path) -> list[Path]:
    """Delete tmp-checkpoint-* folders a killed save left behind (never a complete checkpoint)."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    leftovers = [p for p in out.iterdir() if p.is_dir() and p.name.startswith(STAGING_PREFIX + "-")]
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


def save_checkpoint(trainer, trial=None) -> Path:
    """What Trainer._save_checkpoint writes, through a staging folder renamed when complete.

    Every process writes its part (weights, sharded optimizer, its RNG state) into the staging
    folder; the saving process then copies the run's options, writes the manifest, fsyncs and renames
    it, and rotates old checkpoints. A failed save removes the staging folder and raises the OSError it
    is (a full disk surfaces from torch.save as a RuntimeError without an errno).
    """
    args = trainer.args
    run_dir = Path(trainer._get_output_dir(trial=trial))
    staging = run_dir / f"{STAGING_PREFIX}-{trainer.state.global_step}"
    try:
        return _save_checkpoint(trainer, trial, run_dir, staging)
    except Exception as exc:
        error = as_os_error(exc, str(run_dir))  # before the staging folder goes: a full disk is still full
        if args.should_save:
            shutil.rmtree(staging, ignore_errors=True)
        if error is exc:
            raise
        raise error from exc


def _save_checkpoint(trainer, trial, run_dir: Path, staging: Path) -> Path:
    from transformers.trainer_callback import ExportableState  # noqa: PLC0415
    from transformers.trainer_utils import SaveStrategy  # noqa: PLC0415

    args, state = trainer.args, trainer.state
    final = run_dir / f"{CHECKPOINT_PREFIX}-{state.global_step}"
    if args.should_save and staging.exists():
        shutil.rmtree(staging)
    trainer.accelerator.wait_for_everyone()

    run_state = trainer.run_state()  # on every process: it reduces counters across them
    if trainer.hp_search_backend is None and trial is None:
        trainer.store_flos()
    trainer.save_model(str(staging), _internal_call=True)
    _slow_save_hook(staging)

    if args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST) and state.best_global_step:
        best = run_dir / f"{CHECKPOINT_PREFIX}-{state.best_global_step}"
        if best.exists() or state.best_global_step == state.global_step:
            state.best_model_checkpoint = str(best)
    if not args.save_only_model:
        trainer._save_optimizer_and_scheduler(str(staging))
        trainer._save_scaler(str(staging))
        trainer._save_rng_state(str(staging))
    if args.should_save:
        callbacks = [*trainer.callback_handler.callbacks, trainer.control]
        for callback in (cb for cb in callbacks if isinstance(cb, ExportableState)):
            name = callback.__class__.__name__
            if isinstance(state.stateful_callbacks[name], list):
                state.stateful_callbacks[name].append(callback.state())
            else:
                state.stateful_callbacks[name] = callback.state()
        (staging / RUN_STATE).write_text(json.dumps(run_state, indent=2) + "\n", encoding="utf-8")
        if (run_dir / RUN_RECORD).is_file():  # what config/checks.py compares a resume against
            shutil.copyfile(run_dir / RUN_RECORD, staging / RUN_RECORD)
        state.save_to_json(str(staging / TRAINER_STATE))
    trainer.accelerator.wait_for_everyone()

    if args.should_save:
        write_manifest(staging, state.global_step, optimizer_state=not args.save_only_model)  # last: marks it complete
        publish(staging, final)
        best = [Path(state.best_model_checkpoint)] if state.best_model_checkpoint else []
        rotate(run_dir, args.save_total_limit, keep=[final, *best])
        logger.info("checkpoint saved: %s", final)
    trainer.accelerator.wait_for_everyone()
    if args.push_to_hub:
        trainer._push_from_checkpoint(str(final))
    return final


def _slow_save_hook(staging: Path) -> None:
    delay = os.environ.get(SLOW_SAVE_ENV)
    if delay:
        logger.warning("%s=%s: sleeping mid-save in %s (test hook)", SLOW_SAVE_ENV, delay, staging)
        time.sleep(float(delay))


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
        from accelerate.utils import broadcast_object_list  # noqa: PLC0415

        checkpoint = broadcast_object_list([checkpoint], from_process=0)[0]
    if args.should_save:
        remove_staging_leftovers(args.output_dir)
    if checkpoint is not None:
        done = checkpoint_global_step(checkpoint)
        total = args.max_steps if args.max_steps > 0 else trainer.set_initial_training_values(
            args, trainer.get_train_dataloader()
        )[-1]
        if done >= total:
            raise NothingToTrain(checkpoint, done, total)
    return checkpoint


class RestoreRunState(transformers.TrainerCallback):
    """At train begin, after the Trainer reset its counters, put back what tunelab_state.json saved."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer.restore_run_state()
