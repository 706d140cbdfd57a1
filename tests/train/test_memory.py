"""The memory every log line carries (train/memory.py): this process's resident set and its peak."""

from __future__ import annotations

import gc
import mmap


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
