"""Multi-process launching: `tunelab train cfg.yaml nproc_per_node=2` runs itself under torchrun.

The parent process loads and checks the config (a bad config fails once, in under a second), then
runs torchrun's own launcher in-process with the same command:

    python -m torch.distributed.run --nproc_per_node N [--nnodes ...] --start-method=fork \
        --run-path .../tunelab/__main__.py train cfg.yaml k=v ...

and returns the exit code of the first worker that failed (2 for a tunelab error, as without
torchrun), or 0. The workers are forked from the parent (torchrun's --start-method applies to a
--run-path script): they start with the torch, transformers and peft the parent imported to plan the
run, instead of each importing them again (about 15 s of CPU per worker on a 2-core EPYC); with a GPU
build of torch they are spawned (`start_method`). A process started by a launcher (torchrun, accelerate
launch, deepspeed) has LOCAL_RANK / WORLD_SIZE in its environment and trains directly; it never launches
again.

This module owns the decision and the command line; the process group itself is set up by
transformers/accelerate when TrainingArguments is built (gloo on CPU, nccl on CUDA).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import errno
import importlib.util
import json
import logging
import os
import re
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from tunelab.config.loader import parse_overrides, read_yaml
from tunelab.config.training_values import training_with
from tunelab.errors import ConfigError

if TYPE_CHECKING:  # annotations only: a worker checks its node's share (check_node_shares) before transformers loads
    from tunelab.config.training_args import TrainingArguments

NPROC_ENV = "TUNELAB_NPROC_PER_NODE"
LAUNCHER_THREADS_ENV = "TUNELAB_LAUNCHER_THREADS"  # the launcher's torch threads, for its forked workers


def under_launcher() -> bool:
    """True in a worker that torchrun, accelerate launch or deepspeed started."""
    return "LOCAL_RANK" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1


def nproc_per_node(args: TrainingArguments) -> int:
    """The config's nproc_per_node, else $TUNELAB_NPROC_PER_NODE, else 1."""
    if args.nproc_per_node is not None:
        value, where = args.nproc_per_node, "nproc_per_node"
    else:
        raw = os.environ.get(NPROC_ENV, "").strip()
        if not raw:
            return 1
        try:
            value = int(raw)
        except ValueError:
            raise ConfigError(f"{NPROC_ENV}: expected a whole number of processes, got {raw!r}") from None
        where = NPROC_ENV
    if value < 1:
        raise ConfigError(f"{where}: expected at least 1 process, got {value}")
    return value


def per_rank_streams(args: TrainingArguments) -> TrainingArguments:
    """streaming: true. A copy of `args` whose accelerator_config.dispatch_batches is False where it was unset, so that
    each process reads its own shard of the stream instead of rank 0 reading for all (data/streaming.py's docstring);
    `args` itself as it was when the option was given (config/checks.py refuses true)."""
    accelerator = args.accelerator_config
    if accelerator.dispatch_batches is not None:
        return args
    return training_with(args, accelerator_config=dataclasses.replace(accelerator, dispatch_batches=False))


def check_launch(args: TrainingArguments) -> None:
    """Launch options that contradict each other or the launcher that started this process."""
    if args.nnodes < 1:
        raise ConfigError(f"nnodes: expected at least 1, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        raise ConfigError(f"node_rank: expected 0 to {args.nnodes - 1} (nnodes {args.nnodes}), got {args.node_rank}")
    if args.nnodes > 1 and not args.master_addr:
        raise ConfigError("nnodes > 1 needs master_addr: the address of the node_rank 0 machine")
    if under_launcher():
        wanted = args.nproc_per_node
        started = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        if wanted is not None and wanted != started:
            raise ConfigError(
                f"nproc_per_node: {wanted}, but the launcher started {started} processes per node; "
                "remove nproc_per_node when you launch with torchrun / accelerate launch yourself"
            )
        check_node_shares()


def check_node_shares() -> None:
    """In a torchrun worker: every node must bring the same number of processes. torchrun's rendezvous adds up
    what each node brings, so a node with another nproc_per_node still joins, and every rank would train on a
    share of the data that the config does not describe. Read from torchrun's environment alone, so a worker
    stops within a second of starting (before torch and transformers load), not after the config is built."""
    try:
        world, local, nodes = (int(os.environ[k]) for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE"))
    except (KeyError, ValueError):
        return  # not torchrun's environment (deepspeed's launcher, or no launcher)
    if world != local * nodes:
        raise ConfigError(
            f"nproc_per_node differs between nodes: this node started {local} processes but the {nodes} "
            f"nodes brought {world} in all; start every node with the same nproc_per_node"
        )


def needs_launch(args: TrainingArguments) -> bool:
    """Several processes, several nodes, or DeepSpeed: DeepSpeed outside a launcher looks for MPI (mpi4py)
    to learn its rank, so even one DeepSpeed process runs under torchrun."""
    check_launch(args)
    return not under_launcher() and (nproc_per_node(args) > 1 or args.nnodes > 1 or bool(args.deepspeed))


def wants_launch(config_path: str | None, overrides: list[str]) -> bool:
    """Whether this command asks for several processes, read from the raw YAML and overrides, before
    TrainingArguments is built (building it selects a GPU in this process; see `devices_untouched`).
    Values that do not parse answer False here; load_config then reports them."""

    if under_launcher():
        return False
    try:
        raw = {**(read_yaml(config_path) if config_path else {}), **parse_overrides(list(overrides))}
        nproc = raw.get("nproc_per_node") or os.environ.get(NPROC_ENV) or 1
        return int(nproc) > 1 or int(raw.get("nnodes") or 1) > 1 or bool(raw.get("deepspeed"))
    except (ConfigError, TypeError, ValueError):
        return False


@contextlib.contextmanager
def devices_untouched():
    """Build the config in the launching process without selecting a device: transformers would call
    torch.cuda.set_device(0) and this process would hold a CUDA context on GPU 0 while the workers train.
    ACCELERATE_USE_CPU is transformers' own switch for that, and it is removed before any worker starts."""
    previous = os.environ.get("ACCELERATE_USE_CPU")
    os.environ["ACCELERATE_USE_CPU"] = "true"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("ACCELERATE_USE_CPU", None)
        else:
            os.environ["ACCELERATE_USE_CPU"] = previous


# What each worker runs: `python -m tunelab`'s script, by path (torchrun's --run-path takes a file).
WORKER_SCRIPT = str(Path(__file__).resolve().parents[1] / "__main__.py")


def torchrun_argv(args: TrainingArguments, cli_args: list[str], start_method: str = "fork") -> list[str]:
    """torchrun's arguments for this run; `cli_args` is what follows `tunelab` (train cfg.yaml k=v ...)."""
    argv = [f"--nproc_per_node={nproc_per_node(args)}", f"--nnodes={args.nnodes}"]
    if args.nnodes > 1:
        argv += [f"--node_rank={args.node_rank}", f"--master_addr={args.master_addr}"]
    if args.master_port is not None or args.nnodes > 1:
        # Static rendezvous at master_addr:master_port; one node without a port gets a free one.
        argv.append(f"--master_port={args.master_port or 29500}")
    return [*argv, f"--start-method={start_method}", "--run-path", WORKER_SCRIPT, *cli_args]


def start_method(version) -> str:
    """How torchrun starts the workers, given `torch.version`: fork where torch is built without a GPU backend
    (the CPU wheel), so they start with this process's imports; spawn (fresh interpreters, torchrun's default) in
    a CUDA / ROCm / XPU build, where planning has asked the driver about devices and a forked child could not
    initialise them."""
    gpu_build = any(getattr(version, backend, None) for backend in ("cuda", "hip", "xpu"))
    return "spawn" if gpu_build else "fork"


def start_deepspeed_comm(args: TrainingArguments) -> None:
    """DeepSpeed's communication layer over the process group transformers has started. On GPUs transformers
    starts it while building TrainingArguments; with use_cpu it does not, and ZeRO-3 would load the model
    (deepspeed.zero.Init) believing it is alone (world size 1). A no-op when it is already started."""
    if args.deepspeed and args.world_size > 1:
        import deepspeed  # lazy: the deepspeed extra, which may be missing

        deepspeed.init_distributed(dist_backend=args.ddp_backend or "gloo")


def end_process_group() -> None:
    """Every rank reaches the end, then the process group is torn down before the interpreter exits. Left to
    interpreter teardown, gloo's threads were sometimes destroyed while joinable and a rank of a finished run
    died with SIGABRT ("terminate called without an active exception"), failing the launch."""
    # lazy: torch (2.8 s): a torchrun worker runs check_node_shares before any heavy import
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# What gloo and NCCL say when a peer's connection ends mid-collective (its process or machine died).
LOST_PEER_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted")


def lost_peer_message(exc: BaseException, args: TrainingArguments) -> str | None:
    """One line for a collective that failed because another rank went away, else None. A peer whose sockets
    close (a killed process, a rebooted machine) fails the collective at once; one that goes silent is waited
    for up to ddp_timeout (transformers' default 1800 s)."""
    # lazy: torch (2.8 s): a torchrun worker runs check_node_shares before any heavy import
    import torch.distributed as dist

    if args.world_size <= 1 or not isinstance(exc, RuntimeError):  # torch's DistError family included
        return None
    text = str(exc)
    if not (isinstance(exc, dist.DistNetworkError) or any(marker in text for marker in LOST_PEER_MARKERS)):
        return None
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(exc).__name__)
    # gloo: "[.../pair.cc:537] Read error [127.0.0.1]:6023: Connection reset by peer. This is typically ..."
    first = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". ")[0]
    return (
        f"lost contact with another rank during training (rank {args.process_index} of {args.world_size}: {first}); "
        "another process or node stopped (see its output); rerun every node with resume_from_checkpoint=true to "
        "continue from the last checkpoint"
    )


def check_port_free(args: TrainingArguments) -> None:
    """The node that hosts the rendezvous (node_rank 0, or the only node with master_port set) binds
    master_port; if something already listens there torchrun fails with a long traceback, so say it first."""
    if args.master_port is None and args.nnodes == 1 or args.node_rank != 0:
        return
    port = args.master_port or 29500
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # SO_REUSEADDR as the rendezvous store sets it: a port left in TIME_WAIT by the last run is free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            raise ConfigError(
                f"master_port: {port} is already in use on this machine (another run or program listens "
                "there); choose a free master_port"
            ) from None


def launch(args: TrainingArguments, cli_args: list[str]) -> int:
    """Run `cli_args` under torchrun; the exit code of the first failed worker, or 0."""
    # lazy: torch (2.8 s): a torchrun worker runs check_node_shares before any heavy import
    import torch
    from accelerate.state import AcceleratorState, GradientState
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torchrun

    check_port_free(args)
    # Forked workers inherit this process as it is. Planning the run filled in accelerate's process-wide state for
    # one CPU process (class-level singletons; in a test process, earlier runs' too): emptied, each worker sets up
    # its own rank.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    argv = torchrun_argv(args, cli_args, start_method(torch.version))
    print(f"tunelab: launching {sys.executable} -m torch.distributed.run {' '.join(argv)}", file=sys.stderr, flush=True)
    # torchrun's agent installs process-wide handlers for these and leaves them: put ours back after.
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)}
    try:
        torchrun(get_args_parser().parse_args(argv))
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        code = failure.exitcode if failure.exitcode > 0 else 1  # negative: killed by a signal
        if code - 128 in (signal.SIGTERM, signal.SIGINT):  # stopped on a signal after saving (train/signals.py)
            name = signal.Signals(code - 128).name
            print(f"tunelab: rank {rank} stopped on {name} (exit code {code}); the command to resume is above",
                  file=sys.stderr)
        else:
            print(f"tunelab: error: rank {rank} exited with code {failure.exitcode} (its output is above)",
                  file=sys.stderr)
        return code
    except SignalException as exc:  # SIGTERM / SIGINT to this process: torchrun has stopped the workers
        return 128 + int(exc.sigval)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return 0


@contextlib.contextmanager
def one_thread():
    """Plan and launch with torch on one thread, then give the count back. OpenMP (GNU libgomp) keeps a thread
    team across fork without its threads: a forked worker whose op asks for more than one thread would wait for
    them forever if this process had ever run a parallel op. Each worker then takes OMP_NUM_THREADS (torchrun
    sets 1 for several workers a node) or this process's count (prepare_worker)."""
    # lazy: torch (2.8 s): a torchrun worker runs check_node_shares before any heavy import
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    os.environ[LAUNCHER_THREADS_ENV] = str(threads)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        os.environ.pop(LAUNCHER_THREADS_ENV, None)


def prepare_worker() -> None:
    """In a torchrun worker, before the command runs: what a worker forked from the launcher (start_method) must
    set up as a fresh interpreter would. Inside a host program (pytest, a notebook) it inherits that program's
    stdout / stderr objects and logging handlers, which may write into memory or through a thread the worker does
    not have: it writes to file descriptors 1 and 2, line by line, as `python -u` does, and logs there. Its torch
    threads are OMP_NUM_THREADS (torchrun sets 1 for several workers a node), else the launcher's count."""
    sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False)  # noqa: SIM115
    logging.root.handlers.clear()
    threads = os.environ.get("OMP_NUM_THREADS") or os.environ.get(LAUNCHER_THREADS_ENV)
    torch = sys.modules.get("torch")  # a fresh interpreter reads OMP_NUM_THREADS as it imports torch
    if torch is not None and threads and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


# ---- DeepSpeed's config file, before transformers reads it -----------------------------------------------


def check_deepspeed(values: dict) -> None:
    """transformers reads the DeepSpeed file and imports deepspeed while TrainingArguments is built: check first."""
    deepspeed = values.get("deepspeed")
    if not deepspeed:
        return
    if isinstance(deepspeed, str):
        if not Path(deepspeed).is_file():
            raise ConfigError(
                f"deepspeed: {deepspeed} does not exist; point it at a DeepSpeed JSON config "
                "(examples/deepspeed/ds_z2_config.json or ds_z3_config.json)"
            )
        try:
            parsed = json.loads(Path(deepspeed).read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"deepspeed: {deepspeed} is not valid JSON ({exc})") from None
        if not isinstance(parsed, dict):
            raise ConfigError(f"deepspeed: {deepspeed} holds a JSON {type(parsed).__name__}, not a DeepSpeed config object")
    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigError("deepspeed is set but the deepspeed package is not installed: pip install 'tunelab[deepspeed]'")
    section = (parsed if isinstance(deepspeed, str) else deepspeed).get("zero_optimization") or {}
    _check_zero_section(deepspeed if isinstance(deepspeed, str) else "the deepspeed dict", section)
    if values.get("use_cpu"):
        for key in ("offload_optimizer", "offload_param"):
            device = (section.get(key) or {}).get("device", "none")
            if device not in (None, "none"):
                # Offloading moves state from accelerator memory to the host; CPU-only it also needs DeepSpeed's
                # compiled CPU Adam, which tunelab does not build here (docs/distributed.md).
                raise ConfigError(
                    f"deepspeed: zero_optimization.{key} (device {device}) offloads from GPU memory to the host; "
                    f"a CPU-only run has nothing to offload: remove {key}, or run it on GPUs"
                )


def _check_zero_section(where: str, section: dict) -> None:
    """DeepSpeed validates zero_optimization with extra keys forbidden, but only inside every worker, as a
    multi-line pydantic error: check it once here, leaving out the "auto" values transformers fills in."""
    # lazy: the deepspeed extra, which may be missing
    import pydantic
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    if not isinstance(section, dict):
        raise ConfigError(f"deepspeed: {where}: zero_optimization must be an object, got {section!r}")
    try:
        DeepSpeedZeroConfig(**{k: v for k, v in section.items() if v != "auto"})
    except pydantic.ValidationError as exc:
        error = exc.errors()[0]
        key = ".".join(str(part) for part in error["loc"])
        if error["type"] == "extra_forbidden":
            known = [*DeepSpeedZeroConfig.model_fields, *(f.alias for f in DeepSpeedZeroConfig.model_fields.values() if f.alias)]
            close = difflib.get_close_matches(key.split(".")[0], known, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(f"deepspeed: {where}: zero_optimization.{key} is not a DeepSpeed ZeRO option{hint}") from None
        raise ConfigError(f"deepspeed: {where}: zero_optimization.{key}: {error['msg']} (got {error.get('input')!r})") from None
