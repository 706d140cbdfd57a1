"""What a run may execute or fetch: only what the config says.

- No pickle: tunelab's own code never unpickles (no pickle.load, every torch.load weights_only=True);
  weights are safetensors (pickle weights only with allow_pickle_weights: tests/model/test_hub.py), and
  transformers' checkpoint loading uses weights_only=True itself.
- Custom modelling code shipped in a model folder runs only with trust_remote_code: true.
- Hub ids are fetched into the Hugging Face cache as the user's environment says: the CLI leaves
  HF_HUB_OFFLINE to the user (tests/model/test_hub.py runs the offline path).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import yaml

from tunelab.assets import TINY_MODEL_DIR
from tunelab.cli import main
from tunelab.preflight import load_config

SRC = Path(__file__).resolve().parents[1] / "src" / "tunelab"


def test_no_unpickling_in_tunelab():
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        for match in re.finditer(r"torch\.load\((?:[^()]|\([^()]*\))*\)", text):
            if "weights_only=True" not in match.group(0):
                offenders.append(f"{path.relative_to(SRC)}: {match.group(0)}")
        offenders += [f"{path.relative_to(SRC)}: {m}" for m in re.findall(r"pickle\.loads?\(|dill\.loads?\(", text)]
        offenders += [f"{path.relative_to(SRC)}: {m}" for m in re.findall(r"trust_remote_code=True", text)]
    assert offenders == []


def remote_code_model(tmp_path: Path) -> Path:
    """The tiny Llama relabelled as an architecture only its own (booby-trapped) Python files define."""
    folder = tmp_path / "custom-model"
    shutil.copytree(TINY_MODEL_DIR, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="tiny_custom", auto_map={
        "AutoConfig": "configuration_tiny.TinyConfig", "AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM",
    })
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("configuration_tiny.py", "modeling_tiny.py"):
        (folder / name).write_text("raise SystemExit('custom code ran')\n")
    return folder


def write(tmp_path: Path, **options) -> Path:
    config = {"model_name_or_path": "tiny", "template": "chatml", "dataset": "demo_reverse",
              "output_dir": str(tmp_path / "out"), **options}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_custom_code_is_refused_without_trust_remote_code(tmp_path, capsys):
    folder = remote_code_model(tmp_path)
    assert main(["train", str(write(tmp_path, model_name_or_path=str(folder)))]) == 2
    assert capsys.readouterr().err == (
        f"tunelab: error: model_name_or_path: {folder} needs its own modelling code (configuration_tiny.py, "
        "modeling_tiny.py), which tunelab runs only with trust_remote_code: true; read that code first, then set "
        "trust_remote_code: true\n"
    )
    # Saying so passes the check (the code would then run when the model loads).
    config = load_config(write(tmp_path, model_name_or_path=str(folder), trust_remote_code=True))
    assert config.model.trust_remote_code is True


def test_auto_map_on_a_known_architecture_needs_no_remote_code(tmp_path):
    """Many Hub folders keep an auto_map although transformers ships the architecture: those load natively."""
    folder = tmp_path / "llama-with-auto-map"
    shutil.copytree(TINY_MODEL_DIR, folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_llama_custom.LlamaForCausalLM"}
    (folder / "config.json").write_text(json.dumps(config))
    assert load_config(write(tmp_path, model_name_or_path=str(folder))).model.trust_remote_code is False


@pytest.mark.parametrize("preset", [None, "1", "0"])
def test_the_cli_leaves_hf_hub_offline_to_the_user(monkeypatch, capsys, preset):
    if preset is None:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    else:
        monkeypatch.setenv("HF_HUB_OFFLINE", preset)
    assert main(["template", "list"]) == 0
    assert os.environ.get("HF_HUB_OFFLINE") == preset
    assert "chatml" in capsys.readouterr().out.split()
