"""Shared by the reliability tests: short real runs of the embedded tiny model through the CLI."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from tunelab.cli import main
from tunelab.run_folder import read_log

REPO_ROOT = Path(__file__).resolve().parents[2]

BASE = {
    "model_name_or_path": "tiny", "template": "chatml", "dataset": "demo_reverse", "max_samples": 48,
    "cutoff_len": 64, "per_device_train_batch_size": 4, "learning_rate": 2e-3, "logging_steps": 1,
    "seed": 0, "disable_tqdm": True, "plot_loss": False, "finetuning_type": "lora",
    "save_strategy": "steps", "save_steps": 3, "max_steps": 6, "dataloader_num_workers": 0,
}


def write_config(folder: Path, **options) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "cfg.yaml"
    path.write_text(yaml.safe_dump({**BASE, "output_dir": str(folder / "out"), **options}))
    return path


def train(config: Path, *overrides: str) -> int:
    return main(["train", str(config), *overrides])


def losses(output_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_log(output_dir) if "loss" in r}


def weights(folder: Path) -> dict[str, torch.Tensor]:
    for name in ("adapter_model.safetensors", "model.safetensors"):
        if (folder / name).is_file():
            return load_file(folder / name)
    raise AssertionError(f"no weights in {folder}")


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of a `python -m tunelab.cli` subprocess: this checkout's sources first."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT / "src"), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def cli_command(config: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "tunelab.cli", "train", str(config), *overrides]
