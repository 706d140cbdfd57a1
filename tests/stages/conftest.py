"""The starting point of the alignment stages: the embedded tiny Llama after a short full SFT.

Built once per test session through the real CLI. It answers the synthetic tasks (sort, reverse) only
part of the time, which leaves room for rm/dpo/kto/grpo/ppo to show improvement.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tunelab.cli import main

SFT_BASE_CONFIG = {
    "model_name_or_path": "tiny", "stage": "sft", "finetuning_type": "full", "template": "chatml",
    "dataset": "demo_sort,demo_reverse", "max_samples": 1200, "cutoff_len": 64,
    "per_device_train_batch_size": 32, "learning_rate": 2e-3, "lr_scheduler_type": "cosine",
    "max_steps": 60, "logging_steps": 20, "seed": 0, "disable_tqdm": True, "plot_loss": False,
}


@pytest.fixture(scope="session")
def sft_model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sft-base")
    out = folder / "model"
    config = folder / "sft.yaml"
    config.write_text(yaml.safe_dump({**SFT_BASE_CONFIG, "output_dir": str(out)}))
    assert main(["train", str(config)]) == 0
    return out
