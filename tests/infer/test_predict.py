"""Batch prediction at the end of training (do_predict) and with `tunelab eval` on the saved adapter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tunelab.cli import main
from tunelab.data.templates import get_template
from tunelab.infer.metrics import generation_metrics

CONFIG = {
    "model_name_or_path": "tiny", "template": "chatml", "dataset": "demo_reverse", "max_samples": 128,
    "eval_dataset": "demo_reverse_test", "cutoff_len": 64, "per_device_train_batch_size": 16,
    "per_device_eval_batch_size": 8, "max_steps": 4, "learning_rate": 5e-3, "lora_rank": 16,
    "max_new_tokens": 10, "seed": 0, "disable_tqdm": True, "plot_loss": False,
}


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_do_predict_then_tunelab_eval_on_the_adapter_agree(tmp_path, capsys):
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump({**CONFIG, "output_dir": str(tmp_path / "run"), "do_predict": True}))
    assert main(["train", str(config), "max_samples=8"]) == 0  # max_samples also bounds the eval set: 8 rows
    run = tmp_path / "run"
    predicted = _lines(run / "predictions.jsonl")
    assert len(predicted) == 8 and set(predicted[0]) == {"dataset", "prompt", "reference", "prediction"}
    assert {p["dataset"] for p in predicted} == {"demo_reverse_test"}
    assert all(p["prompt"].startswith("<|im_start|>user\n") and p["prompt"].endswith("<|im_start|>assistant\n") for p in predicted)
    assert not any("<|im_end|>" in p["prediction"] for p in predicted)  # generation stopped at end of turn
    results = json.loads((run / "predict_results.json").read_text())
    expected = generation_metrics([p["prediction"] for p in predicted], [p["reference"] for p in predicted])
    assert results == {f"predict_{k}": v for k, v in expected.items()}
    assert json.loads((run / "all_results.json").read_text())["predict_bleu"] == results["predict_bleu"]

    # The saved run is evaluated with the template it trained with, even if the config names another.
    capsys.readouterr()
    assert main(["eval", str(config), "max_samples=8", f"adapter_name_or_path={run}", f"output_dir={tmp_path / 'ev'}",
                 "template=llama3"]) == 0
    assert f"predict_exact_match: {results['predict_exact_match']:.4f}" in capsys.readouterr().out
    assert _lines(tmp_path / "ev" / "predictions.jsonl") == predicted
    assert json.loads((tmp_path / "ev" / "predict_results.json").read_text()) == results
    assert (run / "chat_template.jinja").read_text() == get_template("chatml").jinja


def test_eval_config_errors_are_one_line(tmp_path, capsys):
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump({k: v for k, v in CONFIG.items() if k != "eval_dataset"}))
    assert main(["eval", str(config)]) == 2
    assert capsys.readouterr().err == (
        "tunelab: error: output_dir is not set: tunelab eval writes predictions.jsonl there; add output_dir=...\n"
    )
    assert main(["eval", str(config), f"output_dir={tmp_path}"]) == 2
    assert capsys.readouterr().err == (
        "tunelab: error: tunelab eval needs an eval set: set eval_dataset "
        "(or val_size to use the training split's val part)\n"
    )
    assert main(["train", str(config), f"output_dir={tmp_path / 'x'}", "do_predict=true"]) == 2
    assert "do_predict needs an eval set" in capsys.readouterr().err


def test_eval_needs_only_the_eval_set(tmp_path, capsys):
    # `tunelab eval model=... eval_dataset=...` on a model nobody trained here: no training dataset to name.
    out = tmp_path / "ev"
    assert main(["eval", "model_name_or_path=tiny", "template=chatml", "eval_dataset=demo_reverse_test",
                 "max_samples=3", "max_new_tokens=4", f"output_dir={out}"]) == 0
    assert [p["dataset"] for p in _lines(out / "predictions.jsonl")] == ["demo_reverse_test"] * 3
    for no_training_data in ([], ["eval_dataset=demo_reverse_test", "val_size=0.1"]):  # no rows to split a val set from
        assert main(["eval", "model_name_or_path=tiny", "template=chatml", f"output_dir={out}", *no_training_data]) == 2
        assert capsys.readouterr().err.endswith("dataset is not set: name one or more datasets from dataset_info.json\n")
