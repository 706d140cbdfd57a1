"""The memory every log line carries (train/memory.py): this process's resident set and its peak."""

from __future__ import annotations

import gc

import torch

from tunelab.train.memory import memory_metrics, peak_memory_metrics


def test_memory_follows_what_this_process_holds():
    gc.collect()  # what earlier tests left for the collector must not be released between the two readings
    before = memory_metrics("cpu")
    assert set(before) == {"memory_rss_mib", "memory_peak_rss_mib"}  # no GPU keys on a CPU device
    assert 0 < before["memory_rss_mib"] <= before["memory_peak_rss_mib"]
    block = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB, written, so resident
    during = memory_metrics("cpu")
    assert during["memory_rss_mib"] - before["memory_rss_mib"] > 48
    assert during["memory_peak_rss_mib"] >= during["memory_rss_mib"] - 1  # VmHWM folds thread counters lazily
    del block
    assert peak_memory_metrics("cpu")["memory_peak_rss_mib"] >= during["memory_rss_mib"] - 1
