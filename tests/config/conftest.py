"""Config-test fixtures: a model folder that passes the pre-load checks, and a minimal run config around it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A model folder that passes the pre-load checks (config.json + a chat template)."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    return folder


@pytest.fixture
def base(tmp_path: Path, model_dir: Path) -> dict:
    return {
        "model_name_or_path": str(model_dir),
        "dataset": "demo_reverse",
        "template": "chatml",
        "output_dir": str(tmp_path / "out"),
    }
