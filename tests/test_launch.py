"""`nproc_per_node` → the torchrun command line; a process started by a launcher never launches again.

The launch itself (torchrun workers, gloo DDP) runs end to end in tests/train/test_ddp.py, two nodes in
tests/train/test_multinode.py, DeepSpeed in tests/train/test_deepspeed.py.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import types
from pathlib import Path

import pytest
import yaml

import tunelab
from tunelab.preflight import load_config
from tunelab.errors import ConfigError
from tunelab.train import launch


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", launch.NPROC_ENV):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def training(tmp_path, **options):
    config = {"model_name_or_path": "tiny", "template": "chatml", "dataset": "demo_reverse",
              "output_dir": str(tmp_path / "out"), **options}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    return load_config(path).training


def test_one_node_gets_a_free_port(tmp_path, clean_env):
    args = training(tmp_path, nproc_per_node=2)
    assert launch.needs_launch(args)
    assert launch.torchrun_argv(args, ["train", "cfg.yaml", "nproc_per_node=2"]) == [
        "--nproc_per_node=2", "--nnodes=1", "--start-method=fork", "--run-path", launch.WORKER_SCRIPT, "train",
        "cfg.yaml", "nproc_per_node=2",
    ]
    # The script each worker runs is `python -m tunelab`'s.
    assert Path(launch.WORKER_SCRIPT).parent == Path(tunelab.__file__).parent and Path(launch.WORKER_SCRIPT).is_file()


def test_several_nodes_pass_rank_address_and_port(tmp_path, clean_env):
    args = training(tmp_path, nproc_per_node=8, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29501)
    assert launch.torchrun_argv(args, ["train", "cfg.yaml"]) == [
        "--nproc_per_node=8", "--nnodes=2", "--node_rank=1", "--master_addr=10.0.0.1", "--master_port=29501",
        "--start-method=fork", "--run-path", launch.WORKER_SCRIPT, "train", "cfg.yaml",
    ]
    assert launch.torchrun_argv(args, ["train"], "spawn")[-4:] == ["--start-method=spawn", "--run-path", launch.WORKER_SCRIPT, "train"]


def test_environment_variable_and_its_errors(tmp_path, clean_env):
    args = training(tmp_path)
    assert not launch.needs_launch(args)
    clean_env.setenv(launch.NPROC_ENV, "2")
    assert launch.needs_launch(args) and launch.nproc_per_node(args) == 2
    assert launch.nproc_per_node(training(tmp_path, nproc_per_node=1)) == 1  # the config key wins
    clean_env.setenv(launch.NPROC_ENV, "two")
    with pytest.raises(ConfigError) as error:
        launch.needs_launch(args)
    assert str(error.value) == "TUNELAB_NPROC_PER_NODE: expected a whole number of processes, got 'two'"


def test_multi_node_needs_master_addr(tmp_path, clean_env):
    with pytest.raises(ConfigError) as error:
        launch.needs_launch(training(tmp_path, nproc_per_node=2, nnodes=2, node_rank=0))
    assert str(error.value) == "nnodes > 1 needs master_addr: the address of the node_rank 0 machine"


def test_under_a_launcher_nothing_is_launched_and_counts_must_agree(tmp_path, clean_env):
    args, mismatched = training(tmp_path, nproc_per_node=2), training(tmp_path, nproc_per_node=4)
    # What torchrun and accelerate launch put in each worker's environment:
    for name, value in {"LOCAL_RANK": "1", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        clean_env.setenv(name, value)
    assert launch.under_launcher() and not launch.needs_launch(args)
    with pytest.raises(ConfigError) as error:
        launch.needs_launch(mismatched)
    assert str(error.value) == (
        "nproc_per_node: 4, but the launcher started 2 processes per node; remove nproc_per_node when you launch "
        "with torchrun / accelerate launch yourself"
    )


def test_the_launching_process_decides_before_building_the_config(tmp_path, clean_env):
    """The parent reads nproc_per_node from the raw YAML and overrides, and builds its config without
    selecting a device (on a GPU machine it would otherwise hold a CUDA context on GPU 0 all run)."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"model_name_or_path": "tiny", "nproc_per_node": 2}))
    assert launch.wants_launch(str(cfg), []) and not launch.wants_launch(str(cfg), ["nproc_per_node=1"])
    assert launch.wants_launch(str(cfg), ["nproc_per_node=1", "nnodes=2"])
    assert not launch.wants_launch(str(cfg), ["nproc_per_node=two"])  # load_config reports it
    clean_env.setenv("ACCELERATE_USE_CPU", "false")
    with launch.devices_untouched():
        args = training(tmp_path, nproc_per_node=2)
    assert args.device.type == "cpu" and launch.needs_launch(args)
    assert os.environ["ACCELERATE_USE_CPU"] == "false"  # restored before any worker starts



def test_deepspeed_always_runs_under_torchrun(tmp_path, clean_env):
    """Outside a launcher DeepSpeed looks for MPI to learn its rank (No module named 'mpi4py'): one DeepSpeed
    process is launched through torchrun too."""
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 2}}')
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"model_name_or_path": "tiny", "deepspeed": str(ds)}))
    assert launch.wants_launch(str(cfg), [])
    if importlib.util.find_spec("deepspeed") is not None:  # else the config check refuses it first
        args = training(tmp_path, deepspeed=str(ds))
        assert launch.needs_launch(args)
        assert launch.torchrun_argv(args, ["train", "cfg.yaml"])[:2] == ["--nproc_per_node=1", "--nnodes=1"]


def test_nodes_with_different_nproc_per_node_are_refused_at_rendezvous(tmp_path, clean_env):
    """torchrun's rendezvous adds up what each node brings (1 + 2 = 3): every worker sees WORLD_SIZE 3 beside its
    node's LOCAL_WORLD_SIZE and the GROUP_WORLD_SIZE of nodes (the end-to-end run: tests/train/test_multinode.py)."""
    args = training(tmp_path, nproc_per_node=2, nnodes=2, node_rank=1, master_addr="127.0.0.1")
    for name, value in {"LOCAL_RANK": "0", "RANK": "1", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "2",
                        "GROUP_WORLD_SIZE": "2"}.items():
        clean_env.setenv(name, value)
    with pytest.raises(ConfigError) as error:
        launch.needs_launch(args)
    assert str(error.value) == (
        "nproc_per_node differs between nodes: this node started 2 processes but the 2 nodes brought 3 in all; "
        "start every node with the same nproc_per_node"
    )
    clean_env.setenv("WORLD_SIZE", "4")
    assert not launch.needs_launch(args)


def test_a_master_port_in_use_is_one_line(tmp_path, clean_env):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = training(tmp_path, nproc_per_node=2, master_port=port)
        with pytest.raises(ConfigError) as error:
            launch.check_port_free(args)
        assert str(error.value) == (
            f"master_port: {port} is already in use on this machine (another run or program listens there); "
            "choose a free master_port"
        )
        # Node 1 connects to node 0's port instead of binding it: nothing to check there.
        launch.check_port_free(training(tmp_path, nproc_per_node=2, nnodes=2, node_rank=1, master_addr="127.0.0.1",
                                        master_port=port))
    launch.check_port_free(args)  # free again


def test_a_lost_peer_is_one_line():
    """What gloo raised in rank 0 when node 1 was killed (tests/train/test_multinode.py runs it for real)."""
    gloo = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:6023: "
        "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application."
    )
    args = types.SimpleNamespace(world_size=2, process_index=0)  # the two fields it reads
    assert launch.lost_peer_message(gloo, args) == (
        "lost contact with another rank during training (rank 0 of 2: Read error [127.0.0.1]:6023: Connection "
        "reset by peer); another process or node stopped (see its output); rerun every node with "
        "resume_from_checkpoint=true to continue from the last checkpoint"
    )
    assert launch.lost_peer_message(RuntimeError("shape mismatch"), args) is None  # a bug keeps its traceback
    assert launch.lost_peer_message(gloo, types.SimpleNamespace(world_size=1, process_index=0)) is None


def test_a_launch_is_planned_and_started_on_one_torch_thread(tmp_path, clean_env, monkeypatch):
    """The workers are forked from the launching process: it must never have run a parallel op (GNU OpenMP's thread
    team survives a fork without its threads), so it plans and launches on one thread, passes its own count on,
    and has it back afterwards."""
    import torch  # noqa: PLC0415  (this file's other tests need no torch)

    from tunelab.cli import main  # noqa: PLC0415

    seen = []
    monkeypatch.setattr(launch, "launch", lambda args, cli_args: seen.append(
        (torch.get_num_threads(), os.environ.get(launch.LAUNCHER_THREADS_ENV))) or 0)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"model_name_or_path": "tiny", "template": "chatml", "dataset": "demo_reverse",
                                   "output_dir": str(tmp_path / "out"), "nproc_per_node": 2}))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert main(["train", str(cfg)]) == 0
        assert seen == [(1, "2")] and torch.get_num_threads() == 2
        assert launch.LAUNCHER_THREADS_ENV not in os.environ
    finally:
        torch.set_num_threads(threads)


def test_a_worker_sets_its_streams_logging_and_threads_up_as_a_fresh_process(monkeypatch):
    """prepare_worker, as `python -m tunelab` runs it in each worker: stdout / stderr on file descriptors 1 and 2
    (not a host program's stream objects), no inherited logging handlers, and OMP_NUM_THREADS torch threads, else
    the launcher's count (a forked worker starts with the launcher's one thread)."""
    import logging  # noqa: PLC0415
    import sys  # noqa: PLC0415

    import torch  # noqa: PLC0415  (this file's other tests need no torch)

    for name in ("stdout", "stderr"):
        monkeypatch.setattr(sys, name, getattr(sys, name))  # put back after
    monkeypatch.setattr(logging.root, "handlers", [logging.NullHandler()])
    threads = torch.get_num_threads()
    try:
        for env, expected in (({"OMP_NUM_THREADS": "3", launch.LAUNCHER_THREADS_ENV: "2"}, 3),
                              ({launch.LAUNCHER_THREADS_ENV: "2"}, 2)):
            monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
            for key, value in env.items():
                monkeypatch.setenv(key, value)
            torch.set_num_threads(1)
            launch.prepare_worker()
            assert torch.get_num_threads() == expected
            assert (sys.stdout.fileno(), sys.stderr.fileno()) == (1, 2) and sys.stdout.line_buffering
            assert logging.root.handlers == []
            sys.stdout.close(), sys.stderr.close()  # closefd=False: descriptors 1 and 2 stay open
    finally:
        torch.set_num_threads(threads)
