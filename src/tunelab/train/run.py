"""Run a configured training job: set up logging and the output folder, dispatch to the stage."""

from __future__ import annotations

import logging

import transformers

from tunelab.config.args import RunConfig
from tunelab.train import outputs

logger = logging.getLogger("tunelab")


def setup_logging(is_main_process: bool = True) -> None:
    level = logging.INFO if is_main_process else logging.WARNING
    logging.basicConfig(format="[%(asctime)s %(levelname)s %(name)s] %(message)s", datefmt="%H:%M:%S", level=level)
    logging.getLogger("tunelab").setLevel(level)
    transformers.logging.set_verbosity_warning()


def run(config: RunConfig) -> dict:
    if config.training.process_index == 0:
        outputs.write_run_start(config)
    stage = config.finetuning.stage
    if stage == "sft":
        from tunelab.train.stages.sft import run_sft  # noqa: PLC0415

        return run_sft(config)
    if stage == "pt":
        from tunelab.train.stages.pt import run_pt  # noqa: PLC0415

        return run_pt(config)
    raise AssertionError(f"stage {stage} passed the config checks but has no workflow")
