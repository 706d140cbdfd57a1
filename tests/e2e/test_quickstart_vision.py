"""examples/quickstart_vision.yaml as the docs run it: the tiny LLaVA learns to answer questions about pictures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tunelab.cli import main

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_vision_quickstart_shows_learning(tmp_path, capsys):
    """Held-out exact match (pictures never trained on) rises by at least 30 points, printed before and after."""
    config = yaml.safe_load((REPO_ROOT / "examples" / "quickstart_vision.yaml").read_text())
    assert config["model_name_or_path"] == "tiny-vision" and config["dataset"] == "demo_shapes"
    path = tmp_path / "quickstart_vision.yaml"
    path.write_text(yaml.safe_dump({**config, "output_dir": str(tmp_path / "out"), "disable_tqdm": True}))
    assert main(["train", str(path)]) == 0
    metrics = json.loads((tmp_path / "out" / "all_results.json").read_text())
    assert metrics["exact_match_after"] - metrics["exact_match_before"] >= 0.30
    before, after = 100 * metrics["exact_match_before"], 100 * metrics["exact_match_after"]
    assert f"exact match (held-out): before {before:.1f}% → after {after:.1f}%" in capsys.readouterr().out
