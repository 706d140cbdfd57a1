"""QAT runs end to end on the embedded tiny model: qat_start_step switches fake quantisation on where it says,
a resumed QAT run (LoRA or full) equals the uninterrupted one, and train → quantized export → tunelab eval works."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

pytest.importorskip("torchao", reason="torchao is not installed (pip install 'tunelab[qat]')")

from tests.train.reliability_helpers import assert_same_weights, losses, train, weights, write_config  # noqa: E402
from tunelab.cli import main  # noqa: E402

QAT = {"qat": "int8-int4", "qat_group_size": 32, "qat_start_step": 4}


@pytest.mark.slow
def test_qat_lora_run_switches_on_at_its_start_step_and_resumes_exactly(tmp_path, precision):
    plain, qat, resumed = tmp_path / "plain", tmp_path / "qat", tmp_path / "resumed"
    assert train(write_config(plain)) == 0
    assert train(write_config(qat, **QAT)) == 0
    expected = losses(qat / "out")
    assert sorted(expected) == [1, 2, 3, 4, 5, 6]
    reference = losses(plain / "out")
    assert all(expected[step] == reference[step] for step in (1, 2, 3, 4))  # full precision up to qat_start_step
    assert expected[5] != reference[5]  # then the base layers train fake-quantized
    recorded = yaml.safe_load((qat / "out" / "tunelab_config.yaml").read_text())
    assert (recorded["qat"], recorded["qat_group_size"], recorded["qat_start_step"]) == ("int8-int4", 32, 4)
    assert weights(qat / "out").keys() == weights(plain / "out").keys()  # a plain LoRA adapter

    shutil.copytree(qat / "out" / "checkpoint-3", resumed / "out" / "checkpoint-3")
    assert train(write_config(resumed, **QAT, resume_from_checkpoint=True)) == 0
    assert losses(resumed / "out") == {step: loss for step, loss in expected.items() if step > 3}  # exact floats
    assert_same_weights(weights(resumed / "out"), weights(qat / "out"))


@pytest.mark.slow
def test_full_qat_run_exports_quantized_and_evaluates(tmp_path, precision):
    config = write_config(tmp_path, finetuning_type="full", qat="int4-weight", max_steps=4,
                          dataset="demo_sort", eval_dataset="demo_sort_test", max_samples=16)
    assert train(config) == 0
    out, export = tmp_path / "out", tmp_path / "int4"
    # (export's read-back check of a torchao folder: tests/model/test_qat.py; here it would add 20 s of CPU kernels)
    assert main(["export", f"model_name_or_path={out}", f"export_dir={export}", "export_quantization=int4-weight",
                 "export_parity=false"]) == 0
    assert json.loads((export / "config.json").read_text())["quantization_config"]["quant_method"] == "torchao"
    assert yaml.safe_load((export / "tunelab_config.yaml").read_text())["qat_group_size"] == 32  # as it trained

    assert main(["eval", str(config), f"model_name_or_path={export}", f"output_dir={tmp_path / 'eval'}"]) == 0
    results = json.loads((tmp_path / "eval" / "predict_results.json").read_text())
    assert results["predict_samples"] == 16 and 0.0 <= results["predict_exact_match"] <= 1.0


@pytest.mark.slow
def test_full_qat_run_resumes_exactly(tmp_path):
    options = {"finetuning_type": "full", "qat": "int4-weight", "qat_group_size": 64}
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert train(write_config(whole, **options)) == 0
    expected = losses(whole / "out")
    assert sorted(expected) == [1, 2, 3, 4, 5, 6]
    shutil.copytree(whole / "out" / "checkpoint-3", resumed / "out" / "checkpoint-3")
    assert train(write_config(resumed, **options, resume_from_checkpoint=True)) == 0
    assert losses(resumed / "out") == {step: loss for step, loss in expected.items() if step > 3}  # exact floats
    assert_same_weights(weights(resumed / "out"), weights(whole / "out"))  # full-precision weights, plain keys
