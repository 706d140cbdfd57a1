"""Run a configured training job: set up logging, the open-file limit, the C allocator and the output folder, dispatch
to the stage."""

from __future__ import annotations

import errno
import logging

from tunelab.config.stages import stage_row
from tunelab.errors import ConfigError
from tunelab.model.vision import is_vision_model_folder
from tunelab.train import launch, outputs
from tunelab.train.plan import RunPlan
from tunelab.train.recipe import recipe_for
from tunelab.train.trackers import keep_trackers_local
from tunelab.train.open_files import is_open_file_exhaustion, open_file_fix, raise_open_file_limit

logger = logging.getLogger("tunelab")


def explain_error(exc: BaseException) -> str | None:
    """A one-line fix for an exception a run ended with, or None: running out of file descriptors however it
    surfaced (an OSError, torch's DataLoader RuntimeError, a worker's re-raised error), and explain_os_error's."""
    if is_open_file_exhaustion(exc):
        return open_file_fix()
    return explain_os_error(exc) if isinstance(exc, OSError) else None


def explain_os_error(exc: OSError) -> str | None:
    """A one-line fix for the OS errors training runs hit, or None."""
    if exc.errno == errno.EMFILE:
        return open_file_fix()
    if exc.errno == errno.ENOSPC:
        return f"no space left on device while writing {exc.filename or 'outputs'}: free space or change output_dir / TUNELAB_CACHE"
    if exc.errno == errno.EFBIG:
        return (
            f"file too large while writing {exc.filename or 'outputs'}: a file-size limit (ulimit -f) or the file "
            "system's maximum; raise the limit or change output_dir"
        )
    return None


def run(plan: RunPlan) -> dict:
    """The stage's workflow on a plan tunelab/preflight.py resolved; its metrics."""
    config = plan.config
    old, new = raise_open_file_limit()
    if new != old:
        logger.info("open-file limit raised from %s to %s (the soft limit, up to the hard one)", old, new)
    if config.precision is not None:
        logger.info("precision: %s", config.precision)
    if config.training.process_index == 0:
        outputs.write_run_start(config)
    keep_trackers_local(config.training.report_to, config.training.output_dir)
    launch.start_deepspeed_comm(config.training)
    stage = config.finetuning.stage
    if not stage_row(stage).vision and is_vision_model_folder(config.model.model_name_or_path):
        raise ConfigError(
            f"stage: {stage} is not supported for vision-language models yet (model_name_or_path "
            f"{config.model.model_name_or_path} is one); train it with stage: sft or dpo"
        )
    return recipe_for(plan).run()
