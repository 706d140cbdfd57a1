"""`tunelab data stats|verify|coverage`: a run's data, measured and checked before any training.

This module owns the three inspections. Each reads exactly the datasets the stage's trainer would
get (data/pipeline.py for sft, data/pretrain.py for pt, data/pairwise.py's pairs for rm/dpo/kto;
packed with data/packing.py when packing is on) and loads the tokenizer only, never model weights.
A pair row holds two sequences (`RunData.sides`: chosen_/rejected_, kto: the example and its KL
example); stats, verify and coverage count sequences, batched as PairedCollator batches them.

- stats: sample lengths (count, min/max/mean/median/p95; percentiles interpolate linearly between
  order statistics, numpy's default), the share of real tokens when batches are padded to their
  longest sample or to cutoff_len, the supervised-token share, a length histogram (text bars and a
  PNG), what the pipeline truncated or dropped and why, and packing efficiency.
- verify: batches drawn through the stage's own collator, each checked by `verify_batch`, a pure
  function of one batch that returns the first problem as one line (or None).
- coverage: the UNK rate, ids outside the model's vocab_size (config.json), and the characters the
  tokenizer can only spell as several byte pieces.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import datasets
import numpy as np
import pyarrow.compute as pc
import torch

from tunelab.config.args import RunConfig
from tunelab.config.checks import PREFERENCE_STAGES
from tunelab.run_folder import DATA_STATS_DIR
from tunelab.data.collate import (
    PackedCollator,
    PaddingFreeCollator,
    PairedCollator,
    SupervisedCollator,
    block_causal_mask,
    build_collator,
    padding_free_layout,
)
from tunelab.data.encode import IGNORE_INDEX
from tunelab.data.packing import PackingStats, pack_dataset, pack_lengths
from tunelab.data.pairwise import pair_sides
from tunelab.errors import ModelError

HISTOGRAM_BINS = 12
BAR_WIDTH = 40
TOP_CHARACTERS = 20
_BYTE_PIECE = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")  # SentencePiece byte-fallback tokens


# --------------------------------------------------------------------------------------------------
# The run's data, as the trainer would get it


@dataclass
class RunData:
    """Encoded samples of a run (before packing), the packed rows when packing, and the pipeline report."""

    config: RunConfig
    tokenizer: Any
    train: datasets.Dataset
    evals: dict[str, datasets.Dataset]
    report: dict[str, Any]
    packed: dict[str, "PackedRows"] = field(default_factory=dict)  # split name -> rows, when packing
    sides: tuple[str, str] | None = None  # pair stages: the column prefixes of each row's two sequences
    vision: tuple[Any, Any] | None = None  # a vision-language model's (processor, ImageSettings) (data/vision.py)

    @property
    def splits(self) -> dict[str, datasets.Dataset]:
        return {"train": self.train, **{f"eval:{name}": ds for name, ds in self.evals.items()}}


@dataclass
class PackedRows:
    rows: datasets.Dataset
    stats: PackingStats
    sample_lengths: list[list[int]]  # per row: the lengths of the samples it holds, in order


def load_run_data(config: RunConfig) -> RunData:
    from tunelab.model.tokenizer import load_tokenizer  # noqa: PLC0415

    stage = config.finetuning.stage
    tokenizer = load_tokenizer(config.model)
    seed = config.training.seed
    if stage == "pt":
        from tunelab.data.pretrain import build_pretrain_datasets  # noqa: PLC0415

        bundle = build_pretrain_datasets(config.data, tokenizer, seed=seed)
        return RunData(config, tokenizer, bundle.train, bundle.eval, bundle.report)
    from tunelab.data.pipeline import build_datasets  # noqa: PLC0415
    from tunelab.data.templates import get_template  # noqa: PLC0415

    from tunelab.data.vision import vision_inputs  # noqa: PLC0415
    from tunelab.model.tokenizer import load_processor  # noqa: PLC0415

    template = get_template(config.data.template, tokenizer)
    vision = vision_inputs(load_processor(config.model), config.model)
    if stage in PREFERENCE_STAGES:
        from tunelab.data.pairwise import preference_encoder  # noqa: PLC0415

        encoder = preference_encoder(stage, tokenizer, template, config.data, vision)
        bundle = build_datasets(config.data, tokenizer, template, seed=seed, encoder=encoder, images=vision is not None)
        # (stats / verify read the pairs' text; the images of pairs are checked by training's own collator)
        return RunData(config, tokenizer, bundle.train, bundle.eval, bundle.report, sides=pair_sides(stage))
    # Packed here, not in the pipeline, to keep each row's sample lengths (the rows are the same).
    unpacked = dataclasses.replace(config.data, packing=False)
    bundle = build_datasets(unpacked, tokenizer, template, seed=seed, vision=vision)
    data = RunData(config, tokenizer, bundle.train, bundle.eval, bundle.report, vision=vision)
    if config.data.packing:
        data.packed = {name: pack_rows(ds, config.data.cutoff_len) for name, ds in data.splits.items()}
        data.report["packing"] = {name: packed.stats.as_dict() for name, packed in data.packed.items()}
    return data


def pack_rows(samples: datasets.Dataset, cutoff_len: int) -> PackedRows:
    """pack_dataset's rows, with the sample lengths of each row (pack_lengths places them the same way)."""
    rows, stats = pack_dataset(samples, cutoff_len)
    lengths = token_lengths(samples).tolist()
    bins = pack_lengths(lengths, cutoff_len)
    return PackedRows(rows, stats, [[lengths[i] for i in b] for b in bins])


def stage_collator(
    config: RunConfig, tokenizer
) -> SupervisedCollator | PackedCollator | PaddingFreeCollator | PairedCollator:
    """The collator the stage's trainer uses (build_collator / build_paired_collator in train/stages), chosen
    without loading weights."""
    pad = tokenizer.pad_token_id
    stage = config.finetuning.stage
    if stage == "rm":  # rewards are read at each padded row's end
        return PairedCollator(pad)
    collator = _example_collator(config, pad)
    if stage in PREFERENCE_STAGES:  # dpo, kto: the pairs' sequences laid out as examples are (never packed)
        return PairedCollator(
            pad, *pair_sides(stage), padding_free=collator if isinstance(collator, PaddingFreeCollator) else None
        )
    return collator


def _example_collator(config: RunConfig, pad: int) -> SupervisedCollator | PackedCollator | PaddingFreeCollator:
    packing, padding_free = config.data.packing, config.data.padding_free
    if not packing and padding_free is False:
        return SupervisedCollator(pad)
    if config.model.flash_attn == "fa2" and not config.model.trust_remote_code:
        # What for_model picks for flash attention (the skeleton would need flash-attn installed).
        return PackedCollator(pad, "varlen") if packing else PaddingFreeCollator(PackedCollator(pad, "varlen"))
    return build_collator(_model_skeleton(config), pad, packing, padding_free)


def _model_skeleton(config: RunConfig) -> torch.nn.Module:
    """The model class, attention backend and dtype training would get, on the meta device (no weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText  # noqa: PLC0415

    from tunelab.model.vision import is_vision_model_folder  # noqa: PLC0415

    from tunelab.model.resolve import ATTN_IMPLEMENTATIONS, resolve_dtype  # noqa: PLC0415

    path = config.model.model_name_or_path
    kwargs: dict[str, Any] = {"dtype": resolve_dtype(config.model, config.training, config.finetuning),
                              "trust_remote_code": config.model.trust_remote_code}
    attn = ATTN_IMPLEMENTATIONS[config.model.flash_attn]
    if attn is not None:
        kwargs["attn_implementation"] = attn
    try:
        model_config = AutoConfig.from_pretrained(path, trust_remote_code=config.model.trust_remote_code)
        model_config.use_cache = False  # as load_model sets it for training
        model_config.get_text_config().use_cache = False
        auto_class = AutoModelForImageTextToText if is_vision_model_folder(path) else AutoModelForCausalLM
        with torch.device("meta"):
            return auto_class.from_config(model_config, **kwargs)
    except Exception as exc:  # noqa: BLE001  (unknown architecture, unreadable config.json, ...)
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"model_name_or_path: cannot build the model class from {path}/config.json: {message}") from exc


def model_vocab_size(model_dir: str | Path) -> int | None:
    """vocab_size from config.json (or its text_config), without loading the model."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return int(size) if size else None


# --------------------------------------------------------------------------------------------------
# Columns as numpy


def _flat_column(dataset: datasets.Dataset, column: str) -> tuple[np.ndarray, np.ndarray]:
    """(per-row lengths, all values flattened) of a list column, without a Python loop over rows."""
    values = dataset.select_columns([column]).with_format("arrow")[:].column(column)
    lengths = pc.list_value_length(values).to_numpy().astype(np.int64)
    return lengths, pc.list_flatten(values).to_numpy().astype(np.int64)


def token_lengths(dataset: datasets.Dataset, column: str = "input_ids") -> np.ndarray:
    return _flat_column(dataset, column)[0]


def supervised_counts(dataset: datasets.Dataset, column: str = "labels") -> np.ndarray:
    """Per sample, the positions that reach the loss: labels != -100, the first position excluded (the loss shifts)."""
    lengths, labels = _flat_column(dataset, column)
    supervised = labels != IGNORE_INDEX
    starts = np.cumsum(lengths) - lengths
    supervised[starts[lengths > 0]] = False
    counts = np.zeros(len(lengths), dtype=np.int64)
    nonempty = lengths > 0
    if nonempty.any():
        counts[nonempty] = np.add.reduceat(supervised.astype(np.int64), starts[nonempty])
    return counts


def sequence_arrays(dataset: datasets.Dataset, sides: tuple[str, str] | None) -> tuple[np.ndarray, np.ndarray]:
    """(token lengths, supervised counts) of the sequences of each row, shape (1, rows) for plain samples
    and (2, rows) for pairs (row 0 the first side, row 1 the second)."""
    prefixes = sides or ("",)
    lengths = np.stack([token_lengths(dataset, f"{p}input_ids") for p in prefixes])
    supervised = np.stack([supervised_counts(dataset, f"{p}labels") for p in prefixes])
    return lengths, supervised


def in_batches(values: np.ndarray, order: np.ndarray, batch_size: int) -> np.ndarray:
    """Per-sequence values (sequence_arrays' shape) in the order batches hold them: batch after batch of
    `batch_size` rows of `order`, each batch's first sides, then its second sides (PairedCollator)."""
    return np.concatenate([values[:, order[s : s + batch_size]].reshape(-1) for s in range(0, len(order), batch_size)])


# --------------------------------------------------------------------------------------------------
# stats


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


def batch_order(count: int, strategy: str, seed: int) -> np.ndarray:
    """Sample order of an epoch: as stored for a sequential sampler, else a seeded shuffle (like the
    Trainer's random sampler: the same statistics, not its exact order)."""
    if strategy == "sequential":
        return np.arange(count)
    return np.random.default_rng(seed).permutation(count)


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
    import matplotlib  # noqa: PLC0415 - plotting only when asked

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

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


def pipeline_lines(report: dict[str, Any], config: RunConfig) -> list[str]:
    """What the pipeline dropped or cut, and why, from its report."""
    data = config.data
    lines = []
    if config.finetuning.stage == "pt":
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
    lines.append(
        f"encoding: {train['truncated']} shortened to fit cutoff_len {data.cutoff_len} (earliest turns dropped "
        f"first; {train.get('answers_dropped', 0)} trained answers lost), {train['dropped_no_supervised']} dropped "
        "with no supervised token left"
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
    title = f"stage {stage}" + ("" if stage == "pt" else f", template {config.data.template}")
    what = "sample" if data.sides is None else "sequence"
    if data.sides is None:
        count, batches = f"{stats.count} samples", f"batches of {batch_size}"
    else:
        unit = "examples" if stage == "kto" else "pairs"  # kto: each example with its KL example
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
    lines += pipeline_lines(data.report, config)
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
    from tunelab.data.vision import image_token_ids  # noqa: PLC0415

    table = dataset.select_columns(["input_ids", "images"]).with_format("arrow")[:]
    per_sample = pc.list_value_length(table["images"]).to_numpy(zero_copy_only=False)
    lengths, ids = _flat_column(dataset, "input_ids")
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


def verify_images(data: RunData, max_rows: int) -> tuple[str | None, list[str]]:
    """Every placeholder got its image: in each sample, the image tokens are exactly those of its images' expansions
    (asked of the processor again, independently of encoding), and none of them is supervised."""
    from tunelab.data.vision import expansions, image_token_ids, prepare_images  # noqa: PLC0415

    processor, settings = data.vision
    mm = image_token_ids(processor)
    checked = images = 0
    for name, samples in data.splits.items():
        for index in range(min(len(samples), max_rows)):
            sample = samples[index]
            texts = expansions(processor, prepare_images(sample["images"], settings))
            wanted = sum(sum(i in mm for i in ids) for ids in
                         (data.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []))
            have = sum(i in mm for i in sample["input_ids"])
            if have != wanted:
                return (f"{name} sample {index}: {have} image tokens for its {len(sample['images'])} images, whose "
                        f"expansions hold {wanted}: a placeholder without its image (or the reverse)"), []
            if any(label != -100 for token, label in zip(sample["input_ids"], sample["labels"]) if token in mm):
                return f"{name} sample {index}: an image token is supervised", []
            checked, images = checked + 1, images + len(sample["images"])
    return None, [f"images: {images} images in {checked} samples: each placeholder holds exactly its image's tokens "
                  "(the processor's expansion), none supervised"]


def default_stats_dir(config: RunConfig) -> Path | None:
    """output_dir/data_stats, or None without an output_dir. A subfolder the output_dir check ignores, so training
    into output_dir still works afterwards."""
    return Path(config.training.output_dir) / DATA_STATS_DIR if config.training.output_dir else None


# --------------------------------------------------------------------------------------------------
# verify


def verify_batch(
    batch: dict[str, Any],
    *,
    pad_token_id: int,
    sample_lengths: Sequence[Sequence[int]] | None = None,
    vocab_size: int | None = None,
    batch_index: int = 0,
    sequence_lengths: Sequence[int] | None = None,
) -> str | None:
    """The first problem of one collated batch, as one line, or None.

    sample_lengths: per batch row, the lengths of the samples it holds in order (one per row unless
    packed; a flattened varlen batch is one row). Without it, lengths are read from the
    attention_mask (padded batches) or from restarts of position_ids (packed: then padding counts
    as a sample). Packed batches are recognised by their position_ids. sequence_lengths: for padding-free
    pair batches, the length of sequence j (sequence_ids must name each sample's sequence, -1 on padding).
    """
    where = f"batch {batch_index}"
    for key in ("input_ids", "labels"):
        if key not in batch:
            return f"{where}: no {key} in the batch (keys: {', '.join(batch)})"
    ids, labels = batch["input_ids"], batch["labels"]
    packed = "position_ids" in batch
    mask = batch.get("attention_mask")
    if ids.dim() != 2:
        return f"{where}: input_ids has shape {tuple(ids.shape)}; expected (batch, length)"
    if not packed and mask is None:
        return f"{where}: no attention_mask in a padded batch"
    if packed and mask is not None and mask.dim() == 2:
        return f"{where}: a 2-D attention_mask beside packed position_ids lets samples attend to each other; leave it out"
    two_d = ["labels", "position_ids"] if packed else ["labels", "attention_mask"]
    if "sequence_ids" in batch:
        two_d.append("sequence_ids")
    for key in ["input_ids", *two_d]:
        if batch[key].shape != ids.shape:
            return f"{where}: {key} has shape {tuple(batch[key].shape)}, input_ids {tuple(ids.shape)}; they must match"
        if batch[key].dtype != torch.long:
            return f"{where}: {key} has dtype {batch[key].dtype}, expected torch.int64"
    rows, length = ids.shape
    if sample_lengths is not None and len(sample_lengths) != rows:
        return f"{where}: {len(sample_lengths)} rows of sample lengths for {rows} batch rows"

    for row in range(rows):
        given = list(sample_lengths[row]) if sample_lengths is not None else None
        problem = _verify_row(batch, row, given, pad_token_id, vocab_size, packed)
        if problem:
            return f"{where}, sample {row}{problem}"

    if "sequence_ids" in batch:
        problem = _verify_sequence_ids(batch["sequence_ids"], sample_lengths, sequence_lengths)
        if problem:
            return f"{where}{problem}"
    if packed and mask is not None:  # block_mask path: the 4-D mask must be exactly the block-causal one
        if mask.dim() != 4 or tuple(mask.shape) != (rows, 1, length, length) or not mask.is_floating_point():
            return (f"{where}: attention_mask beside position_ids must be a float (batch, 1, L, L) block mask, "
                    f"got {tuple(mask.shape)} {mask.dtype}")
        expected = block_causal_mask(batch["position_ids"], mask.dtype)
        for row in range(rows):
            if not torch.equal(mask[row], expected[row]):
                return f"{where}, sample {row}: the 4-D attention_mask is not the block-causal mask of its position_ids"
    if "cu_seq_lens_q" in batch:  # varlen path: one flattened row, sample boundaries passed explicitly
        if rows != 1:
            return f"{where}: cu_seq_lens_q needs one flattened row, the batch has {rows}"
        if sample_lengths is not None:
            starts = np.cumsum([0, *sample_lengths[0]])
        else:
            starts = np.append(torch.nonzero(batch["position_ids"][0] == 0).flatten().numpy(), length)
        for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
            got = batch.get(key)
            if got is None or got.tolist() != starts.tolist():
                shown = None if got is None else got.tolist()
                return f"{where}: {key} is {shown}, expected the sample boundaries {starts.tolist()}"
        longest = int(np.diff(starts).max())
        for key in ("max_length_q", "max_length_k"):
            if batch.get(key) != longest:
                return f"{where}: {key} is {batch.get(key)}, expected the longest sample, {longest}"
    return None


def _verify_sequence_ids(
    owners: torch.Tensor, sample_lengths: Sequence[Sequence[int]] | None, sequence_lengths: Sequence[int] | None
) -> str | None:
    """sequence_ids of a padding-free pair batch: one id per sample, each sequence exactly once and as long as
    it is, -1 on padding; as ', sample r: ...' (or ': ...'), or None."""
    if sample_lengths is None or sequence_lengths is None:
        return ": sequence_ids cannot be checked without the batch's sample and sequence lengths"
    seen: list[int] = []
    for row, given in enumerate(sample_lengths):
        values = owners[row].tolist()
        start = 0
        for n in given:
            ids = set(values[start : start + n])
            if len(ids) != 1:
                return f", sample {row}, position {start}: sequence_ids {sorted(ids)} within one sequence, expected one id"
            (owner,) = ids
            if not 0 <= owner < len(sequence_lengths) or sequence_lengths[owner] != n:
                expected = sequence_lengths[owner] if 0 <= owner < len(sequence_lengths) else "no sequence"
                return f", sample {row}, position {start}: sequence_ids {owner} on {n} tokens, but that sequence has {expected}"
            seen.append(owner)
            start += n
        if any(v != -1 for v in values[start:]):
            return f", sample {row}, position {start}: sequence_ids on padding must be -1, got {values[start:]}"
    if sorted(seen) != list(range(len(sequence_lengths))):
        return f": sequence_ids cover {sorted(seen)}, expected each of 0..{len(sequence_lengths) - 1} once"
    return None


def _verify_row(
    batch: dict[str, Any], row: int, given: list[int] | None, pad_token_id: int, vocab_size: int | None, packed: bool
) -> str | None:
    """Problems of one batch row, as ', position t: ...' (or ': ...'), or None."""
    ids = batch["input_ids"][row].tolist()
    labels = batch["labels"][row].tolist()
    length = len(ids)
    if packed:
        positions = batch["position_ids"][row].tolist()
        if given is None:  # every restart is a sample start (padding is a sample of its own)
            given = restart_lengths(positions)
    else:
        mask = batch["attention_mask"][row].tolist()
        if given is None:
            given = [int(sum(mask))]
    real = sum(given)
    if real > length:
        return f": its samples hold {real} tokens but the batch is {length} long"

    if packed:
        expected = [k for n in given for k in range(n)] + list(range(length - real))
        starts = set(np.cumsum([0, *given[:-1]]).tolist()) if given else set()
        sample_of = np.repeat(np.arange(len(given)), given).tolist()
        for t, (got, want) in enumerate(zip(positions, expected)):
            if got == want:
                continue
            if t >= real:
                return f", position {t}: position_id {got} on padding, expected {want} (padding is a sample of its own)"
            if want == 0:
                return (f", position {t}: position_id {got} at the start of packed sample {sample_of[t]}, expected 0 "
                        "(position ids restart at every sample start)")
            return f", position {t}: position_id {got} inside packed sample {sample_of[t]}, expected {want}"
        for t in sorted(starts):
            if t < real and labels[t] != IGNORE_INDEX:
                return (f", position {t}: label {labels[t]} at the start of packed sample {sample_of[t]}, expected -100 "
                        "(the sample before must not predict it)")
    else:
        for t, value in enumerate(mask):
            if t < real and value != 1:
                return f", position {t}: attention_mask is {value} on a real token, expected 1"
            if t >= real and value != 0:
                return f", position {t}: attention_mask is {value} on padding, expected 0"
    for t in range(real, length):
        if ids[t] != pad_token_id:
            return f", position {t}: input_id {ids[t]} on padding, expected the pad id {pad_token_id}"
        if labels[t] != IGNORE_INDEX:
            return f", position {t}: label {labels[t]} on padding, expected -100"
    for t in range(real):
        if ids[t] < 0 or (vocab_size is not None and ids[t] >= vocab_size):
            return f", position {t}: input_id {ids[t]} is outside the model's vocabulary (vocab_size {vocab_size})"
    for t in range(1, length):  # position 0 never reaches the loss: nothing precedes it
        if labels[t] != IGNORE_INDEX and labels[t] != ids[t]:
            hint = ""
            if t + 1 < length and labels[t] == ids[t + 1]:
                hint = "; it equals the next input_id: were the labels shifted already?"
            return (f", position {t}: label {labels[t]} != input_id {ids[t]}; labels must equal input_ids where "
                    f"supervised (the loss shifts them){hint}")
    return None


@dataclass
class VerifyCounts:
    batches: int = 0
    rows: int = 0
    samples: int = 0
    tokens: int = 0
    padding: int = 0
    supervised: int = 0
    batch_rows: int = 0
    shape: tuple[int, ...] | None = None
    keys: tuple[str, ...] = ()


def restart_lengths(position_ids: Sequence[int]) -> list[int]:
    """Lengths of the samples of a packed row: each starts where its position ids restart at 0."""
    starts = [t for t, p in enumerate(position_ids) if p == 0] or [0]
    return [b - a for a, b in zip(starts, [*starts[1:], len(position_ids)])]


def verify_split(
    name: str,
    dataset: datasets.Dataset,
    collator,
    batch_size: int,
    order: np.ndarray,
    *,
    pad_token_id: int,
    vocab_size: int | None,
    max_batches: int,
    lengths_per_row: list[list[int]] | None = None,
) -> tuple[str | None, VerifyCounts]:
    """Collate batches of `dataset` in `order` and verify each; the first problem (prefixed by name) stops."""
    counts = VerifyCounts()
    columns = list(dataset.column_names)
    flattened = getattr(collator, "attention", None) == "varlen"
    for number, start in enumerate(range(0, len(order), batch_size)):
        if max_batches and number >= max_batches:
            break
        index = [int(i) for i in order[start : start + batch_size]]
        block = dataset[index]
        rows = [dict(zip(columns, values)) for values in zip(*(block[c] for c in columns))]
        batch = collator(rows)
        sequence_lengths = None  # pairs: the length of each sequence, by its index in the batch
        if isinstance(collator, PairedCollator):
            sequence_lengths = [len(r[f"{side}input_ids"]) for side in collator.sides for r in rows]
            if collator.padding_free is not None:
                lengths = [[sequence_lengths[i] for i in row] for row in padding_free_layout(sequence_lengths)]
            else:
                lengths = [[n] for n in sequence_lengths]
        elif lengths_per_row is not None:
            lengths = [lengths_per_row[i] for i in index]
        elif isinstance(collator, PaddingFreeCollator):
            layout = padding_free_layout([len(r["input_ids"]) for r in rows])
            lengths = [[len(rows[i]["input_ids"]) for i in row] for row in layout]
        elif isinstance(collator, PackedCollator):  # rows packed upstream (pt): samples end where positions restart
            lengths = [restart_lengths(r["position_ids"]) for r in rows]
        else:
            lengths = [[len(r["input_ids"])] for r in rows]
        if flattened:
            lengths = [[n for row in lengths for n in row]]
        problem = verify_batch(
            batch, pad_token_id=pad_token_id, sample_lengths=lengths, vocab_size=vocab_size, batch_index=number,
            sequence_lengths=sequence_lengths,
        )
        if problem:
            return f"{name}: {problem}", counts
        real = sum(n for row in lengths for n in row)
        counts.batches += 1
        counts.rows += len(rows)
        counts.batch_rows += batch["input_ids"].shape[0]
        counts.samples += sum(len(row) for row in lengths)
        counts.tokens += real
        counts.padding += batch["input_ids"].numel() - real
        counts.supervised += int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
        counts.shape = tuple(batch["input_ids"].shape) if counts.shape is None else counts.shape
        counts.keys = tuple(k for k in batch if torch.is_tensor(batch[k]))
    return None, counts


def verify_report(data: RunData, max_batches: int) -> tuple[str | None, list[str]]:
    """(first problem or None, summary lines) of `tunelab data verify`."""
    config, tokenizer = data.config, data.tokenizer
    args = config.training
    collator = stage_collator(config, tokenizer)
    vocab_size = model_vocab_size(config.model.model_name_or_path)
    strategy = str(getattr(args, "train_sampling_strategy", "random"))
    attention = getattr(collator, "attention", None)  # None: padded with an attention mask
    layout = "packed" if isinstance(collator, PackedCollator) else "padding-free"
    kind = type(collator).__name__ + (f" ({attention})" if attention else "")
    lines = []
    for name, samples in data.splits.items():
        batch_size = args.per_device_train_batch_size if name == "train" else args.per_device_eval_batch_size
        packed = data.packed.get(name)
        dataset = packed.rows if packed else samples
        # Training draws shuffled batches; evaluation goes in order.
        order = batch_order(len(dataset), strategy, args.seed) if name == "train" else np.arange(len(dataset))
        problem, counts = verify_split(
            name, dataset, collator, batch_size, order, pad_token_id=tokenizer.pad_token_id, vocab_size=vocab_size,
            max_batches=max_batches, lengths_per_row=packed.sample_lengths if packed else None,
        )
        if problem:
            return problem, lines
        if isinstance(collator, PackedCollator):
            unit = f"{counts.rows} packed rows"
        elif isinstance(collator, PairedCollator):
            unit = f"{counts.rows} {'examples' if config.finetuning.stage == 'kto' else 'pairs'} ({counts.samples} sequences)"
        else:
            unit = f"{counts.rows} samples"
        of = "" if counts.rows == len(dataset) else f" (of {len(dataset)})"
        lines.append(
            f"{name}: {counts.batches} batch{'es' if counts.batches != 1 else ''}, {unit}{of}, through {kind}: "
            f"{', '.join(counts.keys)}; "
            f"first batch {tuple(counts.shape or ())}"
        )
        lines.append(f"  {counts.supervised} supervised positions: label == input_id (the loss shifts them)")
        if attention:
            noun = "sequences" if isinstance(collator, PairedCollator) else "samples"
            lines.append(
                f"  {counts.samples} {layout} {noun} in {counts.batch_rows} batch rows: "
                "position ids restart at 0 at each start and step by 1; label -100 at every sample start"
            )
        if attention and isinstance(collator, PairedCollator):
            lines.append("  sequence_ids: one id per sequence, each of the batch's sequences once, -1 on padding")
        lines.append(
            f"  {counts.padding} padding positions: pad id {tokenizer.pad_token_id}, label -100"
            + ("" if attention else ", attention_mask 0 (1 on every real token)")
        )
    if config.finetuning.stage != "pt":
        problem, encoding_lines = verify_encoding(config, tokenizer, max_batches * args.per_device_train_batch_size,
                                                  images=data.vision is not None)
        if problem:
            return problem, lines
        lines += encoding_lines
    if data.vision is not None:
        problem, image_lines = verify_images(data, max_batches * args.per_device_train_batch_size)
        if problem:
            return problem, lines
        lines += image_lines
    checked = "dtypes int64, shapes consistent" + (f", every input id < vocab_size {vocab_size}" if vocab_size else "")
    lines.append(f"ok: every check passed ({checked})")
    return None, lines


def verify_encoding(config: RunConfig, tokenizer, max_rows: int, images: bool = False) -> tuple[str | None, list[str]]:
    """Re-encode up to ``max_rows`` training rows (0: all) and check each with ``encoded_row_problem``: answers
    after their exact inference prompts, ending with the end-of-turn token, truncation keeping the last answer."""
    from tunelab.data.encode import SupervisedEncoder, encoded_row_problem  # noqa: PLC0415
    from tunelab.data.pairwise import with_answer  # noqa: PLC0415
    from tunelab.data.pipeline import load_canonical_splits  # noqa: PLC0415
    from tunelab.data.templates import get_template  # noqa: PLC0415

    data_args = config.data
    pairs = config.finetuning.stage in PREFERENCE_STAGES
    encoder = SupervisedEncoder(
        tokenizer=tokenizer, template=get_template(data_args.template, tokenizer), cutoff_len=data_args.cutoff_len,
        train_on_prompt=data_args.train_on_prompt, mask_history=data_args.mask_history or pairs,
        template_vars=data_args.template_kwargs or {},
    )
    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()  # the second reading of the rows: no second set of bars
    try:
        # encoder=: with skip_bad_rows the rows training skipped are skipped here too (data/trainable.py)
        rows, _ = load_canonical_splits(data_args, config.training.seed, {}, images=images, encoder=encoder)
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()
    count = len(rows) if max_rows <= 0 else min(len(rows), max_rows)
    for index, row in enumerate(rows.select(range(count))):
        sides = [with_answer(row, {"role": "assistant", "content": row[key], "tool_calls": "", "tool_call_id": ""})
                 for key in ("chosen", "rejected") if row.get(key)] or [row]
        for side in sides:
            problem = encoded_row_problem(encoder, side)
            if problem:
                return f"train row {index}: {problem}", []
    marker = encoder.template.stop_words[0] if encoder.template.stop_words else "(none)"
    return None, [
        f"encoding: {count} training rows re-encoded: every trained answer follows its inference prompt's exact ids "
        f"and is its own ids, ending with {marker!r} as one token; no example over cutoff_len "
        f"{data_args.cutoff_len}, the last answer of each conversation kept"
    ]


# --------------------------------------------------------------------------------------------------
# coverage


def byte_piece_kind(tokenizer) -> str | None:
    """'byte-level' (GPT-2 style byte BPE), 'byte-fallback' (SentencePiece <0x..> pieces) or None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    if (spec.get("model") or {}).get("byte_fallback"):
        return "byte-fallback"
    text = json.dumps([spec.get("pre_tokenizer"), spec.get("decoder")])
    return "byte-level" if '"ByteLevel"' in text else None


def split_characters(
    texts: Iterable[str], tokenizer, kind: str | None = None, top: int = TOP_CHARACTERS
) -> tuple[int, int, list[tuple[str, int, int]]]:
    """(characters, characters split, top split characters as (char, occurrences, pieces)).

    A character is split when the tokenizer, encoding it alone, needs more than one token for it
    (byte-level) or spells it with <0x..> byte pieces (byte-fallback, counting those pieces).
    """
    kind = kind or byte_piece_kind(tokenizer)
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(text)
    total = sum(counts.values())
    if kind is None or not counts:
        return total, 0, []
    chars = sorted(counts)
    encoded = tokenizer(chars, add_special_tokens=False)["input_ids"]
    split = []
    for char, ids in zip(chars, encoded):
        if kind == "byte-level":
            pieces = len(ids) if len(ids) > 1 else 0
        else:
            pieces = sum(1 for token in tokenizer.convert_ids_to_tokens(ids) if _BYTE_PIECE.match(token))
        if pieces:
            split.append((char, counts[char], pieces))
    split.sort(key=lambda item: (-item[1], item[0]))
    return total, sum(n for _, n, _ in split), split[:top]


@dataclass
class IdCoverage:
    tokens: int
    distinct: int
    unk: int | None  # None: the tokenizer has no unk token
    out_of_range: int | None  # None: vocab_size unknown
    max_id: int


def id_coverage(ids: np.ndarray, vocab_size: int | None, unk_id: int | None) -> IdCoverage:
    ids = np.asarray(ids, dtype=np.int64)
    return IdCoverage(
        tokens=len(ids), distinct=len(np.unique(ids)),
        unk=int(np.sum(ids == unk_id)) if unk_id is not None else None,
        out_of_range=int(np.sum((ids >= vocab_size) | (ids < 0))) if vocab_size is not None else None,
        max_id=int(ids.max()) if len(ids) else -1,
    )


def _texts(data: RunData) -> Iterable[str]:
    """The text of the training samples (pairs: of both sequences), each token once (pt windows from their
    first target: no overlap)."""
    pt = data.config.finetuning.stage == "pt"
    for side in data.sides or ("",):
        for sample in data.train.select_columns([f"{side}input_ids", f"{side}labels"]):  # row by row: lazy
            ids, labels = sample[f"{side}input_ids"], sample[f"{side}labels"]
            if pt:
                ids = ids[next((t for t, label in enumerate(labels) if label != IGNORE_INDEX), len(ids)) :]
            yield data.tokenizer.decode(ids, skip_special_tokens=True)


def coverage_report(data: RunData) -> list[str]:
    """The `tunelab data coverage` output for the training samples."""
    tokenizer, config = data.tokenizer, data.config
    vocab_size = model_vocab_size(config.model.model_name_or_path)
    flat = np.concatenate([_flat_column(data.train, f"{side}input_ids")[1] for side in data.sides or ("",)])
    unk_id = tokenizer.unk_token_id if tokenizer.unk_token is not None else None
    cov = id_coverage(flat, vocab_size, unk_id)
    kind = byte_piece_kind(tokenizer)
    vocab_text = f"model vocab_size {vocab_size} from config.json" if vocab_size else "model vocab_size unknown"
    rows = f"{len(data.train)} samples" if data.sides is None else f"{len(data.train)} rows of 2 sequences"
    lines = [
        f"train: {rows}, {cov.tokens} tokens (tokenizer: {kind or 'no byte pieces'}, "
        f"{len(tokenizer)} entries; {vocab_text})"
    ]
    if cov.unk is None:
        lines.append("unk: the tokenizer has no unk token" + (" (byte pieces spell any text)" if kind else ""))
    else:
        share = 100 * cov.unk / max(cov.tokens, 1)
        lines.append(f"unk: {cov.unk} of {cov.tokens} tokens ({share:.2f}%) are {tokenizer.unk_token!r}")
    if cov.out_of_range is not None:
        lines += [
            f"ids out of range (>= vocab_size {vocab_size}): {cov.out_of_range} tokens (largest id {cov.max_id})",
            f"vocabulary used: {cov.distinct} distinct ids of {vocab_size} ({100 * cov.distinct / vocab_size:.1f}%)",
        ]
    if kind is None:
        lines.append("byte pieces: this tokenizer has none (neither byte-level nor byte-fallback)")
        return lines
    total, split, top = split_characters(_texts(data), tokenizer, kind)
    lines.append(
        f"characters spelled in several {kind} pieces: {split} of {total} ({100 * split / max(total, 1):.2f}%)"
    )
    if top:
        lines.append(f"  top {len(top)} (character, code point, occurrences, tokens each when alone):")
        lines += [f"  {char!r:>6} U+{ord(char):04X} {n:>8} {pieces:>3}" for char, n, pieces in top]
    return lines
