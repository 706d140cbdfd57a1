"""The memory every log line carries (train/memory.py): this process's resident set and its peak, and the C
allocator setting that keeps that peak near the live tensors."""

from __future__ import annotations

import gc
import mmap
import os
import subprocess
import sys

import pytest

from tunelab.train.memory import memory_metrics, peak_memory_metrics


def test_memory_follows_what_this_process_holds():
    gc.collect()  # what earlier tests left for the collector must not be released between the two readings
    before = memory_metrics("cpu")
    assert set(before) == {"memory_rss_mib", "memory_peak_rss_mib"}  # no GPU keys on a CPU device
    assert 0 < before["memory_rss_mib"] <= before["memory_peak_rss_mib"]
    # 64 MiB of fresh pages, written, so resident: an anonymous mapping of its own (a tensor may land in memory the
    # allocator kept resident after an earlier test freed it, and then RSS does not move).
    block = mmap.mmap(-1, 64 * 1024 * 1024)
    block.write(b"\x01" * len(block))
    during = memory_metrics("cpu")
    assert during["memory_rss_mib"] - before["memory_rss_mib"] > 48
    assert during["memory_peak_rss_mib"] >= during["memory_rss_mib"] - 1  # VmHWM folds thread counters lazily
    block.close()
    assert peak_memory_metrics("cpu")["memory_peak_rss_mib"] >= during["memory_rss_mib"] - 1


_HEAP_HOLES = r"""
import torch
from tunelab.train.memory import rss_bytes
torch.empty(4 << 20).fill_(1)  # a freed 16 MiB mapping: glibc raises its mmap threshold to that size
blocks = [torch.empty(2 << 20).fill_(1) for _ in range(40)]  # 40 tensors of 8 MiB
before = rss_bytes()["VmRSS"]
del blocks[:-1]  # freed below the last one, which keeps the heap's top in place
print((before - rss_bytes()["VmRSS"]) >> 20)
"""


@pytest.mark.slow  # two fresh processes importing torch
def test_freed_tensors_leave_the_process_once_large_blocks_are_mapped():
    """Freed tensors in glibc's heap under a live one stay resident (the peak a training step shows, train/memory.py);
    with MALLOC_MMAP_THRESHOLD_=1048576 (docs/benchmarks.md's trade: less memory, slower steps) every tensor of 1 MiB
    and up has its own mapping, returned when freed. Each case in a fresh process (glibc reads it at start)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")}

    def returned_mib(mode: str) -> int:
        extra = {"MALLOC_MMAP_THRESHOLD_": "1048576"} if mode == "pinned" else {}
        done = subprocess.run([sys.executable, "-c", _HEAP_HOLES], capture_output=True, text=True, env={**env, **extra})
        assert done.returncode == 0, done.stderr[-2000:]
        return int(done.stdout.split()[-1])

    assert returned_mib("default") < 50  # the 39 freed tensors (312 MiB) stay in the heap
    assert returned_mib("pinned") > 280
