"""Two nodes on one machine: two `tunelab train ... nnodes=2 node_rank=0|1 master_addr=127.0.0.1` launchers.

Each "node" is its own launcher (torchrun's agent) with its own tokenized cache (as on two machines with local
disks); they share output_dir, as nodes share a file system for checkpoints. Each launcher is killed with its
workers if a test fails, so nothing is left running.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from safetensors.torch import load_file

from tests.train.reliability_helpers import cli_env
from tests.train.test_ddp import CONFIG, TOLERANCE
from tunelab.run_folder import read_log
from tunelab.run_folder import is_complete, latest_checkpoint


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_node(cfg: Path, rank: int, port: int, cache: Path, *overrides: str, nproc: int = 1) -> subprocess.Popen:
    command = [sys.executable, "-m", "tunelab.cli", "train", str(cfg), *overrides, f"nproc_per_node={nproc}",
               "nnodes=2", f"node_rank={rank}", "master_addr=127.0.0.1", f"master_port={port}"]
    return subprocess.Popen(command, env=cli_env(TUNELAB_CACHE=str(cache), OMP_NUM_THREADS="1"), cwd=cfg.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def kill_node(node: subprocess.Popen) -> None:
    """SIGKILL a launcher and its workers (torchrun starts each worker in its own session), like a machine
    that loses power."""
    try:
        tree = [*psutil.Process(node.pid).children(recursive=True), psutil.Process(node.pid)]
    except psutil.NoSuchProcess:
        return
    for process in tree:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def finish(*nodes: subprocess.Popen, timeout: float = 900) -> list[tuple[int, str]]:
    """Each launcher's exit code and stderr. The timeout only stops a hung test on a loaded machine."""
    try:
        errors = [node.communicate(timeout=timeout)[1] for node in nodes]
        return [(node.returncode, err) for node, err in zip(nodes, errors)]
    finally:
        for node in nodes:
            kill_node(node)


def wait_for_steps(out: Path, steps: int, *nodes: subprocess.Popen) -> None:
    log = out / "trainer_log.jsonl"
    while not (log.is_file() and sum('"loss"' in line for line in log.read_text().splitlines()) >= steps):
        for node in nodes:
            assert node.poll() is None, node.communicate()[1][-3000:]
        time.sleep(0.1)


@pytest.fixture
def cfg(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    return path


@pytest.mark.slow
# What 2 nodes add (the rendezvous, a cache per node) is precision-blind; bf16 across processes is
# test_ddp's, test_fsdp's and test_deepspeed's. One 4-process launch less (about 70 s of the suite).
@pytest.mark.parametrize("precision", ["fp32"], indirect=True)
def test_two_nodes_train_like_one_process_and_tokenise_once_per_node(tmp_path, cfg, one_process_reference, precision):
    """2 nodes × 2 processes × batch 2 = 1 process × batch 8: the DDP tolerances of tests/train/test_ddp.py.
    Each node's local rank 0 builds its node's cache once; the other local rank waits for it and reads it (were
    node 1's builder not its local rank 0, both its ranks would wait for a cache nobody builds)."""
    port, two, one = free_port(), tmp_path / "two", one_process_reference(precision)
    nodes = [start_node(cfg, rank, port, tmp_path / f"cache{rank}", f"output_dir={two}",
                        "per_device_train_batch_size=2", nproc=2) for rank in (0, 1)]
    (code0, err0), (code1, err1) = finish(*nodes)
    assert (code0, code1) == (0, 0), err0[-3000:] + err1[-3000:]
    for rank, err in enumerate((err0, err1)):
        assert f"--nproc_per_node=2 --nnodes=2 --node_rank={rank} --master_addr=127.0.0.1 --master_port={port}" in err
        # A second builder on the node would lose the rename race and warn (warnings show on every rank).
        assert "using its copy" not in err, err[-3000:]
    entries = [sorted(p.name for p in (tmp_path / f"cache{rank}" / "tokenized").iterdir()) for rank in (0, 1)]
    assert entries[0] == entries[1] and len(entries[0]) == 1 and not entries[0][0].startswith(".")  # same key
    assert err0.count("tokenized cache miss: building") == 1  # info lines: global rank 0 only

    log_two = [r for r in read_log(two) if "loss" in r]
    log_one = [r for r in read_log(one) if "loss" in r]
    assert [r["step"] for r in log_two] == [r["step"] for r in log_one] == [1, 2, 3, 4]
    assert [r["epoch"] for r in log_two] == [0.125, 0.25, 0.375, 0.5]  # 8 of 64 samples per step
    tolerance, weight_tolerance = TOLERANCE[precision]
    for a, b in zip(log_two, log_one):
        assert a["loss"] == pytest.approx(b["loss"], abs=tolerance)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], abs=tolerance)
    weights_two, weights_one = load_file(two / "model.safetensors"), load_file(one / "model.safetensors")
    assert weights_two.keys() == weights_one.keys()
    apart = max((weights_two[k] - weights_one[k]).abs().max().item() for k in weights_one)
    print(f"\n{precision}: loss {max(abs(a['loss'] - b['loss']) for a, b in zip(log_two, log_one)):.2e}, weights "
          f"{apart:.2e} apart")
    assert apart < weight_tolerance


@pytest.mark.slow
def test_sigterm_checkpoints_the_whole_job_it_resumes_and_a_node_that_dies_ends_the_other(tmp_path, cfg):
    """SIGTERM to node 1's launcher: its agent passes it to its worker, the flag is reduced across ranks at the
    step boundary, every rank saves the same checkpoint and stops; both launchers exit 143. Both nodes rerun
    with resume_from_checkpoint=true continue from that step. Then node 1 (launcher and worker) is killed
    mid-run: node 0's worker, in a gloo collective with it, fails at once (the peer's sockets close); its
    launcher exits with one line naming the lost peer. (One resumed launch shows both: each launch costs every
    process a Python, torch and transformers start.)"""
    port, out = free_port(), tmp_path / "out"
    options = (f"output_dir={out}", "per_device_train_batch_size=4", "learning_rate=0.01", "save_strategy=no",
               "max_steps=400")
    nodes = [start_node(cfg, rank, port, tmp_path / f"cache{rank}", *options) for rank in (0, 1)]
    try:
        wait_for_steps(out, 2, *nodes)
        nodes[1].send_signal(signal.SIGTERM)
    finally:
        (code0, err0), (code1, err1) = finish(*nodes)
    assert (code0, code1) == (143, 143), err0[-3000:] + err1[-3000:]
    checkpoint = latest_checkpoint(out)
    step = int(checkpoint.name.split("-")[1])
    assert is_complete(checkpoint) and 2 <= step < 400
    assert sorted(p.name for p in checkpoint.glob("rng_state_*.pth")) == ["rng_state_0.pth", "rng_state_1.pth"]
    assert f"tunelab: SIGTERM received: training stopped at step {step}, checkpoint saved to {checkpoint}; " in err0
    assert "tunelab: rank 0 stopped on SIGTERM (exit code 143); the command to resume is above\n" in err0
    assert "tunelab: error" not in err0 + err1

    port = free_port()
    resumed = [start_node(cfg, rank, port, tmp_path / f"cache{rank}", *options, "resume_from_checkpoint=true")
               for rank in (0, 1)]
    try:
        wait_for_steps(out, step + 2, *resumed)  # the log holds the first launch's steps
        kill_node(resumed[1])
        _, err0 = resumed[0].communicate(timeout=120)  # the stated bound (docs/distributed.md)
    finally:
        finish(*resumed)
    steps = [r["step"] for r in read_log(out) if "loss" in r]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= step + 2  # one log, no step twice
    assert resumed[0].returncode == 2, err0[-3000:]
    assert "tunelab: error: lost contact with another rank during training" in err0, err0[-3000:]
    assert not (out / "model.safetensors").exists()


@pytest.mark.slow
def test_nodes_started_with_different_nproc_per_node_stop_with_one_line(tmp_path, cfg):
    """Node 0 brings 1 process, node 1 brings 2: torchrun's rendezvous adds them up (3), every worker sees that its
    node's share times nnodes is not the world and stops with one line before loading anything; both launchers
    exit 2 within the stated bound (docs/distributed.md), with no hang at a rendezvous or a collective."""
    port = free_port()
    nodes = [start_node(cfg, rank, port, tmp_path / f"cache{rank}", f"output_dir={tmp_path / 'out'}", nproc=nproc)
             for rank, nproc in ((0, 1), (1, 2))]
    results = finish(*nodes, timeout=120)  # the stated bound
    for (code, err), started in zip(results, (1, 2)):
        assert code == 2, err[-3000:]
        assert (f"tunelab: error: nproc_per_node differs between nodes: this node started {started} processes but "
                "the 2 nodes brought 3 in all; start every node with the same nproc_per_node\n") in err, err[-3000:]
        assert "exited with code 2 (its output is above)\n" in err
    assert not (tmp_path / "out").exists()
