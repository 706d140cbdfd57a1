"""The non-finite guard on real runs: a learning rate that blows the weights up stops the run with one
line naming the step; with nan_policy: skip a batch whose loss is NaN is skipped (weights untouched,
counted in the log) and training goes on, until nan_max_consecutive bad steps in a row stop it.

The NaN batch is real: a copy of the tiny Llama fixture whose embedding row for the word `w250` is
inf, so any window containing that word overflows (RMSNorm: inf * 0 = NaN), and only those do.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.train.reliability_helpers import train, weights, write_config
from tunelab.run_folder import read_log
from tunelab.run_folder import latest_checkpoint

BAD_WORD = "w250"


@pytest.fixture(scope="module")
def overflowing_model(tiny_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama-inf-row")
    shutil.copytree(tiny_llama_dir, folder, dirs_exist_ok=True)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.embed_tokens.weight"][int(BAD_WORD[1:]) + 3] = math.inf  # ids: <unk> <s> </s> w0 w1 ...
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def pt_config(folder, model, bad_documents: set[int], **options):
    """8 documents of 7 words; with eos and cutoff_len 8 each training window is exactly one document."""
    data = folder / "data"
    data.mkdir(parents=True)
    lines = [" ".join(f"w{10 * d + i}" if not (d in bad_documents and i == 3) else BAD_WORD for i in range(7))
             for d in range(8)]
    (data / "docs.txt").write_text("\n".join(lines) + "\n")
    (data / "dataset_info.json").write_text(json.dumps({"docs": {"file_name": "docs.txt", "formatting": "text"}}))
    settings = {
        "stage": "pt", "model_name_or_path": str(model), "template": None, "dataset": "docs", "dataset_dir": str(data),
        "max_samples": None, "cutoff_len": 8, "per_device_train_batch_size": 2, "max_steps": 4, "save_strategy": "no",
    }
    return write_config(folder, **{**settings, **options})


@pytest.mark.slow
def test_a_learning_rate_that_overflows_stops_the_run_naming_the_step(tmp_path, capsys):
    config = write_config(tmp_path, finetuning_type="full", learning_rate=1e10, max_steps=6, save_strategy="no")
    assert train(config) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("tunelab: error: training stopped at step 2: the loss is nan; the step was not applied")
    assert "Likely causes: learning_rate 1e+10 too high" in err[-1]
    assert not (tmp_path / "out" / "model.safetensors").exists()  # nothing saved from a diverged run


@pytest.mark.slow
def test_skip_policy_skips_the_nan_batch_and_trains_on(tmp_path, overflowing_model):
    config = pt_config(tmp_path, overflowing_model, bad_documents={5}, nan_policy="skip")
    assert train(config) == 0
    log = [r for r in read_log(tmp_path / "out") if "loss" in r]
    assert [r["skipped_nonfinite_steps"] for r in log] == [0, 0, 1, 1]  # the window with the bad word: step 3
    assert all(math.isfinite(r["loss"]) for r in log)
    trained = weights(tmp_path / "out")
    assert all(torch.isfinite(t).all() for t in trained.values())
    assert any(t.abs().sum() > 0 for k, t in trained.items() if "lora_B" in k)  # the good steps trained


@pytest.mark.slow
def test_skip_policy_still_stops_after_consecutive_bad_steps(tmp_path, overflowing_model, capsys):
    config = pt_config(
        tmp_path, overflowing_model, bad_documents=set(range(8)), nan_policy="skip", nan_max_consecutive=2,
        save_strategy="steps", save_steps=1,
    )
    assert train(config) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "tunelab: error: training stopped at step 2: the loss is nan (2 non-finite steps in a row, "
        "nan_max_consecutive: 2); the step was not applied, so the weights are those of step 1."
    )
    skipped = weights(latest_checkpoint(tmp_path / "out"))  # saved after the skipped steps
    assert all(torch.equal(t, torch.zeros_like(t)) for k, t in skipped.items() if "lora_B" in k)  # untouched
