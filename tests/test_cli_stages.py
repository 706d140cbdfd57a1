"""Every command that reads a run without training it works for every stage of the table (config/stages.py):
estimate, data stats | verify | coverage and train --help, on the embedded tiny model, each from the stage's
example config, with no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tunelab.cli import main
from tunelab.config.stages import STAGE_NAMES, stage_row

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def example_of(stage: str) -> Path:
    """The stage's example config (examples/*.yaml): every stage of the table has one."""
    for path in sorted(EXAMPLES.glob("*.yaml")):
        if (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("stage") == stage:
            return path
    raise AssertionError(f"no examples/*.yaml has stage: {stage}")


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory) -> Path:
    """A reward model folder as stage rm saves one, on the tiny model (its head is random: nothing is scored)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer  # noqa: PLC0415

    from tunelab.assets import TINY_MODEL_DIR  # noqa: PLC0415

    folder = tmp_path_factory.mktemp("rm")
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    model = AutoModelForSequenceClassification.from_pretrained(
        TINY_MODEL_DIR, num_labels=1, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def options(stage: str, folder: Path, reward_model_dir: Path) -> list[str]:
    overrides = ["model_name_or_path=tiny", f"output_dir={folder / 'run'}", "max_samples=16"]
    if stage_row(stage).scorer == "reward_model":
        overrides.append(f"reward_model={reward_model_dir}")
    return overrides


def run_cleanly(argv: list[str], capsys) -> None:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, f"tunelab {' '.join(argv[:2])}: {err or out}"
    assert "Traceback" not in out + err


@pytest.mark.parametrize("stage", STAGE_NAMES)
def test_estimate_and_train_help_run_for_every_stage(stage, reward_model_dir, tmp_path, capsys):
    config, overrides = str(example_of(stage)), options(stage, tmp_path, reward_model_dir)
    run_cleanly(["estimate", config, "--probe-steps", "0", *overrides], capsys)
    with pytest.raises(SystemExit) as exit_:
        main(["train", config, *overrides, "--help"])
    assert exit_.value.code == 0
    assert "usage: tunelab train" in capsys.readouterr().out


@pytest.mark.parametrize("stage", STAGE_NAMES)
@pytest.mark.slow  # over 2 s on the 2-core AVX2 reference: out of test-fast
def test_data_commands_run_for_every_stage(stage, reward_model_dir, tmp_path, capsys):
    config, overrides = str(example_of(stage)), options(stage, tmp_path, reward_model_dir)
    for command in ("stats", "verify", "coverage"):
        run_cleanly(["data", command, config, *overrides], capsys)
