"""Checkpoints: atomic writes, finding the newest complete one, and what tunelab adds to them.

transformers.Trainer (5.x) writes a checkpoint straight into `output_dir/checkpoint-N`: a kill during
the save leaves a half-written folder with the newest step number, which `get_last_checkpoint` then
picks. TunelabTrainer._save_checkpoint calls `save_checkpoint` below instead, which writes the same
files with the same Trainer methods, but

    output_dir/tmp-checkpoint-N/   every file written (model or adapter, optimizer, scheduler, scaler,
                                   RNG states, trainer_state.json, tunelab_state.json), then fsynced
         │ rename (atomic on one filesystem), then the parent folder fsynced
         ▼
    output_dir/checkpoint-N/       exists only complete

so a crash at any moment leaves every `checkpoint-N` loadable; a leftover `tmp-checkpoint-N` is
deleted when the next run starts. Old checkpoints are rotated (`save_total_limit`) only after the
rename, counting complete checkpoints only, and never the one just written.

`resume_from_checkpoint: true` resolves to the complete checkpoint with the highest step
(`latest_checkpoint`); a folder counts as complete when its trainer_state.json (the Trainer writes
it last) parses. tunelab_state.json carries what the Trainer does not save: our token counters,
the non-finite-step counters (guards.py) and the loss summed since the last log line, so the log
continues as if the run had never stopped.

What this module does not own: the data position (the Trainer fast-forwards its DataLoader, see
docs/reliability.md), the signal handling (signals.py) and the NaN guard (guards.py).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import transformers

from tunelab.errors import ConfigError

logger = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "checkpoint"  # transformers' PREFIX_CHECKPOINT_DIR
STAGING_PREFIX = "tmp-checkpoint"
TRAINER_STATE = "trainer_state.json"  # transformers' TRAINER_STATE_NAME
RUN_STATE = "tunelab_state.json"
# Test hook: seconds to sleep after the weights are written into the staging folder, so a test can
# kill the process mid-save. Read only here; unset in normal runs.
SLOW_SAVE_ENV = "TUNELAB_TEST_SLOW_CHECKPOINT_SAVE"

_CHECKPOINT_RE = re.compile(rf"^{CHECKPOINT_PREFIX}-(\d+)$")


# --- finding checkpoints ----------------------------------------------------------------------


def checkpoint_step(path: str | Path) -> int | None:
    match = _CHECKPOINT_RE.match(Path(path).name)
    return int(match.group(1)) if match else None


def is_complete(path: str | Path) -> bool:
    """A checkpoint folder whose trainer_state.json (written last) exists and parses."""
    state = Path(path) / TRAINER_STATE
    try:
        json.loads(state.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return True


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete `checkpoint-N` folders of output_dir, oldest step first."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = [(checkpoint_step(p), p) for p in out.iterdir() if p.is_dir() and checkpoint_step(p) is not None]
    return [p for _, p in sorted(found) if is_complete(p)]


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    checkpoints = complete_checkpoints(output_dir)
    return checkpoints[-1] if checkpoints else None


def resolve_resume(value: Any, output_dir: str | Path) -> str | None:
    """`resume_from_checkpoint` → the checkpoint folder to resume from, or None for a fresh start.

    true (or "true"/"last") means the newest complete checkpoint of output_dir; a path must be a
    complete checkpoint. Fails with a ConfigError naming the key and the fix.
    """
    if value is None or value is False or (isinstance(value, str) and value.lower() in ("", "false", "no", "none")):
        return None
    if value is True or (isinstance(value, str) and value.lower() in ("true", "yes", "last")):
        found = latest_checkpoint(output_dir)
        if found is None:
            raise ConfigError(
                f"resume_from_checkpoint: true, but output_dir {output_dir} holds no complete checkpoint "
                "(checkpoint-N with trainer_state.json); save some with save_strategy: steps and save_steps, "
                "point resume_from_checkpoint at a checkpoint folder, or remove it"
            )
        return str(found)
    path = Path(value)
    if not path.is_dir():
        raise ConfigError(f"resume_from_checkpoint: {path} is not a folder; give a checkpoint-N folder or true")
    if not is_complete(path):
        raise ConfigError(
            f"resume_from_checkpoint: {path} is not a complete checkpoint (no readable {TRAINER_STATE}); "
            "give another checkpoint-N folder, or true for the newest complete one"
        )
    return str(path)


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
    folder; the saving process(es) then fsync and rename it, and rotate old checkpoints.
    """
    from transformers.trainer_callback import ExportableState  # noqa: PLC0415
    from transformers.trainer_utils import SaveStrategy  # noqa: PLC0415

    args, state = trainer.args, trainer.state
    run_dir = Path(trainer._get_output_dir(trial=trial))
    final = run_dir / f"{CHECKPOINT_PREFIX}-{state.global_step}"
    staging = run_dir / f"{STAGING_PREFIX}-{state.global_step}"
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
        state.save_to_json(str(staging / TRAINER_STATE))  # last: its presence marks a complete checkpoint
    trainer.accelerator.wait_for_everyone()

    if args.should_save:
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


class RestoreRunState(transformers.TrainerCallback):
    """At train begin, after the Trainer reset its counters, put back what tunelab_state.json saved."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer.restore_run_state()
        if state.global_step and state.global_step >= state.max_steps:
            logger.warning(
                "resumed at step %d, which is max_steps: nothing is left to train; raise max_steps (or "
                "num_train_epochs) to continue", state.global_step,
            )
