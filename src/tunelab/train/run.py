"""Run a configured training job: set up logging and the output folder, dispatch to the stage."""

from __future__ import annotations

import errno
import logging
import resource

import transformers

from tunelab.config.args import RunConfig
from tunelab.train import outputs

logger = logging.getLogger("tunelab")


def setup_logging(is_main_process: bool = True) -> None:
    level = logging.INFO if is_main_process else logging.WARNING
    logging.basicConfig(format="[%(asctime)s %(levelname)s %(name)s] %(message)s", datefmt="%H:%M:%S", level=level)
    logging.getLogger("tunelab").setLevel(level)
    transformers.logging.set_verbosity_warning()


def raise_open_file_limit() -> tuple[int, int]:
    """Lift the soft open-file limit to the hard one (DataLoader workers and Arrow memory maps each
    hold descriptors; a 1024 soft limit is a classic "Too many open files" crash). Returns (old, new)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):  # some containers refuse; the error message below still guides the user
        return soft, soft
    return soft, target


def explain_os_error(exc: OSError) -> str | None:
    """A one-line fix for the OS errors training runs hit, or None."""
    if exc.errno == errno.EMFILE:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return (
            f"too many open files (limit {soft}): raise it with `ulimit -n 65536` before the run, "
            "or lower dataloader_num_workers / preprocessing_num_workers"
        )
    if exc.errno == errno.ENOSPC:
        return f"no space left on device while writing {exc.filename or 'outputs'}: free space or change output_dir / TUNELAB_CACHE"
    if exc.errno == errno.EFBIG:
        return (
            f"file too large while writing {exc.filename or 'outputs'}: a file-size limit (ulimit -f) or the file "
            "system's maximum; raise the limit or change output_dir"
        )
    return None


def run(config: RunConfig) -> dict:
    raise_open_file_limit()
    if config.training.process_index == 0:
        outputs.write_run_start(config)
    stage = config.finetuning.stage
    if stage == "sft":
        from tunelab.train.stages.sft import run_sft  # noqa: PLC0415

        return run_sft(config)
    if stage == "pt":
        from tunelab.train.stages.pt import run_pt  # noqa: PLC0415

        return run_pt(config)
    if stage in ("rm", "dpo", "kto"):
        from tunelab.train.stages import dpo, kto, rm  # noqa: PLC0415

        return {"rm": rm.run_rm, "dpo": dpo.run_dpo, "kto": kto.run_kto}[stage](config)
    if stage == "grpo":
        from tunelab.train.stages.grpo import run_grpo  # noqa: PLC0415

        return run_grpo(config)
    if stage == "ppo":
        from tunelab.train.stages.ppo import run_ppo  # noqa: PLC0415

        return run_ppo(config)
    raise AssertionError(f"stage {stage} passed the config checks but has no workflow")
