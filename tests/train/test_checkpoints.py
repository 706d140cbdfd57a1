"""Checkpoint writes are atomic: a process killed (SIGKILL) in the middle of a save leaves the previous
checkpoint complete and loadable, and `resume_from_checkpoint: true` picks it; rotation
(save_total_limit) never deletes the newest complete checkpoint."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.train.reliability_helpers import cli_command, cli_env, losses, train, weights, write_config
from tunelab.errors import ConfigError
from tunelab.run_folder import complete_checkpoints, is_complete, latest_checkpoint, write_manifest
from tunelab.train.checkpoints import SLOW_SAVE_ENV, CheckpointCallback, remove_unfinished_saves, rotate
from tunelab.train.resume import checkpoint_problem, resolve_resume


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
    # The test hook sleeps 1.5 s in every save, after the Trainer wrote checkpoint-N, before its manifest.
    process = subprocess.Popen(
        cli_command(config), env=cli_env(**{SLOW_SAVE_ENV: "1.5"}),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        _wait_for(lambda: (out / "checkpoint-4" / "adapter_model.safetensors").is_file(), process)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        process.kill()
    assert process.returncode == -signal.SIGKILL

    partial = out / "checkpoint-4"
    assert (partial / "adapter_model.safetensors").is_file() and not is_complete(partial)
    previous = out / "checkpoint-2"
    assert is_complete(previous) and latest_checkpoint(out) == previous
    assert json.loads((previous / "trainer_state.json").read_text())["global_step"] == 2
    assert {"lora_A", "lora_B"} <= {k.split(".")[-2] for k in weights(previous)}
    torch.load(previous / "optimizer.pt", weights_only=True)
    torch.load(previous / "rng_state.pth", weights_only=False)

    (partial / "leftover").write_bytes(b"")
    assert train(config, "resume_from_checkpoint=true") == 0
    assert sorted(losses(out)) == [1, 2, 3, 4]  # the log kept steps 1-2 and continued from checkpoint-2
    assert not (partial / "leftover").exists()  # the leftover is removed when the next run starts
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


def test_a_run_starts_by_removing_saves_that_did_not_finish_above_its_step(tmp_path):
    for step in (2, 6):
        _fake_checkpoint(tmp_path, step)
    legacy = _fake_checkpoint(tmp_path, 4, complete=False)  # at the start step: may be transformers' own checkpoint
    cut_short = [_fake_checkpoint(tmp_path, 5, complete=False), _fake_checkpoint(tmp_path, 8, complete=False)]
    staged = tmp_path / "tmp-checkpoint-7"  # where an older tunelab staged its saves
    staged.mkdir()

    assert sorted(remove_unfinished_saves(tmp_path, after_step=4)) == sorted([*cut_short, staged])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert legacy.is_dir()


def test_save_total_limit_1_with_load_best_keeps_only_the_best_at_the_end(tmp_path):
    """transformers' end-of-training rule, applied by tunelab while it holds the limit aside."""
    for step in (2, 4, 6):
        _fake_checkpoint(tmp_path, step)
    half = _fake_checkpoint(tmp_path, 8, complete=False)
    callback = CheckpointCallback(trainer=None)
    args = SimpleNamespace(output_dir=str(tmp_path), should_save=True)
    state = SimpleNamespace(best_model_checkpoint=str(tmp_path / "checkpoint-4"))

    callback.limit = 2
    callback.on_train_end(args, state, None)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    callback.limit = 1
    callback.on_train_end(args, state, None)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["checkpoint-4"]
    assert half.is_dir()  # not a checkpoint: neither counted nor deleted


# ---- the manifest: a checkpoint is resumed only when its files are the ones it recorded ---------------------


def _checkpoint_with_files(folder: Path, step: int, optimizer: bool = True) -> Path:
    """A checkpoint of arbitrary bytes with a real manifest (what verification reads is files, not tensors)."""
    path = folder / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(bytes(range(256)) * 40)
    if optimizer:
        (path / "optimizer.pt").write_bytes(b"\x01" * 5000)
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    write_manifest(path, step, optimizer_state=optimizer)
    return path


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))


# (case, damage done to the newest checkpoint, what verification says about it)
DAMAGE = [
    ("truncated weights", lambda c: (c / "model.safetensors").write_bytes(b"x" * 10),
     "model.safetensors is 10 bytes, the manifest says 10,240"),
    ("truncated optimizer", lambda c: (c / "optimizer.pt").write_bytes(b"x" * 10),
     "optimizer.pt is 10 bytes, the manifest says 5,000"),
    ("a flipped byte", lambda c: _flip_a_byte(c / "model.safetensors"),
     "model.safetensors does not match its checksum (damaged after it was written)"),
    ("optimizer removed", lambda c: (c / "optimizer.pt").unlink(), "optimizer.pt is missing"),
    ("weights removed", lambda c: (c / "model.safetensors").unlink(), "model.safetensors is missing"),
    ("manifest truncated", lambda c: (c / "tunelab_manifest.json").write_text('{"files": {"mo'),
     "its tunelab_manifest.json is unreadable"),
    ("no manifest", lambda c: (c / "tunelab_manifest.json").unlink(),
     "it has no tunelab_manifest.json (not written completely by this version of tunelab)"),
]


@pytest.mark.parametrize("damage, problem", [case[1:] for case in DAMAGE], ids=[case[0] for case in DAMAGE])
def test_resume_true_skips_a_damaged_checkpoint_and_says_why(tmp_path, caplog, damage, problem):
    older = _checkpoint_with_files(tmp_path, 3)
    damage(_checkpoint_with_files(tmp_path, 6))
    assert resolve_resume(True, tmp_path) == str(older)
    assert caplog.messages == [f"resume_from_checkpoint: true skips checkpoint-6: {problem}"]


EXPLICIT = [case for case in DAMAGE if case[0] != "no manifest"]  # a folder without one: see below
OPTIMIZER_FIX = {
    "truncated optimizer": "; or delete optimizer.pt and set resume_weights_only: true to resume the weights with a "
                           "fresh optimizer",
    "optimizer removed": "; or set resume_weights_only: true to resume the weights with a fresh optimizer",
}


@pytest.mark.parametrize("case, damage, problem", EXPLICIT, ids=[case[0] for case in EXPLICIT])
def test_an_explicit_damaged_checkpoint_is_one_line(tmp_path, case, damage, problem):
    checkpoint = _checkpoint_with_files(tmp_path, 6)
    damage(checkpoint)
    with pytest.raises(ConfigError) as error:
        resolve_resume(str(checkpoint), tmp_path)
    assert str(error.value) == (
        f"resume_from_checkpoint: {checkpoint} is damaged: {problem}; give an older checkpoint-N folder, or true for "
        f"the newest one that verifies{OPTIMIZER_FIX.get(case, '')}"
    )


def test_without_optimizer_state_resume_needs_resume_weights_only(tmp_path, caplog):
    checkpoint = _checkpoint_with_files(tmp_path, 6, optimizer=False)  # as save_only_model writes it
    with pytest.raises(ConfigError) as error:
        resolve_resume(True, tmp_path)
    assert str(error.value) == (
        f"resume_from_checkpoint: {checkpoint} has no optimizer state (saved with save_only_model, or its optimizer "
        "file was removed): the optimizer would restart from zero and the run would not continue as it was; "
        "resume_weights_only: true resumes the weights with a fresh optimizer, or give a checkpoint that has it"
    )
    assert resolve_resume(True, tmp_path, weights_only=True) == str(checkpoint)
    assert caplog.messages[-1].startswith(f"resume_weights_only: {checkpoint} has no optimizer state")

    removed = _checkpoint_with_files(tmp_path, 9)
    (removed / "optimizer.pt").unlink()
    assert resolve_resume(str(removed), tmp_path, weights_only=True) == str(removed)  # missing is allowed then


def test_a_checkpoint_from_before_manifests_loads_only_when_named(tmp_path, caplog):
    legacy = _fake_checkpoint(tmp_path, 4)
    (legacy / "tunelab_manifest.json").unlink()
    (legacy / "optimizer.pt").write_bytes(b"state")
    with pytest.raises(ConfigError, match=r"holds no complete checkpoint \(checkpoint-4: it has no tunelab_manifest"):
        resolve_resume(True, tmp_path)
    assert resolve_resume(str(legacy), tmp_path) == str(legacy)
    assert caplog.messages == [
        f"resume_from_checkpoint: {legacy} has no tunelab_manifest.json (written by transformers or an older "
        "tunelab): its files cannot be checked before they load"
    ]


def test_manifest_records_every_file_with_size_and_sha256(tmp_path):
    checkpoint = _checkpoint_with_files(tmp_path, 2)
    (checkpoint / "sub").mkdir()
    (checkpoint / "sub" / "x.bin").write_bytes(b"")
    manifest = write_manifest(checkpoint, 2, optimizer_state=True)
    assert sorted(manifest["files"]) == ["model.safetensors", "optimizer.pt", "sub/x.bin", "trainer_state.json"]
    assert manifest["files"]["sub/x.bin"] == {
        "size": 0, "sha256": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",  # sha256 of b""
    }
    assert json.loads((checkpoint / "tunelab_manifest.json").read_text()) == manifest
    assert checkpoint_problem(checkpoint) is None
