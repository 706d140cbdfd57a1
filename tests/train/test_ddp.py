"""Data-parallel training on CPU (gloo) through the real `tunelab train ... nproc_per_node=2`.

Two processes × batch 4 must train exactly like one process × batch 8: accelerate's batch sampler
shards one seeded permutation by whole batches (rank r takes batches r, r + 2, ...), so optimizer
step k sees the same 8 samples either way; the loss divides by the supervised tokens of the whole
step (num_items_in_batch, summed over processes), so the split does not change it. SGD keeps the
weight comparison linear in the gradients (Adam's normalised update would amplify float noise in
near-zero gradients). The two-process run starts on a cold tokenized cache: rank 0 builds it once,
rank 1 waits and reads it.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import yaml
import torch
from safetensors.torch import load_file

from tunelab.cli import main
from tunelab.train import launch
from tunelab.run_folder import read_log

CONFIG = {
    "model_name_or_path": "tiny", "template": "chatml", "dataset": "demo_reverse", "max_samples": 64,
    "cutoff_len": 64, "finetuning_type": "full", "optim": "sgd", "learning_rate": 0.5, "lr_scheduler_type": "constant",
    "max_steps": 4, "logging_steps": 1, "seed": 0, "disable_tqdm": True, "plot_loss": False,
}


MALFORMED = Path(__file__).resolve().parents[1] / "bad_inputs" / "data" / "malformed_json"  # line 2 is not JSON


# How far apart the two runs may be, per precision: (loss and grad norm, weights). fp32: summation order only
# (measured 9.5e-7, weights 6e-8). bf16: autocast rounds each matmul's output to bf16, and 2 x 4 rows round other
# partial sums than 8 (measured: loss 2.6e-3, grad norm 7.4e-3, float32 master weights 2.6e-4; -s prints them).
TOLERANCE = {"fp32": (1e-5, 1e-5), "bf16": (2e-2, 1e-3)}


@pytest.mark.slow
def test_two_processes_train_like_one_with_the_same_global_batch(tmp_path, monkeypatch, capfd, precision):
    cache = tmp_path / "cache"
    monkeypatch.setenv("TUNELAB_CACHE", str(cache))  # cold: the two-process run builds it
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(CONFIG))

    two, one = tmp_path / "two", tmp_path / "one"
    # This process has run torch on two OpenMP threads, as a plain `pytest` does: the workers forked from it must
    # not wait for that thread team (they start on the launcher's one thread, launch.one_thread, and take
    # torchrun's OMP_NUM_THREADS=1; a worker left on two threads hung in its first op, seen in a serial run).
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    torch.ones(1 << 20).add_(1)  # large enough to run in parallel
    try:
        assert main(["train", str(cfg), f"output_dir={two}", "per_device_train_batch_size=4", "nproc_per_node=2"]) == 0
        assert torch.get_num_threads() == 2  # the launcher gave its count back
    finally:
        torch.set_num_threads(threads)
    out, err = capfd.readouterr()
    assert out.count(f"saved to {two}") == 1  # only rank 0 prints the summary
    assert "-m torch.distributed.run --nproc_per_node=2 --nnodes=1 --start-method=fork --run-path " in err
    # Tokenised once: one build logged, one cache entry, no second builder losing the rename race.
    assert err.count("tokenized cache miss: building") == 1
    assert "finished" not in err and "using its copy" not in err
    entries = [p.name for p in (cache / "tokenized").iterdir()]
    assert len(entries) == 1 and not entries[0].startswith(".")
    assert json.loads((two / "data_report.json").read_text())["cache"]["hit"] is False

    assert main(["train", str(cfg), f"output_dir={one}", "per_device_train_batch_size=8"]) == 0
    assert json.loads((one / "data_report.json").read_text())["cache"]["hit"] is True

    log_two = [r for r in read_log(two) if "loss" in r]
    log_one = [r for r in read_log(one) if "loss" in r]
    assert [r["step"] for r in log_two] == [r["step"] for r in log_one] == [1, 2, 3, 4]
    assert [r["epoch"] for r in log_two] == [0.125, 0.25, 0.375, 0.5]  # 8 of 64 samples per step, not 4
    tolerance, weight_tolerance = TOLERANCE[precision]
    print(f"\n{precision}: loss {max(abs(a['loss'] - b['loss']) for a, b in zip(log_two, log_one)):.2e}, grad norm "
          f"{max(abs(a['grad_norm'] - b['grad_norm']) for a, b in zip(log_two, log_one)):.2e} apart")
    for a, b in zip(log_two, log_one):
        assert a["loss"] == pytest.approx(b["loss"], abs=tolerance)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], abs=tolerance)
    assert log_one[-1]["loss"] < 0.6 * log_one[0]["loss"]  # it trained

    weights_two, weights_one = load_file(two / "model.safetensors"), load_file(one / "model.safetensors")
    assert weights_two.keys() == weights_one.keys()
    apart = max((weights_two[k] - weights_one[k]).abs().max().item() for k in weights_one)
    print(f"{precision}: weights {apart:.2e} apart")
    assert apart < weight_tolerance


@pytest.mark.slow
def test_a_failing_rank_ends_the_run_with_its_exit_code(tmp_path, monkeypatch, capfd):
    """Rank 0 fails while building the cache (a malformed line); rank 1, polling for that cache, is stopped by
    torchrun instead of waiting, and `tunelab train` returns rank 0's exit code 2 with its one-line error."""
    data = MALFORMED
    monkeypatch.setenv("TUNELAB_CACHE", str(tmp_path / "cache"))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({**CONFIG, "dataset": "mine", "dataset_dir": str(data)}))
    assert main(["train", str(cfg), f"output_dir={tmp_path / 'out'}", "nproc_per_node=2"]) == 2
    err = capfd.readouterr().err
    assert f"tunelab: error: {data}/data.jsonl:2: Expecting value; fix or remove that line\n" in err
    assert "tunelab: error: rank 0 exited with code 2 (its output is above)\n" in err


@pytest.mark.slow
def test_spawned_workers_train_as_forked_ones_do(tmp_path, monkeypatch, capfd):
    """A CUDA build of torch starts the workers as fresh interpreters (launch.start_method: spawn), every other run
    here forks them: the spawned pair trains too, on 2 processes' share of the batch. (How a failing rank ends the
    launch is the agent's, the same for either start method: the test above.)"""
    monkeypatch.setattr(launch, "start_method", lambda version: "spawn")
    monkeypatch.setenv("TUNELAB_CACHE", str(tmp_path / "cache"))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({**CONFIG, "max_steps": 1}))
    out = tmp_path / "out"
    assert main(["train", str(cfg), f"output_dir={out}", "per_device_train_batch_size=4", "nproc_per_node=2"]) == 0
    assert "--start-method=spawn --run-path" in capfd.readouterr().err
    assert [r["epoch"] for r in read_log(out) if "loss" in r] == [0.125]  # 8 of 64 samples: both ranks trained


def test_the_start_method_follows_torchs_build():
    assert launch.start_method(torch.version) == ("spawn" if torch.version.cuda or torch.version.hip else "fork")
    for build in ({"cuda": "12.8"}, {"hip": "6.4"}, {"xpu": "20250101"}):
        assert launch.start_method(types.SimpleNamespace(**{"cuda": None, "hip": None, **build})) == "spawn"
    assert launch.start_method(types.SimpleNamespace(cuda=None, hip=None)) == "fork"
