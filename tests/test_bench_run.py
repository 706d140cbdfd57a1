"""bench/run.py's figures from the probe's events: the summed training loss that compares tools on the same rows."""

import importlib.util
import sys

import pytest

from tests.fixture_paths import REPO_ROOT


@pytest.fixture(scope="module")
def run():
    spec = importlib.util.spec_from_file_location("bench_run", REPO_ROOT / "bench" / "run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while the file runs
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def events(supervised: list[int], losses: list[float]) -> list[dict]:
    out = [{"event": "start"}]
    for step, (count, loss) in enumerate(zip(supervised, losses), start=1):
        out.append({"event": "step", "step": step, "supervised": count})
        out.append({"event": "log", "step": step, "logs": {"loss": loss, "grad_norm": 1.0}})
    return out


def test_summed_loss_weights_every_step_by_its_supervised_tokens(run):
    assert run.summed_loss(events([30, 160], [1.2, 0.25])) == pytest.approx(30 * 1.2 + 160 * 0.25)


def test_one_more_near_free_token_per_row_moves_the_step_mean_not_the_sum(run):
    # the same 30 answer tokens (summed loss 33), once with 4 extra targets of loss 0: the means differ by 13%
    ours, peers = events([30], [33 / 30]), events([34], [33 / 34])
    assert run.summed_loss(ours) == pytest.approx(run.summed_loss(peers)) == pytest.approx(33.0)
    assert (33 / 30) / (33 / 34) == pytest.approx(1.1333, abs=1e-4)


def test_summed_loss_needs_a_loss_for_every_step(run):
    partial = events([30, 40], [1.0, 2.0])[:-1]  # step 2 has no log line (logging_steps > 1)
    assert run.summed_loss(partial) is None
    assert run.summed_loss([{"event": "start"}]) is None
