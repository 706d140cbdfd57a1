"""How much memory this process holds: the numbers every log line and the run summary carry.

- CPU: the resident set (VmRSS) and its peak since the process started (VmHWM), from /proc/self/status on
  Linux. Elsewhere both are getrusage's peak (an upper bound for the current size). VmHWM, unlike
  getrusage's ru_maxrss, starts afresh at exec, so a run started by another process (a test, a launcher)
  reports its own peak, not its parent's.
- GPU (when the run's device is CUDA): the tensors allocated now, the memory the caching allocator has
  reserved, and the peak allocated since the process started (torch.cuda.*), for this process's device.

Only this process: under torchrun each rank measures itself, and trainer_log.jsonl holds rank 0's lines.
`tunelab estimate` predicts the same peak (docs/use.md compares the two).

How far that peak sits above the live tensors is glibc's choice: its malloc raises its mmap threshold as large
blocks are freed (up to 32 MiB), after which a training step's activations come from its heap, whose freed holes
stay resident. On Qwen2.5-Coder-0.5B (LoRA, packed rows of 512 tokens, float32) the peak RSS was 5,154 MiB against
4,586 with `MALLOC_MMAP_THRESHOLD_=1048576`, but its steps took 1.5x as long (fresh pages zeroed on every touch;
docs/benchmarks.md, "Where the peak goes"), so training leaves the allocator as it is and the setting to the user.
"""

from __future__ import annotations

import re
import resource
import sys
from pathlib import Path

import torch

MIB = 1024 * 1024


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
