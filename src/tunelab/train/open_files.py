"""Open file descriptors: the soft limit a run raises, the budget its DataLoader needs, and the one-line fix when
they run out ("Too many open files", errno EMFILE).

Where a training process spends descriptors:
- what is open before training: libraries, logs, and the memory-mapped Arrow files of the tokenized datasets
  (each DataLoader worker inherits every one of them);
- DataLoader workers (`dataloader_num_workers`): each has its queues and pipes to the main process, and hands
  every tensor of a batch over through shared memory. With torch's default sharing strategy
  (`file_descriptor`) each such tensor holds one descriptor in the main process for as long as it lives,
  and each worker keeps `dataloader_prefetch_factor` (default 2) batches in flight.

A 1024 soft limit (many distributions' default) is a classic crash. So `tunelab train` lifts the soft limit to
the hard one and logs the change (old → new); checks before training that the limit covers what is open plus
what the workers will add (a warning naming the numbers); and turns a run that still runs out — an EMFILE
OSError, torch's "Too many open files. Communication with the workers is no longer possible" RuntimeError, or a
worker's wrapped "[Errno 24]" — into one line with the fixes (cli.py prints it).
"""

from __future__ import annotations

import errno
import logging
import os
import resource

logger = logging.getLogger(__name__)

# Tensors of one batch, each a descriptor while it lives in the main process: input_ids, labels, attention_mask /
# position_ids and a packed batch's boundaries; pairs add a little. An estimate, not a count.
TENSORS_PER_BATCH = 4
# Queues, pipes and the process sentinel each worker costs the main process.
DESCRIPTORS_PER_WORKER = 6
# Room for what opens while training runs: checkpoints being written, logs, the plots.
HEADROOM = 64
EXHAUSTION_MESSAGES = ("Too many open files", "[Errno 24]", "received 0 items of ancdata")


def raise_open_file_limit() -> tuple[int, int]:
    """Lift the soft open-file limit to the hard one (DataLoader workers and Arrow memory maps each
    hold descriptors; a 1024 soft limit is a classic "Too many open files" crash). Returns (old, new)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):  # some containers refuse; the checks and messages below still guide the user
        return soft, soft
    return soft, target


def soft_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def open_descriptors() -> int | None:
    """How many descriptors this process has open (Linux /proc/self/fd, macOS /dev/fd), None where unknown."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(folder)) - 1  # listing the folder opens one itself
        except OSError:
            continue
    return None


def worker_descriptors(num_workers: int, prefetch_factor: int | None) -> int:
    """Descriptors `num_workers` DataLoader workers add to the main process (an estimate; module docstring)."""
    if num_workers <= 0:
        return 0
    return num_workers * ((prefetch_factor or 2) * TENSORS_PER_BATCH + DESCRIPTORS_PER_WORKER)


def check_open_file_budget(num_workers: int, prefetch_factor: int | None) -> str | None:
    """Before training: a warning (logged, and returned) when the soft limit does not cover what is open now plus
    what the DataLoader workers will add and some headroom; None when it does, or when it cannot be told."""
    limit, opened = soft_limit(), open_descriptors()
    if limit == resource.RLIM_INFINITY or opened is None or num_workers <= 0:
        return None
    needed = opened + worker_descriptors(num_workers, prefetch_factor) + HEADROOM
    if needed <= limit:
        return None
    message = (
        f"the open-file limit ({limit}) is too low for this run: {opened} descriptors are open before training, "
        f"dataloader_num_workers: {num_workers} adds about {worker_descriptors(num_workers, prefetch_factor)} "
        f"(each worker's pipes, and each tensor of its {prefetch_factor or 2} batches in flight), plus {HEADROOM} for "
        f"files opened while training (checkpoints, logs); raise it with `ulimit -n {max(65536, needed)}` before the "
        "run (the hard limit of the container or service caps it), or lower dataloader_num_workers"
    )
    logger.warning("%s", message)
    return message


def is_open_file_exhaustion(exc: BaseException) -> bool:
    """True for the ways running out of descriptors surfaces: an EMFILE OSError, or an exception whose message
    says so (torch's DataLoader RuntimeError, a worker's exception re-raised with its original message), or one
    caused by them."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno == errno.EMFILE:
            return True
        if any(text in str(exc) for text in EXHAUSTION_MESSAGES):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def open_file_fix() -> str:
    """The one line a run that ran out of descriptors ends with."""
    return (
        f"too many open files (limit {soft_limit()}): raise it with `ulimit -n 65536` before the run, "
        "or lower dataloader_num_workers (0 passes batches without descriptors) / preprocessing_num_workers"
    )
