"""bench/peers/probe.py's operator count (`bench/run.py --count-ops`): what it reports as dispatched operators and
host-device syncs is what the profiled code did."""

import importlib.util

import torch

from tests.fixture_paths import REPO_ROOT


def load_probe():
    spec = importlib.util.spec_from_file_location("bench_probe", REPO_ROOT / "bench" / "peers" / "probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # BENCH_PROBE_OUT is unset: its events go nowhere
    return module


def test_boolean_indexing_and_scalar_reads_count_as_syncs():
    probe = load_probe()
    x = torch.arange(6.0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        kept = x[x > 2]  # gt, then index with a bool mask: nonzero inside it
        total = float(kept.sum())  # sum, then _local_scalar_dense
        torch.mul(x, 2)
    counts = probe.operator_counts(profile)
    assert total == 12.0
    assert counts["sync_ops"] == {"aten::nonzero": 1, "aten::_local_scalar_dense": 1}
    assert counts["syncs"] == 2
    assert dict(counts["top"]) == {"aten::gt": 1, "aten::index": 1, "aten::sum": 1, "aten::item": 1, "aten::mul": 1}
    assert counts["operators"] == 5
    assert counts["all_operators"] > counts["operators"]  # nonzero and _local_scalar_dense run nested
    assert "kernels" not in counts  # no device events on a CPU


def test_an_index_built_on_the_host_needs_no_sync():
    probe = load_probe()
    x = torch.arange(6.0)
    index = torch.tensor([3, 4, 5])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        x.index_select(0, index).sum()
    counts = probe.operator_counts(profile)
    assert counts["syncs"] == 0 and counts["sync_ops"] == {}
    assert dict(counts["top"]) == {"aten::index_select": 1, "aten::sum": 1}
