"""Fixtures shared by the distributed training tests (tests/train/test_multinode.py, test_deepspeed.py, test_fsdp.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from tests.precisions import precision_env
from tests.train.test_ddp import CONFIG
from tunelab.cli import main


@pytest.fixture(scope="session")
def one_process_reference(tmp_path_factory) -> Callable[[str], Path]:
    """test_ddp's CONFIG trained by one process × batch 8: the run that 2 nodes, FSDP, ZeRO-2 and ZeRO-3 (each 8
    samples per step in all) must match. `reference(precision)` is its output folder, trained once per precision
    per session."""
    trained: dict[str, Path] = {}

    def reference(precision: str) -> Path:
        if precision not in trained:
            tmp = tmp_path_factory.mktemp(f"one-process-{precision}")
            cfg = tmp / "cfg.yaml"
            cfg.write_text(yaml.safe_dump(CONFIG))
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv("TUNELAB_CACHE", str(tmp / "cache"))
                for key, value in precision_env(precision).items():
                    patch.setenv(key, value)
                assert main(["train", str(cfg), f"output_dir={tmp / 'one'}", "per_device_train_batch_size=8"]) == 0
            trained[precision] = tmp / "one"
        return trained[precision]

    return reference
