"""How much memory this process holds: the numbers every log line and the run summary carry.

- CPU: the resident set (VmRSS) and its peak since the process started (VmHWM), from /proc/self/status on
  Linux. Elsewhere both are getrusage's peak (an upper bound for the current size). VmHWM, unlike
  getrusage's ru_maxrss, starts afresh at exec, so a run started by another process (a test, a launcher)
  reports its own peak, not its parent's.
- GPU (when the run's device is CUDA): the tensors allocated now, the memory the caching allocator has
  reserved, and the peak allocated since the process started (torch.cuda.*), for this process's device.

Only this process: under torchrun each rank measures itself, and trainer_log.jsonl holds rank 0's lines.
`tunelab estimate` predicts the same peak (docs/use.md compares the two).

It also owns one setting of the C allocator that decides how far that peak sits above the live tensors
(`map_large_blocks`): glibc's malloc raises its mmap threshold as large blocks are freed (up to 32 MiB), after
which a training step's activations come from its heap, whose freed holes stay resident. On Qwen2.5-Coder-0.5B
(LoRA, packed rows of 512 tokens, float32) that heap kept 1.2 GiB free at the end of a step: the peak RSS was
5,661 MiB against 4,588 with the threshold pinned at 1 MiB (docs/benchmarks.md, "Where the peak goes").
"""

from __future__ import annotations

import ctypes
import os
import re
import resource
import sys
from pathlib import Path

import torch

MIB = 1024 * 1024
MMAP_THRESHOLD = MIB  # blocks of this size and up get their own mapping, unmapped when freed
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def rss_bytes() -> dict[str, int]:
    """Current (VmRSS) and peak (VmHWM) resident memory of this process: /proc/self/status on Linux; elsewhere
    both are the peak so far (getrusage), an upper bound for the current size."""
    status = Path("/proc/self/status")
    if not status.exists():
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        return {"VmRSS": peak, "VmHWM": peak}
    text = status.read_text()
    return {key: int(re.search(rf"{key}:\s+(\d+) kB", text).group(1)) * 1024 for key in ("VmRSS", "VmHWM")}


def reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux: writing 5 to /proc/self/clear_refs; elsewhere nothing to do).
    For measurements of a part of a process (estimate's probe, bench); a training run never resets it."""
    clear_refs = Path("/proc/self/clear_refs")
    if clear_refs.exists():
        clear_refs.write_text("5")


def memory_metrics(device: torch.device | str | None = None) -> dict[str, float]:
    """{memory_rss_mib, memory_peak_rss_mib} and, on a CUDA device, {gpu_allocated_mib, gpu_reserved_mib,
    gpu_peak_allocated_mib}, in MiB rounded to 0.1."""
    rss = rss_bytes()
    metrics = {"memory_rss_mib": round(rss["VmRSS"] / MIB, 1), "memory_peak_rss_mib": round(rss["VmHWM"] / MIB, 1)}
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        metrics["gpu_allocated_mib"] = round(torch.cuda.memory_allocated(device) / MIB, 1)
        metrics["gpu_reserved_mib"] = round(torch.cuda.memory_reserved(device) / MIB, 1)
        metrics["gpu_peak_allocated_mib"] = round(torch.cuda.max_memory_allocated(device) / MIB, 1)
    return metrics


def peak_memory_metrics(device: torch.device | str | None = None) -> dict[str, float]:
    """The peaks alone (the run summary in all_results.json)."""
    return {k: v for k, v in memory_metrics(device).items() if "peak" in k}


def map_large_blocks(threshold: int = MMAP_THRESHOLD) -> bool:
    """Pin glibc's mmap threshold at `threshold` bytes: every block that large is mapped on its own and returned to
    the system when freed, so peak RSS follows the live tensors instead of the heap's high-water mark (module
    docstring). Its cost: such blocks are fresh pages the kernel zeroes on first touch. False, doing nothing, off
    glibc or where the user set the threshold already (MALLOC_MMAP_THRESHOLD_ or GLIBC_TUNABLES' mmap_threshold:
    theirs is kept)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "mmap_threshold" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (macOS, Windows, musl)
        return False
    return mallopt(_M_MMAP_THRESHOLD, threshold) == 1
