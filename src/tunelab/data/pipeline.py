"""Datasets for a run: registry → rows → canonical → mixed → split → encoded.

`build_datasets` is what every stage calls. It returns the encoded train set, one encoded eval set
per eval dataset (evaluated and logged separately), the canonical eval rows (for generation-based
metrics), and a report of every count that changed on the way — nothing is dropped silently.

Per source (data_report.json `sources`): rows read, rows with an empty answer (kept: they train the
end-of-turn), rows with reasoning, ranking pairs dropped for identical answers, and with skip_bad_rows
the rows skipped per reason (unreadable lines and structural faults) with the first example of each.
A row must train what it says (`TrainableRow`, data/trainable.py): a row the template refuses, or whose
tool calls or reasoning it would not train, is an error naming it, or skipped and counted with skip_bad_rows.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.compute as pc

from tunelab.config.args import DataArguments
from tunelab.config.metric_names import VAL_SPLIT_NAME
from tunelab.data.dedup import deduplicate_training_rows
from tunelab.data.encode import (
    COUNTER_COLUMNS,
    IMAGE_COUNTERS,
    EncodeStats,
    SupervisedEncoder,
    as_examples,
)
from tunelab.data.formats import IDENTICAL_PAIR, to_canonical
from tunelab.data.packing import log_packing, pack_dataset
from tunelab.data.dataset_files import describe, describe_files, load_rows
from tunelab.data.registry import load_registry
from tunelab.data.templates import Template
from tunelab.data.trainable import TrainableRow
from tunelab.data.vision import VisionEncoder
from tunelab.errors import ConfigError, DataError

logger = logging.getLogger(__name__)



@dataclass
class DatasetBundle:
    train: datasets.Dataset | None
    eval: dict[str, datasets.Dataset]
    eval_rows: dict[str, datasets.Dataset]  # canonical rows of each eval set, for generation metrics
    report: dict[str, Any] = field(default_factory=dict)


UNREADABLE_LINE = "unreadable_line"  # skip reason of JSON-lines lines that do not parse (dataset_files.load_rows)


def load_canonical(
    names: list[str], data_args: DataArguments, report: dict, encoder: SupervisedEncoder | None = None,
    images: bool = False,
) -> list[datasets.Dataset]:
    """Canonical rows of each named dataset. `encoder` (the sft encoder of the run): check that each row trains what
    it says (data/trainable.py).
    `images`: the model is a vision-language model, so rows keep their images (else images are refused)."""
    registry = load_registry(data_args.dataset_dir)
    row_check = TrainableRow(encoder) if encoder is not None else None
    loaded = []
    for name in names:
        spec = registry[name]
        skipped: list[str] | None = [] if data_args.skip_bad_rows else None
        rows = load_rows(spec, skipped=skipped)
        if data_args.max_samples is not None and len(rows) > data_args.max_samples:
            rows = rows.select(range(data_args.max_samples))
        canonical, conversion = to_canonical(
            rows, spec, num_proc=data_args.preprocessing_num_workers, skip_bad_rows=data_args.skip_bad_rows,
            row_check=row_check, images=images,
        )
        identical = conversion.dropped.pop(IDENTICAL_PAIR, 0)
        conversion.first.pop(IDENTICAL_PAIR, None)
        source = {
            **describe(spec), "rows": len(rows), "empty_answers": conversion.empty_answers,
            "rows_with_reasoning": conversion.with_reasoning, "numbers_as_text": conversion.numbers_as_text,
            "null_arguments_dropped": conversion.null_arguments,
        }
        if conversion.numbers_as_text:
            logger.warning("dataset %s: %d values of text fields are numbers; they train as their text (42 → \"42\")",
                           name, conversion.numbers_as_text)
        if conversion.null_arguments:
            logger.warning(
                "dataset %s: dropped %d null-valued keys from tool-call arguments given as objects (a parquet or arrow "
                "file gives every call the keys of all calls, as null); to train a null, write those arguments as "
                "JSON text", name, conversion.null_arguments,
            )
        if spec.ranking:
            source["dropped_identical_pairs"] = identical
        if skipped is not None:
            by_reason = {UNREADABLE_LINE: len(skipped)} if skipped else {}
            first = {UNREADABLE_LINE: skipped[0]} if skipped else {}
            by_reason.update(conversion.dropped)
            first.update(conversion.first)
            source.update(skipped_bad_rows=sum(by_reason.values()), skipped_by_reason=by_reason, first_skipped=first)
            for reason, count in by_reason.items():
                logger.warning(
                    "dataset %s: skipped %d rows (skip_bad_rows): %s, first: %s", name, count, reason, first[reason]
                )
        report.setdefault("sources", []).append(source)
        if identical:
            logger.warning("dataset %s: dropped %d of %d pairs whose chosen and rejected answers are the same "
                           "(they teach nothing)", name, identical, len(rows))
        if conversion.empty_answers:
            logger.info("dataset %s: %d rows have an empty answer; they train the end-of-turn only",
                        name, conversion.empty_answers)
        if len(canonical) == 0:
            files = describe_files(spec)
            raise DataError(f"dataset '{name}'{f' ({files})' if files else ''}: no usable rows (all {len(rows)} were "
                            "skipped or dropped)")
        loaded.append(canonical)
    return loaded


def mix_sources(parts: list[datasets.Dataset], data_args: DataArguments, seed: int) -> datasets.Dataset:
    """The train datasets as one, by mix_strategy: concatenated, or interleaved (interleave_probs, seeded)."""
    if len(parts) == 1:
        return parts[0]
    if data_args.mix_strategy == "concat":
        return datasets.concatenate_datasets(parts)
    stopping = "first_exhausted" if data_args.mix_strategy == "interleave_under" else "all_exhausted"
    return datasets.interleave_datasets(
        parts, probabilities=data_args.interleave_probs, seed=seed, stopping_strategy=stopping
    )


def split_validation(
    dataset: datasets.Dataset, val_size: float, seed: int, unit: str
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Hold out val_size (a fraction < 1, or a count >= 1) of a dataset: (train, val)."""
    size = int(val_size) if val_size >= 1 else val_size
    if isinstance(size, int) and size >= len(dataset):
        raise DataError(f"val_size={size} leaves no training {unit} (the train set has {len(dataset)})")
    split = dataset.train_test_split(test_size=size, seed=seed)
    return split["train"], split["test"]


LARGE_SET_ROWS = 50_000  # from here, preprocessing_num_workers unset tokenises with one process per CPU
MAX_DEFAULT_WORKERS = 8  # each process holds a tokenizer and a share of the batches; more rarely pays


def encode_workers(rows: int, given: int | None, cpus: int) -> int | None:
    """The processes that tokenise a set of `rows`: preprocessing_num_workers when given; otherwise one per CPU
    (up to MAX_DEFAULT_WORKERS) for sets of LARGE_SET_ROWS rows or more, where starting the processes pays off;
    None (this process) below that. The examples are the same either way: datasets maps contiguous shards and
    concatenates them in order."""
    if given is not None:
        return given
    workers = min(cpus, MAX_DEFAULT_WORKERS)
    return workers if rows >= LARGE_SET_ROWS and workers > 1 else None


def _usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def encode_dataset(
    canonical: datasets.Dataset, encoder: SupervisedEncoder, name: str, num_proc: int | None
) -> tuple[datasets.Dataset, EncodeStats]:
    chosen = encode_workers(len(canonical), num_proc, _usable_cpus())
    if chosen != num_proc:
        logger.info("%s: %d rows, tokenising with %d processes (preprocessing_num_workers unset: one per CPU, at most "
                    "%d, for sets of %d rows or more)", name, len(canonical), chosen, MAX_DEFAULT_WORKERS, LARGE_SET_ROWS)
    num_proc = chosen
    encoded = canonical.map(
        encoder, batched=True, batch_size=256, remove_columns=list(canonical.column_names), num_proc=num_proc,
        desc=f"Tokenising {name}", features=getattr(encoder, "features", None),
    )
    images_dont_fit = 0
    if "images_dont_fit" in encoded.column_names:  # vision runs (data/vision.py): count, then drop the markers
        images_dont_fit = _sum(encoded.with_format("arrow")[:]["images_dont_fit"])
        if images_dont_fit:
            encoded = encoded.filter(lambda ids: len(ids) > 0, input_columns="input_ids", desc=f"Dropping {name} examples whose images do not fit")
    if len(encoded) == 0:
        raise DataError(f"{name}: every example was dropped; raise cutoff_len (now {encoder.cutoff_len})")
    # Sums in Arrow: iterating a column makes one Python object per row, as slow as the encoding itself.
    table = encoded.with_format("arrow")[:]
    added = table["expanded"]  # examples added by conversations split per answer (see SupervisedEncoder)
    present = set(table.column_names)
    stats = EncodeStats(
        examples=len(encoded),
        truncated=_sum(table["truncated"]),
        # pairwise encoders (data/pairwise.py) count a pair's truncation once already
        rows_shortened=_sum(table["rows_shortened"]) if "rows_shortened" in present else _sum(table["truncated"]),
        answers_dropped=_sum(table["answers_dropped"]) if "answers_dropped" in present else 0,
        dropped_no_supervised=len(canonical) + _sum(added) - len(encoded) - images_dont_fit,
        images_dont_fit=images_dont_fit,
        images=_sum(table["num_images"]) if "num_images" in present else 0,
        image_tokens=_sum(table["num_image_tokens"]) if "num_image_tokens" in present else 0,
        # pairwise encoders (data/pairwise.py) count their tokens in a num_tokens column
        tokens=_sum(table["num_tokens"]) if "num_tokens" in present else _sum(pc.list_value_length(table["input_ids"])),
        supervised_tokens=_sum(table["num_supervised"]),
        expanded_conversations=_sum(pc.not_equal(added, 0)),
        split_at_seams=_sum(table["split_at_seams"]) if "split_at_seams" in present else 0,
        texts_cut=_sum(table["texts_cut"]) if "texts_cut" in present else 0,
    )
    encoded = encoded.remove_columns([c for c in (*COUNTER_COLUMNS, *IMAGE_COUNTERS, "num_tokens") if c in present])
    log_encode_stats(name, stats, encoder.cutoff_len)
    return encoded, stats


def log_encode_stats(name: str, stats: EncodeStats, cutoff_len: int) -> None:
    """Warn about everything encoding changed: examples shortened, answers lost, examples dropped."""
    if stats.truncated or stats.answers_dropped:
        logger.warning(
            "%s: %d rows shortened to fit cutoff_len=%d%s (earliest turns dropped first), losing %d trained answers",
            name, stats.rows_shortened, cutoff_len, as_examples(stats.rows_shortened, stats.truncated),
            stats.answers_dropped,
        )
    if stats.dropped_no_supervised:
        logger.warning(
            "%s: dropped %d examples with no supervised token left after truncation to cutoff_len=%d",
            name, stats.dropped_no_supervised, cutoff_len,
        )
    if stats.images_dont_fit:
        logger.warning(
            "%s: dropped %d examples whose image tokens do not fit cutoff_len=%d (an image is never cut in half; raise "
            "cutoff_len or lower image_max_pixels)", name, stats.images_dont_fit, cutoff_len,
        )
    if stats.texts_cut:
        logger.warning(
            "%s: %d messages far longer than cutoff_len=%d were cut before tokenising (the examples are the same: "
            "truncation keeps at most cutoff_len tokens of them)", name, stats.texts_cut, cutoff_len,
        )
    if stats.split_at_seams:
        logger.info(
            "%s: %d conversations encoded one example per answer: tokenised whole, an earlier answer's seam gives "
            "other ids than its training pieces (see docs/data.md, 'Training ids are inference ids')",
            name, stats.split_at_seams,
        )


def _sum(column: pa.ChunkedArray | pa.Array) -> int:
    return int(pc.sum(column).as_py() or 0)  # booleans count their true values; no rows sum to 0


def build_datasets(
    data_args: DataArguments, tokenizer, template: Template, seed: int, encoder=None, vision=None, images: bool = False
) -> DatasetBundle:
    """`encoder` maps canonical rows to examples; default the SupervisedEncoder of data_args. The
    preference stages pass theirs (data/pairwise.py), which wrap that same SupervisedEncoder.
    `vision` (a vision-language model's (processor, ImageSettings)): rows keep their images and encode through
    data/vision.py's VisionEncoder around the supervised encoder."""
    report: dict[str, Any] = {}
    if encoder is None:
        encoder = SupervisedEncoder(
            tokenizer=tokenizer, template=template, cutoff_len=data_args.cutoff_len,
            train_on_prompt=data_args.train_on_prompt, mask_history=data_args.mask_history,
            template_vars=data_args.template_kwargs or {},
        )
        if vision is not None:

            encoder = VisionEncoder(encoder, *vision)
    num_proc = data_args.preprocessing_num_workers
    images = images or vision is not None  # `images`: a given encoder (pairs) takes rows with images

    sft_encoder = encoder
    while hasattr(sft_encoder, "encoder"):  # the preference and vision encoders wrap the sft one
        sft_encoder = sft_encoder.encoder
    if images and data_args.dedup != "none":
        raise ConfigError(f"dedup: {data_args.dedup} compares the rows' text, not their images; set dedup: none for a "
                          "vision-language model")
    sources = load_canonical(data_args.dataset or [], data_args, report, sft_encoder, images)
    if data_args.dedup != "none":  # before mixing and the val split: no duplicate straddles train and val
        sources, dedup = deduplicate_training_rows(sources, data_args, encoder)
        report["dedup"] = dedup.as_dict()
    train_rows = mix_sources(sources, data_args, seed)
    eval_rows: dict[str, datasets.Dataset] = {}
    if data_args.val_size > 0:
        train_rows, eval_rows[VAL_SPLIT_NAME] = split_validation(train_rows, data_args.val_size, seed, "rows")
    for name in data_args.eval_dataset or []:
        (eval_rows[name],) = load_canonical([name], data_args, report, sft_encoder, images)

    train, stats = encode_dataset(train_rows, encoder, "train", num_proc)
    report["train"] = stats.__dict__
    evals = {}
    for name, rows in eval_rows.items():
        evals[name], eval_stats = encode_dataset(rows, encoder, f"eval:{name}", num_proc)
        report[f"eval:{name}"] = eval_stats.__dict__
    logger.info(
        "train: %d examples, %d tokens, %d supervised, %d truncated (%d answers lost), %d dropped",
        stats.examples, stats.tokens, stats.supervised_tokens, stats.truncated, stats.answers_dropped,
        stats.dropped_no_supervised,
    )
    if stats.images:
        logger.info("train: %d images, %d image tokens (%.1f%% of the tokens)", stats.images, stats.image_tokens,
                    100 * stats.image_tokens / max(stats.tokens, 1))
    if data_args.packing:
        # Eval sets too: the trainer has one collator, and it takes packed rows.
        report["packing"] = {}
        train, packing = pack_dataset(train, data_args.cutoff_len)
        report["packing"]["train"] = packing.as_dict()
        log_packing("train", packing)
        for name in evals:
            evals[name], packing = pack_dataset(evals[name], data_args.cutoff_len)
            report["packing"][f"eval:{name}"] = packing.as_dict()
            log_packing(f"eval:{name}", packing)
    return DatasetBundle(train=train, eval=evals, eval_rows=eval_rows, report=report)


def load_canonical_splits(
    data_args: DataArguments, seed: int, report: dict[str, Any], images: bool = False,
    encoder: SupervisedEncoder | None = None,
) -> tuple[datasets.Dataset, dict[str, datasets.Dataset]]:
    """Canonical (train rows, eval rows by name): registry → formats → mixing → val split, as
    `build_datasets` does, for stages that render prompts instead of encoding conversations (grpo, ppo).
    `encoder`: the run's sft encoder, to check the rows as training does (data/trainable.py: with skip_bad_rows
    the same rows are left out), for callers that encode them again (`tunelab data verify`)."""
    sources = load_canonical(data_args.dataset or [], data_args, report, encoder, images)
    train_rows = mix_sources(sources, data_args, seed) if sources else datasets.Dataset.from_list([])  # tunelab eval
    eval_rows: dict[str, datasets.Dataset] = {}
    if data_args.val_size > 0:
        train_rows, eval_rows[VAL_SPLIT_NAME] = split_validation(train_rows, data_args.val_size, seed, "rows")
    for name in data_args.eval_dataset or []:
        (eval_rows[name],) = load_canonical([name], data_args, report, encoder, images)
    return train_rows, eval_rows
