"""The loss plots: the smoothing by hand, the log-scale rule, and what ends up in the PNGs."""

from __future__ import annotations

import json
import math

import pytest

from tunelab.config.metric_names import GENERATION_METRIC_NAMES
from tunelab.train.plots import (
    EVAL_COLORS,
    TRAIN_COLOR,
    debiased_ema,
    _as_percent,
    _percent_label,
    eval_loss_keys,
    eval_metric_keys,
    loss_figure,
    percent_figure,
    plot_loss,
    reward_figure,
    series,
    smooth_curve,
    smoothing_weight,
    use_log_scale,
)


def test_debiased_ema_by_hand():
    # out[k] = sum_j w^(k-j) v[j] / sum_j w^(k-j), w = 0.5: 4, (2 + 2) / 1.5, (1 + 1 + 1) / 1.75.
    assert debiased_ema([4.0, 2.0, 1.0], 0.5) == pytest.approx([4.0, 8 / 3, 12 / 7], rel=1e-15)


def test_debiased_ema_starts_at_the_first_value_and_keeps_a_constant():
    values = [10.6, 0.3, 0.2, 0.1]
    assert debiased_ema(values, 0.99)[0] == 10.6  # not dragged to 0, nor kept at 10.6 by the start
    assert debiased_ema([0.7] * 500, 0.95) == pytest.approx([0.7] * 500, rel=1e-12)
    assert debiased_ema(values, 0.0) == values


def test_debiased_ema_refuses_a_weight_outside_0_1():
    with pytest.raises(ValueError, match=r"^smoothing weight must be in \[0, 1\), got 1.0$"):
        debiased_ema([1.0], 1.0)


@pytest.mark.parametrize("points, weight", [(1, 0.0), (12, 0.0), (99, 0.0), (100, 0.5), (300, 1 - 1 / 6),
                                            (5000, 0.99), (100_000, 0.99)])
def test_smoothing_weight_follows_the_number_of_points(points, weight):
    # span 1 / (1 - weight) = 2% of the points; none below a span of 2; at most 0.99.
    assert smoothing_weight(points) == pytest.approx(weight, abs=1e-15)


def test_smooth_curve_is_none_for_few_points_and_geometric_on_a_log_axis():
    assert smooth_curve([3.0, 2.0, 1.0], log_scale=False) is None
    values = [10.0 * 0.97**k for k in range(200)]  # 200 points: weight 0.75
    assert smooth_curve(values, log_scale=False) == debiased_ema(values, 0.75)
    geometric = [math.exp(v) for v in debiased_ema([math.log(v) for v in values], 0.75)]
    assert smooth_curve(values, log_scale=True) == pytest.approx(geometric, rel=1e-12)
    # A geometric series smoothed in log space lags by a constant factor, never crossing the points.
    assert all(s >= v for s, v in zip(smooth_curve(values, log_scale=True), values, strict=True))


@pytest.mark.parametrize("values, log", [([10.0, 0.1], True), ([10.0, 0.25], False), ([10.6, 0.0065], True),
                                         ([5.0, 0.0, 0.001], False), ([2.0, -1.0], False), ([], False)])
def test_log_scale_when_positive_values_span_more_than_50x(values, log):
    assert use_log_scale(values) is log


def test_series_skips_missing_and_non_finite_values():
    records = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": float("nan")}, {"step": 2, "eval_loss": 1.5},
               {"step": 3, "loss": float("inf")}, {"step": 4, "loss": 1.0}]
    assert series(records, "loss") == ([1, 4], [2.0, 1.0])
    assert eval_loss_keys([{"step": 1, "eval_a_loss": 1.0, "eval_runtime": 2.0}, {"step": 2, "eval_b_loss": 1.0}]) == [
        "eval_a_loss", "eval_b_loss"]


def _lines(fig) -> dict[str, tuple[list, list]]:
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in fig.axes[0].get_lines()}


def test_a_long_falling_loss_gets_raw_and_smoothed_lines_on_a_log_axis():
    steps = list(range(1, 301))
    values = [10.6 * math.exp(-k / 40) for k in steps]  # 10.6 -> 0.006: three decades
    fig = loss_figure({"loss": (steps, values)}, "training loss — run")
    ax = fig.axes[0]
    assert (ax.get_yscale(), ax.get_xlabel(), ax.get_ylabel(), ax.get_title()) == (
        "log", "step", "loss (log scale)", "training loss — run")
    smoothed = smooth_curve(values, log_scale=True)
    assert _lines(fig) == {
        f"loss, raw (last {values[-1]:.4g})": (steps, values),
        f"loss, smoothed (last {smoothed[-1]:.4g})": (steps, smoothed),
    }
    # The smoothed line ends next to the raw loss (the old fixed 0.9 average ended 190x above it).
    assert smoothed[-1] / values[-1] == pytest.approx(math.exp(5 / 40), rel=1e-6)  # a 5-point lag at span 6


def test_few_points_are_drawn_as_they_are_on_a_linear_axis():
    fig = loss_figure({"loss": ([1, 2, 3], [2.0, 1.5, 1.2])}, "t")
    assert fig.axes[0].get_yscale() == "linear" and fig.axes[0].get_ylabel() == "loss"
    [line] = fig.axes[0].get_lines()
    assert (line.get_label(), line.get_marker(), list(line.get_ydata())) == ("loss (last 1.2)", "o", [2.0, 1.5, 1.2])


def _color_at(path, fig, x: float, y: float) -> tuple[float, float, float]:
    """The PNG's colour where data point (x, y) of the figure's axes lands."""
    import matplotlib.image

    image = matplotlib.image.imread(path)[..., :3]
    px, py = fig.axes[0].transData.transform((x, y))
    return tuple(float(c) for c in image[image.shape[0] - 1 - round(py), round(px)])


def test_plot_loss_writes_both_pngs_and_a_lone_evaluation_is_drawn(tmp_path):
    import matplotlib.colors

    records = [{"step": s, "loss": 3.0 - 0.2 * s} for s in range(1, 9)] + [{"step": 8, "eval_loss": 1.1}]
    (tmp_path / "trainer_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    written = plot_loss(tmp_path)
    assert [p.name for p in written] == ["training_loss.png", "eval_loss.png"]
    # The lone evaluation is a marker where it happened (the old one-point line drew nothing there), in front
    # of the training loss.
    fig = loss_figure({"eval_loss": ([8], [1.1])}, f"eval loss — {tmp_path.name}", reference=series(records, "loss"))
    assert list(_lines(fig)) == ["training loss", "eval_loss (last 1.1)"]
    fig.canvas.draw()
    assert _color_at(tmp_path / "eval_loss.png", fig, 8, 1.1) == pytest.approx(matplotlib.colors.to_rgb(EVAL_COLORS[0]), abs=0.02)
    fig = loss_figure({"loss": series(records, "loss")}, f"training loss — {tmp_path.name}")
    fig.canvas.draw()
    assert _color_at(tmp_path / "training_loss.png", fig, 4, 2.2) == pytest.approx(matplotlib.colors.to_rgb(TRAIN_COLOR), abs=0.02)


def test_plot_loss_draws_every_eval_set_and_nothing_without_a_log(tmp_path):
    assert plot_loss(tmp_path) == []
    records = [{"step": 10, "eval_a_loss": 2.0, "eval_b_loss": 3.0}, {"step": 20, "eval_a_loss": 1.0, "eval_b_loss": 2.5}]
    (tmp_path / "trainer_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert [p.name for p in plot_loss(tmp_path)] == ["eval_loss.png"]
    fig = loss_figure({k: series(records, k) for k in eval_loss_keys(records)}, "eval")
    assert sorted(_lines(fig)) == ["eval_a_loss (last 1)", "eval_b_loss (last 2.5)"]


def test_generation_and_accuracy_scores_are_drawn_in_percent(tmp_path):
    records = [
        {"step": 5, "loss": 2.0},
        {"step": 5, "eval_loss": 1.5, "eval_exact_match": 0.25, "eval_bleu": 10.0, "eval_rouge_l": 40.0},
        {"step": 10, "eval_loss": 1.2, "eval_exact_match": 0.5, "eval_bleu": 20.0, "eval_rouge_l": 60.0,
         "eval_token_accuracy": 0.75},
    ]
    (tmp_path / "trainer_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    written = plot_loss(tmp_path)
    assert [p.name for p in written] == ["training_loss.png", "eval_loss.png", "eval_generation.png",
                                         "eval_token_accuracy.png"]
    assert eval_metric_keys(records, GENERATION_METRIC_NAMES) == ["eval_exact_match", "eval_bleu", "eval_rouge_l"]
    curves = {key: _as_percent(key, series(records, key)) for key in eval_metric_keys(records, GENERATION_METRIC_NAMES)}
    assert curves["eval_exact_match"] == ([5, 10], [25.0, 50.0])  # a fraction, drawn as %
    assert curves["eval_bleu"] == ([5, 10], [10.0, 20.0])  # 0-100 already
    fig = percent_figure({_percent_label(k): curve for k, curve in curves.items()}, "generated answers", "score")
    assert sorted(_lines(fig)) == ["eval_bleu (last 20)", "eval_exact_match (%) (last 50)", "eval_rouge_l (last 60)"]
    assert fig.axes[0].get_ylim() == (-2.0, 102.0)


def test_an_rl_run_gets_its_reward_curve_beside_the_share_of_groups_without_spread(tmp_path):
    records = [{"step": s, "loss": 0.01 * s, "reward": 0.1 * s, "zero_spread_groups": 1 - 0.1 * s} for s in range(1, 5)]
    (tmp_path / "trainer_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert [p.name for p in plot_loss(tmp_path)] == ["training_loss.png", "training_reward.png"]
    fig = reward_figure(series(records, "reward"), series(records, "zero_spread_groups"), "r")
    reward_axis, share_axis = fig.axes
    assert list(reward_axis.get_lines()[0].get_ydata()) == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert list(share_axis.get_lines()[0].get_ydata()) == pytest.approx([90, 80, 70, 60])  # a share, drawn as %
    assert [t.get_text() for t in reward_axis.get_legend().get_texts()] == [
        "mean reward of the rollouts (last 0.4)", "groups with no reward spread, % (last 60)"]
