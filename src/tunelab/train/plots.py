"""The plots a run leaves in output_dir from trainer_log.jsonl: training_loss.png and eval_loss.png, and when
the evaluations logged them eval_generation.png (generate_at_eval: exact match, BLEU, ROUGE-L) and
eval_token_accuracy.png (compute_token_accuracy), both on a 0-100 axis (fractions drawn as %).

What they draw, and why:
- The raw logged values, always, as faint points joined by a faint line: the smoothed line never hides them.
- A smoothed line only when there are enough points for smoothing to mean something. It is a debiased
  exponential moving average (as TensorBoard draws it): the average starts from zero weight rather than
  from the first value, and each point is divided by the weight accumulated so far, so the first
  smoothed value IS the first raw value and the curve is not dragged towards the start. Its span
  1 / (1 - weight) is 2% of the points (none below 100 points): a trailing average lags by about its
  span, so on a falling loss it sits above the points by the fall over that span; 2% keeps that lag to
  a fiftieth of the x-axis (at 5% the line visibly floats above a loss falling over decades).
- A logarithmic y-axis when the values span more than LOG_SCALE_RATIO (all positive): a loss falling
  from 10 to 0.006 on a linear axis puts its whole second half in the bottom pixel row. On a log axis
  the smoothing runs on log(loss) (a running geometric mean), so the line sits inside the cloud of
  points the eye sees rather than above it.
- Evaluations as markers joined by lines: one evaluation is one visible point. The training loss runs
  behind them, thin and grey, so an evaluation reads against the training curve (and a lone one sits on
  an axis that means something).
- The last value in the legend: what the run ended at, in numbers.

Only the main process calls this, after training (matplotlib is imported here, not at start-up).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from tunelab.config.metric_names import GENERATION_METRIC_NAMES
from tunelab.run_folder import read_log

SMOOTH_SPAN_FRACTION = 0.02  # the moving average's span 1 / (1 - weight), as a share of the points
MIN_SPAN = 2.0  # a shorter span (fewer than 100 points) smooths nothing worth a second line
MAX_SMOOTHING_WEIGHT = 0.99
LOG_SCALE_RATIO = 50.0  # max / min above which the y-axis is logarithmic (> 1.7 decades)

TRAIN_COLOR, EVAL_COLORS = "#1f77b4", ("#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")
REFERENCE_COLOR = "#999999"
FRACTION_METRICS = ("exact_match", "token_accuracy")  # logged as 0-1, drawn as %


def smoothing_weight(points: int) -> float:
    """The EMA weight for a curve of `points` values: the weight whose span 1 / (1 - weight) is
    SMOOTH_SPAN_FRACTION of the points, at most MAX_SMOOTHING_WEIGHT; 0 (no smoothing) below MIN_SPAN."""
    span = points * SMOOTH_SPAN_FRACTION
    if span < MIN_SPAN:
        return 0.0
    return min(1.0 - 1.0 / span, MAX_SMOOTHING_WEIGHT)


def debiased_ema(values: Sequence[float], weight: float) -> list[float]:
    """Exponential moving average with zero-debiasing: out[k] = sum_j w^(k-j) v[j] / sum_j w^(k-j).

    out[0] == values[0]; a constant series stays constant; weight 0 returns the values unchanged.
    """
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smoothing weight must be in [0, 1), got {weight}")
    out, total, norm = [], 0.0, 0.0
    for value in values:
        total = weight * total + value
        norm = weight * norm + 1.0
        out.append(total / norm)
    return out


def use_log_scale(values: Sequence[float]) -> bool:
    """True when every value is positive and the largest is more than LOG_SCALE_RATIO times the smallest."""
    return bool(values) and min(values) > 0 and max(values) / min(values) > LOG_SCALE_RATIO


def smooth_curve(values: Sequence[float], log_scale: bool) -> list[float] | None:
    """The smoothed line to draw over `values`, or None when there are too few points to smooth.
    On a log axis the average runs on log(value)."""
    weight = smoothing_weight(len(values))
    if weight == 0.0:
        return None
    if log_scale:
        return [math.exp(v) for v in debiased_ema([math.log(v) for v in values], weight)]
    return debiased_ema(values, weight)


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key` over the log records that have a finite value for it."""
    points = [(r["step"], float(r[key])) for r in records
              if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return [s for s, _ in points], [v for _, v in points]


def eval_loss_keys(records: list[dict]) -> list[str]:
    """eval_loss (one eval set) or eval_<name>_loss for each of several, in first-seen order."""
    return eval_metric_keys(records, ("loss",))


def eval_metric_keys(records: list[dict], metrics: Sequence[str]) -> list[str]:
    """eval_<metric> / eval_<name>_<metric> keys of the log for each of `metrics`, in first-seen order."""
    keys: list[str] = []
    for record in records:
        for key in record:
            if key.startswith("eval_") and key.endswith(tuple(metrics)) and key not in keys:
                keys.append(key)
    return keys


def _pyplot():
    """matplotlib's pyplot on the file-only backend, and its integer tick locator."""
    import matplotlib  # lazy: matplotlib (5.8 s), drawn at the end of a run; preflight imports this module

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: as matplotlib above, once its backend is chosen
    from matplotlib.ticker import MaxNLocator  # lazy: as matplotlib above

    return plt, MaxNLocator


def _number(value: float) -> str:
    return f"{value:.4g}"


def _draw(ax, steps: list[int], values: list[float], color: str, label: str, log_scale: bool) -> None:
    smoothed = smooth_curve(values, log_scale)
    if smoothed is None:  # few points: the points themselves, clearly
        ax.plot(steps, values, color=color, marker="o", markersize=4, linewidth=1.2,
                label=f"{label} (last {_number(values[-1])})")
        return
    dense = len(values) > 200
    ax.plot(steps, values, color=color, alpha=0.25, linewidth=0.8, marker="." if not dense else None,
            markersize=3, label=f"{label}, raw (last {_number(values[-1])})")
    ax.plot(steps, smoothed, color=color, linewidth=1.8,
            label=f"{label}, smoothed (last {_number(smoothed[-1])})")


def loss_figure(curves: dict[str, tuple[list[int], list[float]]], title: str,
                reference: tuple[list[int], list[float]] | None = None):
    """A matplotlib Figure with a curve per label: x step, y loss, log y-axis when the values span decades.
    `reference` (the eval plot's training loss) is drawn thin and grey behind them, smoothed when long."""
    plt, MaxNLocator = _pyplot()
    shown = [*curves.values(), *([reference] if reference else [])]
    log_scale = use_log_scale([v for _, values in shown for v in values])
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if reference:
        steps, values = reference
        ax.plot(steps, smooth_curve(values, log_scale) or values, color=REFERENCE_COLOR, linewidth=1.0,
                label="training loss", zorder=1)
    colors = [TRAIN_COLOR] if list(curves) == ["loss"] else list(EVAL_COLORS) * len(curves)
    for (label, (steps, values)), color in zip(curves.items(), colors, strict=False):
        _draw(ax, steps, values, color, label, log_scale)
    if log_scale:
        ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    last_step = max(step for steps, _ in shown for step in steps)
    ax.set_xlim(0, last_step * 1.04 + 0.5)  # from the start of the run: a lone evaluation sits where it happened
    ax.set_xlabel("step")
    ax.set_ylabel("loss (log scale)" if log_scale else "loss")
    ax.set_title(title)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def percent_figure(curves: dict[str, tuple[list[int], list[float]]], title: str, ylabel: str):
    """Evaluation scores on a 0-100 axis (fractions such as exact match scaled by 100 before), one line per key."""
    plt, MaxNLocator = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for (label, (steps, values)), color in zip(curves.items(), list(EVAL_COLORS) * len(curves), strict=False):
        _draw(ax, steps, values, color, label, log_scale=False)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    last_step = max(step for steps, _ in curves.values() for step in steps)
    ax.set_xlim(0, last_step * 1.04 + 0.5)
    ax.set_ylim(-2, 102)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def reward_figure(reward: tuple[list[int], list[float]], no_spread: tuple[list[int], list[float]], title: str):
    """An RL run's mean rollout reward (left axis) and its share of groups whose rewards were all equal (right axis,
    %, dashed): where that share is high the group-relative advantages are zero and the step learns nothing."""
    plt, MaxNLocator = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    _draw(ax, *reward, TRAIN_COLOR, "mean reward of the rollouts", log_scale=False)
    ax.set_ylabel("reward")
    handles, labels = ax.get_legend_handles_labels()
    if no_spread[0]:
        share = ax.twinx()
        steps, values = no_spread
        share.plot(steps, [100 * v for v in values], color=REFERENCE_COLOR, linestyle="--", linewidth=1.2,
                   label=f"groups with no reward spread, % (last {100 * values[-1]:.0f})")
        share.set_ylim(-2, 102)
        share.set_ylabel("groups with no reward spread (%)")
        more_handles, more_labels = share.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlim(0, max(reward[0]) * 1.04 + 0.5)
    ax.set_xlabel("step")
    ax.set_title(title)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(handles, labels, fontsize=8)
    fig.tight_layout()
    return fig


def save_figure(fig, path: Path) -> Path:
    plt, _ = _pyplot()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_loss(output_dir: str | Path) -> list[Path]:
    """Write training_loss.png (eval_loss.png when the run evaluated, training_reward.png when it was rewarded)
    from trainer_log.jsonl."""
    output_dir = Path(output_dir)
    records = read_log(output_dir)
    run = output_dir.resolve().name
    written = []
    train = series(records, "loss")
    if train[0]:
        written.append(save_figure(loss_figure({"loss": train}, f"training loss — {run}"), output_dir / "training_loss.png"))
    reward = series(records, "reward")
    if reward[0]:
        figure = reward_figure(reward, series(records, "zero_spread_groups"), f"rollout reward — {run}")
        written.append(save_figure(figure, output_dir / "training_reward.png"))
    evals = {key: series(records, key) for key in eval_loss_keys(records)}
    evals = {key: curve for key, curve in evals.items() if curve[0]}
    if evals:
        figure = loss_figure(evals, f"eval loss — {run}", reference=train if train[0] else None)
        written.append(save_figure(figure, output_dir / "eval_loss.png"))
    for name, metrics, title in (
        ("eval_generation.png", GENERATION_METRIC_NAMES, "generated answers (greedy)"),
        ("eval_token_accuracy.png", ("token_accuracy",), "token accuracy"),
    ):
        curves = {_percent_label(key): _as_percent(key, series(records, key)) for key in eval_metric_keys(records, metrics)}
        curves = {key: curve for key, curve in curves.items() if curve[0]}
        if curves:
            ylabel = "score (0-100; exact match and accuracy in %)"
            written.append(save_figure(percent_figure(curves, f"{title} — {run}", ylabel), output_dir / name))
    return written


def _percent_label(key: str) -> str:
    return f"{key} (%)" if key.endswith(FRACTION_METRICS) else key


def _as_percent(key: str, curve: tuple[list[int], list[float]]) -> tuple[list[int], list[float]]:
    """Fractions (exact match, token accuracy: 0-1) as percentages; BLEU and ROUGE-L are 0-100 already."""
    steps, values = curve
    return (steps, [100 * v for v in values]) if key.endswith(FRACTION_METRICS) else curve
