"""Fixtures shared by the distributed training tests (tests/train/test_multinode.py, test_deepspeed.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.train.test_ddp import CONFIG
from tunelab.cli import main


@pytest.fixture(scope="session")
def one_process_reference(tmp_path_factory) -> Path:
    """test_ddp's CONFIG trained by one process × batch 8: the run that 2 nodes, ZeRO-2 and ZeRO-3 (each 8 samples
    per step in all) must match. Trained once per session; its output folder."""
    tmp = tmp_path_factory.mktemp("one-process")
    cfg = tmp / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(CONFIG))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TUNELAB_CACHE", str(tmp / "cache"))
        assert main(["train", str(cfg), f"output_dir={tmp / 'one'}", "per_device_train_batch_size=8"]) == 0
    return tmp / "one"
