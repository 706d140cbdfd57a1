"""Checkpoint writes are atomic: a process killed (SIGKILL) in the middle of a save leaves the previous
checkpoint complete and loadable, and `resume_from_checkpoint: true` picks it; rotation
(save_total_limit) never deletes the newest complete checkpoint."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.train.reliability_helpers import cli_command, cli_env, losses, train, weights, write_config
from tunelab.train.checkpoints import (
    SLOW_SAVE_ENV, complete_checkpoints, is_complete, latest_checkpoint, publish, rotate, write_manifest,
)


def _wait_for(predicate, process: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if process.poll() is not None:
            raise AssertionError(f"training exited early ({process.returncode}): {process.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError("timed out")
        time.sleep(0.02)


@pytest.mark.slow
def test_kill_during_save_keeps_the_previous_checkpoint(tmp_path):
    config = write_config(tmp_path, save_steps=2, max_steps=4, save_total_limit=1)
    out = tmp_path / "out"
    # The test hook sleeps 1.5 s in every save, after the weights are written into tmp-checkpoint-N.
    process = subprocess.Popen(
        cli_command(config), env=cli_env(**{SLOW_SAVE_ENV: "1.5"}),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        _wait_for(lambda: (out / "tmp-checkpoint-4" / "adapter_model.safetensors").is_file(), process)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        process.kill()
    assert process.returncode == -signal.SIGKILL

    partial = out / "tmp-checkpoint-4"
    assert (partial / "adapter_model.safetensors").is_file() and not is_complete(partial)
    assert not (out / "checkpoint-4").exists()
    previous = out / "checkpoint-2"
    assert is_complete(previous) and latest_checkpoint(out) == previous
    assert json.loads((previous / "trainer_state.json").read_text())["global_step"] == 2
    assert {"lora_A", "lora_B"} <= {k.split(".")[-2] for k in weights(previous)}
    torch.load(previous / "optimizer.pt", weights_only=True)
    torch.load(previous / "rng_state.pth", weights_only=False)

    assert train(config, "resume_from_checkpoint=true") == 0
    assert sorted(losses(out)) == [1, 2, 3, 4]  # the log kept steps 1-2 and continued from checkpoint-2
    assert not partial.exists()  # the leftover is removed when the next run starts
    assert [p.name for p in complete_checkpoints(out)] == ["checkpoint-4"]  # save_total_limit: 1


def _fake_checkpoint(folder: Path, step: int, complete: bool = True) -> Path:
    path = folder / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"weights")
    if complete:
        (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        write_manifest(path, step, optimizer_state=False)
    return path


def test_rotation_never_deletes_the_newest_complete_checkpoint(tmp_path):
    for step in (2, 4, 6):
        _fake_checkpoint(tmp_path, step)
    stale = _fake_checkpoint(tmp_path, 9, complete=False)  # a half-written folder with a higher step
    (tmp_path / "checkpoint-8").mkdir()
    (tmp_path / "checkpoint-8" / "tunelab_manifest.json").write_text('{"form')  # truncated write

    assert latest_checkpoint(tmp_path).name == "checkpoint-6"
    rotate(tmp_path, limit=1, keep=[tmp_path / "checkpoint-6"])
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["checkpoint-6"]
    assert stale.is_dir()  # not ours to judge: neither counted nor deleted

    _fake_checkpoint(tmp_path, 3)  # resumed from an older step: the one just written is kept, whatever its step
    rotate(tmp_path, limit=1, keep=[tmp_path / "checkpoint-3"])
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["checkpoint-3"]


def test_publish_replaces_a_folder_of_the_same_name(tmp_path):
    _fake_checkpoint(tmp_path, 5, complete=False)
    staging = tmp_path / "tmp-checkpoint-5"
    staging.mkdir()
    (staging / "trainer_state.json").write_text(json.dumps({"global_step": 5}))
    write_manifest(staging, 5, optimizer_state=False)
    publish(staging, tmp_path / "checkpoint-5")
    assert not staging.exists() and is_complete(tmp_path / "checkpoint-5")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-5"]
