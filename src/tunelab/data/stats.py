"""`tunelab data stats`: sample lengths (count, min/max/mean/median/p95; percentiles interpolate linearly between
order statistics, numpy's default), the share of real tokens when batches are padded to their longest sample or to
cutoff_len, the supervised-token share, a length histogram (text bars and a PNG), what the pipeline truncated or
dropped and why, and packing efficiency; on the run's data (data/run_data.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import datasets
import numpy as np
import pyarrow.compute as pc

from tunelab.config.args import DataArguments
from tunelab.config.stages import Stage, stage_row
from tunelab.data.collate import (
    padding_free_layout,
)
from tunelab.data.encode import as_examples
from tunelab.data.run_data import (
    RunData,
    batch_order,
    flat_column,
    in_batches,
    sequence_arrays,
    token_lengths,
)
from tunelab.data.vision import image_token_ids
from tunelab.run_folder import DATA_STATS_DIR

HISTOGRAM_BINS = 12
BAR_WIDTH = 40


@dataclass
class LengthStats:
    """Lengths of a split's samples and what batching them costs."""

    count: int
    min: int
    max: int
    mean: float
    median: float
    p95: float
    tokens: int
    supervised: int
    cutoff_len: int
    batch_size: int
    padded_to_longest: int  # batch slots when each batch is padded to its longest sample
    padding_free: int  # batch slots when each batch is laid out padding-free (data/collate.py)

    @property
    def supervised_share(self) -> float:
        return self.supervised / max(self.tokens, 1)

    @property
    def utilisation_longest(self) -> float:
        """Real tokens over the slots of batches padded to their longest sample."""
        return self.tokens / max(self.padded_to_longest, 1)

    @property
    def utilisation_padding_free(self) -> float:
        """Real tokens over the slots of padding-free batches."""
        return self.tokens / max(self.padding_free, 1)

    @property
    def utilisation_cutoff(self) -> float:
        """Real tokens over the slots of batches padded to cutoff_len."""
        return self.tokens / max(self.count * self.cutoff_len, 1)

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "supervised_share": self.supervised_share,
                "utilisation_longest": self.utilisation_longest,
                "utilisation_padding_free": self.utilisation_padding_free, "utilisation_cutoff": self.utilisation_cutoff}


def padded_slots(lengths: Sequence[int], batch_size: int) -> int:
    """Token slots of consecutive batches of `batch_size` (the last may be short), each padded to its longest."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = 0
    for start in range(0, len(lengths), batch_size):
        chunk = lengths[start : start + batch_size]
        total += int(chunk.max()) * len(chunk)
    return total


def padding_free_slots(lengths: Sequence[int], batch_size: int) -> int:
    """Token slots of consecutive batches of `batch_size`, each laid out padding-free (rows of its longest)."""
    lengths = [int(n) for n in lengths]
    total = 0
    for start in range(0, len(lengths), batch_size):
        chunk = lengths[start : start + batch_size]
        total += max(chunk) * len(padding_free_layout(chunk))
    return total


def length_stats(
    lengths: Sequence[int], supervised: Sequence[int], cutoff_len: int, batch_size: int
) -> LengthStats:
    """Statistics of samples in the order given (batches are consecutive runs of batch_size)."""
    values = np.asarray(lengths, dtype=np.int64)
    if len(values) == 0:
        raise ValueError("length_stats: no samples")
    return LengthStats(
        count=len(values), min=int(values.min()), max=int(values.max()), mean=float(values.mean()),
        median=float(np.median(values)), p95=float(np.percentile(values, 95)), tokens=int(values.sum()),
        supervised=int(np.sum(supervised)), cutoff_len=cutoff_len, batch_size=batch_size,
        padded_to_longest=padded_slots(values, batch_size), padding_free=padding_free_slots(values, batch_size),
    )


def histogram(lengths: Sequence[int], bins: int = HISTOGRAM_BINS) -> list[tuple[int, int, int]]:
    """(first length, last length, samples) of equal-width integer bins from the shortest to the longest."""
    values = np.asarray(lengths, dtype=np.int64)
    low, high = int(values.min()), int(values.max())
    width = max(1, math.ceil((high - low + 1) / bins))
    counts = np.bincount((values - low) // width)
    return [(low + k * width, low + (k + 1) * width - 1, int(n)) for k, n in enumerate(counts)]


def histogram_lines(hist: list[tuple[int, int, int]], width: int = BAR_WIDTH) -> list[str]:
    total = sum(n for _, _, n in hist)
    peak = max(n for _, _, n in hist)
    digits = len(str(hist[-1][1]))
    lines = []
    for first, last, n in hist:
        span = f"{first:>{digits}}" if first == last else f"{first:>{digits}}-{last:<{digits}}"
        bar = "█" * round(width * n / peak) if peak else ""
        lines.append(f"  {span:>{2 * digits + 1}} {bar:<{width}} {n:>6} {100 * n / total:5.1f}%")
    return lines


def save_histogram(lengths: Sequence[int], cutoff_len: int, path: Path, title: str) -> Path:
    import matplotlib  # lazy: matplotlib (5.8 s) only for the histogram file; verify / coverage import stats.py too

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: as matplotlib above, once its backend is chosen

    hist = histogram(lengths)
    edges = [first for first, _, _ in hist] + [hist[-1][1] + 1]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(np.asarray(lengths), bins=edges, color="#4c72b0", edgecolor="white")
    ax.axvline(cutoff_len, color="#c44e52", linestyle="--", label=f"cutoff_len {cutoff_len}")
    ax.set_xlabel("sample length (tokens)")
    ax.set_ylabel("samples")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _num(value: float) -> str:
    return f"{value:.2f}".rstrip("0").rstrip(".")


def source_line(source: dict[str, Any]) -> str:
    """One conversation source's row counts: read, empty answers, reasoning, identical pairs, skipped per reason."""
    parts = [
        f"{source['rows']} read", f"{source['empty_answers']} with an empty answer (trains the end-of-turn)",
        f"{source['rows_with_reasoning']} with reasoning",
    ]
    if "dropped_identical_pairs" in source:
        parts.append(f"{source['dropped_identical_pairs']} pairs dropped with identical answers")
    if "skipped_bad_rows" in source:
        reasons = ", ".join(f"{count} {reason}" for reason, count in source["skipped_by_reason"].items())
        parts.append(f"{source['skipped_bad_rows']} skipped (skip_bad_rows{': ' + reasons if reasons else ''})")
    return f"rows ({source['name']}): {', '.join(parts)}"


def pipeline_lines(report: dict[str, Any], data: DataArguments, row: Stage) -> list[str]:
    """What the pipeline dropped or cut, and why, from its report (`row`: the stage's, whose data it read)."""
    lines = []
    if row.reads == "text":
        for source in report.get("sources", []):
            lines.append(
                f"documents ({source['name']}): {source['documents']} read, {source['kept']} kept; dropped "
                f"{source['dropped_empty']} empty, {source['dropped_short']} shorter than min_length {data.min_length}"
            )
        train = report["train"]
        tail = "kept" if train["tail"] == "keep" else f"dropped ({train['dropped_tail_tokens']} tokens)"
        lines.append(
            f"windows: {train['windows']} of cutoff_len {train['window']}, stride {train['stride']} "
            f"({train['full_windows']} full; tail of {train['tail_tokens']} tokens {tail}); nothing is truncated"
        )
        return lines
    for source in report.get("sources", []):
        lines.append(source_line(source))
    if "dedup" in report:
        dedup = report["dedup"]
        threshold = f", threshold {dedup['threshold']}" if dedup.get("threshold") is not None else ""
        lines.append(
            f"dedup ({dedup['mode']}{threshold}): removed {dedup['exact']} exact, {dedup['near']} near duplicates "
            f"of {dedup['rows']} training rows"
        )
    train = report["train"]
    rows = train.get("rows_shortened", train["truncated"])
    lines.append(
        f"encoding: {rows} rows shortened to fit cutoff_len {data.cutoff_len}{as_examples(rows, train['truncated'])} "
        f"(earliest turns dropped first; {train.get('answers_dropped', 0)} trained answers lost), "
        f"{train['dropped_no_supervised']} dropped with no supervised token left"
    )
    if train.get("expanded_conversations"):
        seams = train.get("split_at_seams", 0)
        why = f" ({seams} because a seam tokenises differently in a later prompt)" if seams else ""
        lines.append(f"encoding: {train['expanded_conversations']} conversations encoded as one example per answer{why}")
    return lines


def stats_report(data: RunData, out_dir: Path | None) -> list[str]:
    """The `tunelab data stats` output; writes length_histogram.png and stats.json into out_dir (None: the report
    alone, saying how to get the files)."""
    config = data.config
    args = config.training
    cutoff = config.data.cutoff_len
    batch_size = args.per_device_train_batch_size
    strategy = str(getattr(args, "train_sampling_strategy", "random"))
    per_row, supervised_per_row = sequence_arrays(data.train, data.sides)
    order = batch_order(per_row.shape[1], strategy, args.seed)
    lengths = in_batches(per_row, order, batch_size)  # every sequence, in the order batches hold them
    per_batch = batch_size * len(per_row)
    stats = length_stats(lengths, in_batches(supervised_per_row, order, batch_size), cutoff, per_batch)
    order_text = "in stored order" if strategy == "sequential" else f"shuffled, seed {args.seed}"

    stage = config.finetuning.stage
    reads = stage_row(stage).reads
    title = f"stage {stage}" + ("" if reads == "text" else f", template {config.data.template}")
    what = "sample" if data.sides is None else "sequence"
    if data.sides is None:
        count, batches = f"{stats.count} samples", f"batches of {batch_size}"
    else:
        unit = "examples" if reads == "unpaired" else "pairs"  # kto: each example with its KL example
        count = f"{len(data.train)} {unit}, {stats.count} sequences"
        batches = f"batches of {batch_size} {unit} ({per_batch} sequences)"
    lines = [
        f"train: {count} ({title}, cutoff_len {cutoff})",
        f"length (tokens): min {stats.min}, max {stats.max}, mean {_num(stats.mean)}, median {_num(stats.median)}, "
        f"p95 {_num(stats.p95)}",
        f"supervised tokens: {stats.supervised} of {stats.tokens} ({100 * stats.supervised_share:.1f}%) reach the loss",
        f"token utilisation: {100 * stats.utilisation_longest:.1f}% in {batches} padded to their longest, "
        f"{100 * stats.utilisation_padding_free:.1f}% padding-free ({order_text}); "
        f"{100 * stats.utilisation_cutoff:.1f}% if padded to cutoff_len {cutoff}",
    ]
    result: dict[str, Any] = {"train": stats.as_dict()}
    if "train" in data.packed:
        packed = data.packed["train"]
        row_lengths = token_lengths(packed.rows)
        row_order = batch_order(len(row_lengths), strategy, args.seed)
        slots = padded_slots(row_lengths[row_order], batch_size)
        lines.append(
            f"packing: {packed.stats.samples} samples into {packed.stats.rows} rows of {cutoff}: efficiency "
            f"{100 * packed.stats.efficiency:.1f}%; {100 * packed.stats.tokens / max(slots, 1):.1f}% in batches of "
            f"{batch_size} rows padded to their longest"
        )
        result["packing"] = packed.stats.as_dict()
    if data.vision is not None:
        image_lines, result["images"] = image_stats(data.train, data.vision[0])
        lines += image_lines
    lines += pipeline_lines(data.report, config.data, stage_row(config.finetuning.stage))
    for name, dataset in data.evals.items():
        eval_lengths = sequence_arrays(dataset, data.sides)[0].reshape(-1)
        lines.append(
            f"eval:{name}: {len(eval_lengths)} {what}s, length {int(eval_lengths.min())}-{int(eval_lengths.max())}, "
            f"mean {_num(float(eval_lengths.mean()))}"
        )
    hist = histogram(lengths)
    lines.append(f"length histogram (tokens, {what}s):")
    lines += histogram_lines(hist)

    if out_dir is None:
        lines.append("length_histogram.png and stats.json not written: no output_dir or --out given; add "
                     "--out FOLDER (or output_dir=...) to write them")
        return lines
    png = save_histogram(lengths, cutoff, out_dir / "length_histogram.png", f"train {what} lengths ({stats.count})")
    result.update(histogram=[list(h) for h in hist], pipeline=data.report)
    (out_dir / "stats.json").write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")
    lines.append(f"wrote {png} and {out_dir / 'stats.json'}")
    return lines


def image_stats(dataset: datasets.Dataset, processor: Any) -> tuple[list[str], dict[str, Any]]:
    """Images per sample, image tokens per sample and their share of the sequence (vision runs)."""

    table = dataset.select_columns(["input_ids", "images"]).with_format("arrow")[:]
    per_sample = pc.list_value_length(table["images"]).to_numpy(zero_copy_only=False)
    lengths, ids = flat_column(dataset, "input_ids")
    owners = np.repeat(np.arange(len(lengths)), lengths)
    is_image = np.isin(ids, np.array(sorted(image_token_ids(processor)), dtype=ids.dtype))
    tokens = np.bincount(owners[is_image], minlength=len(per_sample))
    share = tokens / np.maximum(lengths, 1)
    with_images = per_sample > 0
    stats = {
        "images": int(per_sample.sum()), "samples_with_images": int(with_images.sum()), "samples": len(per_sample),
        "images_per_sample_max": int(per_sample.max(initial=0)), "image_tokens": int(tokens.sum()),
        "image_tokens_per_image_sample_mean": float(tokens[with_images].mean()) if with_images.any() else 0.0,
        "image_token_share": float(tokens.sum() / max(int(lengths.sum()), 1)),
        "image_token_share_per_image_sample_mean": float(share[with_images].mean()) if with_images.any() else 0.0,
    }
    lines = [
        f"images: {stats['images']} in {stats['samples_with_images']} of {stats['samples']} samples "
        f"(0-{stats['images_per_sample_max']} per sample)",
        f"image tokens: {stats['image_tokens']} ({100 * stats['image_token_share']:.1f}% of all tokens); per sample "
        f"with images: mean {_num(stats['image_tokens_per_image_sample_mean'])} tokens, "
        f"{100 * stats['image_token_share_per_image_sample_mean']:.1f}% of its sequence",
    ]
    return lines, stats


def default_stats_dir(output_dir: str | None) -> Path | None:
    """output_dir/data_stats, or None without an output_dir. A subfolder the output_dir check ignores, so training
    into output_dir still works afterwards."""
    return Path(output_dir) / DATA_STATS_DIR if output_dir else None
