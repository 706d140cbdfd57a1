"""Streaming train sets (`streaming: true`): corpora larger than memory, read → tokenised → windowed or
packed → shuffled on the fly, in bounded memory.

This module owns the iterable train set of stages pt and sft; eval sets stay map-style (pretrain.py,
pipeline.py). The train set is one HF `datasets.IterableDataset`, built with `from_generator`:

    files ─load_dataset(streaming=True)→ row batches ─DocumentTokenizer──────────→ documents ─┐
                                                   └─converter, SupervisedEncoder→ examples ──┤
    ┌─────────────────────────────────────────────────────────────────────────────────────────┘
    └→ pt: windows from a running token buffer, or document chunks | sft: examples
       → (packing) rows packed within a look-ahead → .repeat(None).shuffle(seed, buffer_size) → Trainer

Same output as map-style: read by one reader in registry order (the defaults of pretrain_stream and
supervised_stream), the stream yields exactly the map-style builders' rows, in the same order. pt
windows come from a running token buffer with plan_windows' starts, overlap labels (-100) and tail
policy, across document and file boundaries; pt packing chunks each document as document_chunks;
sft runs the same converter and SupervisedEncoder. Cleaning drops, truncations and packing
efficiency are counted as the stream runs and logged when a pass ends or the stream is closed
(there are no totals up front).

Readers and shards: HF calls the generator once per shard, so a token buffer or packing look-ahead
never spans two shards. For training, the files (each file of a concatenated source is a unit; a
generator source, or a source with max_samples or num_samples counted over all its files, is one)
are shuffled by the seed and dealt round-robin into one shard per reader, readers = ranks x
DataLoader workers; interleaved sources are always one shard, mixed inside it.

Shuffling: HF's `.shuffle(seed, buffer_size)` shuffles the shard order, then draws items at random
from a buffer of buffer_size windows / examples / packed rows, so an item leaves at most buffer_size
places earlier than it came in; seeded, so every rank and every run gets the same order. The train
set repeats forever (`.repeat(None)` before the shuffle), hence `max_steps`.

Packing (packing: true): best-fit decreasing (packing.py) over buffer_size samples at a time, so
its efficiency depends on that look-ahead: only the rows left at the end of each look-ahead are
under-filled (figures in docs/benchmarks.md); the running efficiency is logged.

Memory, per reader: the shuffle buffer (buffer_size items, as int32 arrays), the packing look-ahead
(buffer_size samples), the token buffer (< cutoff_len + one batch), one tokenisation batch (1000
documents / 256 rows) and the file reader's chunk. A document is tokenised whole, so one huge
single-document file (txt_sample_by: document) is not bounded.

Distributed training: transformers' Trainer hands its DataLoader to accelerate, which by default
*dispatches* an IterableDataset: rank 0 alone reads and tokenises, concatenates world_size batches
and scatters slices, which needs equal-shape batches (sft batches pad to their longest row, so they
are not). The plan turns that off before anything trains (preflight.py, train/launch.py `per_rank_streams`:
accelerator_config.dispatch_batches = False), so each rank iterates its own copy and accelerate shards it:
`IterableDataset.shard` when there are at least world_size shards (each rank reads disjoint files), else
IterableDatasetShard (each rank reads the whole stream and keeps its own batch of every world_size; correct, the
reading repeated per rank).
We do not call split_dataset_by_node as well: accelerate would shard its result again. Because the
stream repeats, a rank whose shard runs out first starts over instead of leaving the others waiting
in a collective; every rank stops at max_steps. DataLoader workers split a rank's shards further, so
dataloader_num_workers, not preprocessing_num_workers, parallelises the reading and tokenising.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import datasets
import numpy as np

from tunelab.config.args import DataArguments
from tunelab.data.encode import IGNORE_INDEX, SupervisedEncoder
from tunelab.data.formats import CANONICAL_FEATURES, RowConverter
from tunelab.data.packing import PackingStats, pack_dataset
from tunelab.data.pipeline import DatasetBundle, encode_dataset, load_canonical, mix_sources
from tunelab.data.pretrain import (
    TOKENIZE_BATCH, DocumentStats, DocumentTokenizer, document_bos_id, keep_document, load_documents, packed_report,
    resolve_text_columns, window_report,
)
from tunelab.data.dataset_files import check_utf8, describe, load_rows, resolve_files
from tunelab.data.registry import FILE_TYPES, DatasetSpec, load_registry
from tunelab.data.trainable import TrainableRow
from tunelab.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

ENCODE_BATCH = 256  # sft rows per SupervisedEncoder call, as map-style encoding


# --- shards: what a rank or DataLoader worker reads ------------------------------------------


@dataclass(frozen=True)
class Part:
    """Rows of one source: some of its files, or all of a generator source's rows (files is empty)."""

    source: str
    files: tuple[str, ...] = ()


@dataclass(frozen=True)
class Shard:
    """What one reader reads as one stream: its parts one after another, or (interleave) mixed."""

    parts: tuple[Part, ...]
    mixed: bool = False


def plan_shards(
    specs: list[DatasetSpec], data_args: DataArguments, readers: int = 1, seed: int | None = None
) -> list[Shard]:
    """Split the train data into at most `readers` shards, each read as one stream by one reader.

    HF calls the generator once per shard, so state (the token buffer, the packing look-ahead)
    never spans two shards: with one shard the stream is exactly map-style's. Files go round-robin
    to the shards, in registry order, or in an order shuffled by `seed`.
    """
    mixed = data_args.mix_strategy != "concat" and len(specs) > 1
    parts: list[Part] = []
    for spec in specs:
        if spec.generator:
            parts.append(Part(spec.name))
            continue
        files = tuple(str(p) for p in resolve_files(spec))
        # Row limits count over all of a source's files, and interleaving mixes whole sources.
        if data_args.max_samples is None and spec.num_samples is None and not mixed:
            parts.extend(Part(spec.name, (f,)) for f in files)
        else:
            parts.append(Part(spec.name, files))
    if mixed:
        return [Shard(tuple(parts), mixed=True)]  # interleaving draws from every source: one reader
    if seed is not None:
        parts = [parts[i] for i in np.random.default_rng(seed).permutation(len(parts))]
    count = max(1, min(readers, len(parts)))
    return [Shard(tuple(parts[i::count])) for i in range(count)]


def stream_rows(spec: DatasetSpec, files: tuple[str, ...], data_args: DataArguments) -> datasets.IterableDataset:
    """Raw rows of one part, as dataset_files.load_rows gives them (num_samples, then max_samples), read lazily."""
    if spec.generator:  # built in memory by design (small); streamed for uniformity
        rows = load_rows(spec).to_iterable_dataset()
    else:
        kind = FILE_TYPES[Path(files[0]).suffix]
        options = {"sample_by": data_args.txt_sample_by} if kind == "text" else {}
        rows = datasets.load_dataset(kind, data_files=list(files), split="train", streaming=True, **options)
        if spec.num_samples is not None:  # load_rows' `select(i % len)`: cycle through the rows
            rows = rows.repeat(None).take(spec.num_samples)
    if data_args.max_samples is not None:
        rows = rows.take(data_args.max_samples)
    return rows


def column_names(rows: datasets.IterableDataset, source: str) -> list[str]:
    """Columns of a lazily read source: from its features, else from its first row (one reader chunk)."""
    if rows.column_names is not None:
        return list(rows.column_names)
    first = next(iter(rows), None)
    if first is None:
        raise DataError(f"dataset '{source}': no rows to read")
    return list(first)


def _check_files(specs: list[DatasetSpec]) -> None:
    # As map-style: the JSON/CSV/text readers would replace bytes that are not UTF-8 silently.
    for spec in specs:
        if spec.generator:
            continue
        for path in resolve_files(spec):
            if FILE_TYPES[path.suffix] in ("json", "csv", "text"):
                check_utf8(path)


def _as_array(values: Iterable[int]) -> np.ndarray:
    # int32: a quarter of what lists of Python ints would hold in the shuffle buffer (vocabularies fit).
    return np.fromiter(values, dtype=np.int32)


# --- stage pt: windows from a running token buffer -------------------------------------------


class TokenWindows:
    """Windows over a token stream fed piece by piece, exactly where plan_windows places them.

    Window i covers stream positions [i*S, i*S + W); its first W - S tokens were in window i-1 and are
    context only (label -100). The buffer keeps only tokens a later window still needs: at most
    W + the last piece pushed.
    """

    def __init__(self, window: int, stride: int, tail: str = "keep"):
        self.window, self.stride, self.tail = window, stride, tail
        self.buffer = np.empty(0, dtype=np.int32)
        self.base = 0  # stream position of buffer[0]
        self.windows = 0  # full windows emitted
        self.tail_tokens = 0  # set by finish()

    def push(self, tokens: np.ndarray) -> Iterator[dict[str, np.ndarray]]:
        self.buffer = np.concatenate([self.buffer, tokens])
        start = self.windows * self.stride
        while self.base + len(self.buffer) >= start + self.window:
            yield self._emit(start - self.base, start - self.base + self.window, context=self.windows > 0)
            self.windows += 1
            start += self.stride
        drop = start - self.base  # tokens before the next window's start are never read again
        self.buffer, self.base = self.buffer[drop:], start

    def finish(self) -> Iterator[dict[str, np.ndarray]]:
        """The tail: tokens after the last full window, as one shorter window (tail: keep) or dropped."""
        covered = (self.windows - 1) * self.stride + self.window if self.windows else 0
        total = self.base + len(self.buffer)
        self.tail_tokens = total - covered
        if self.tail == "keep" and self.tail_tokens > 0:
            yield self._emit(0, len(self.buffer), context=self.windows > 0)
        self.buffer = self.buffer[:0]

    def _emit(self, begin: int, end: int, context: bool) -> dict[str, np.ndarray]:
        ids = self.buffer[begin:end].copy()  # a copy: a view would keep the whole buffer alive in the shuffle buffer
        labels = ids.copy()
        if context:
            labels[: self.window - self.stride] = IGNORE_INDEX
        return {"input_ids": ids, "labels": labels}


@dataclass
class _CountingTokenizer:
    """DocumentTokenizer that also counts what cleaning dropped (the stream has no totals to read back)."""

    inner: DocumentTokenizer
    stats: DocumentStats = field(default_factory=DocumentStats)

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        out = self.inner(batch)
        keep = max(self.inner.min_length, 1)
        for n, column in zip(out["num_tokens"], out["text_column"]):
            self.stats.documents += 1
            if n >= keep:
                self.stats.kept += 1
                self.stats.tokens += n + self.inner.special_tokens
                name = self.inner.text_columns[column]
                self.stats.documents_by_column[name] = self.stats.documents_by_column.get(name, 0) + 1
            elif n == 0:
                self.stats.dropped_empty += 1
            else:
                self.stats.dropped_short += 1
        return out


@dataclass
class PretrainStream:
    """`from_generator` callable: the windows of the given shards, read in order as one token stream."""

    tokenizer: Any
    data_args: DataArguments
    specs: dict[str, DatasetSpec]
    text_columns: dict[str, tuple[str, ...]]
    source_columns: dict[str, list[str]]
    seed: int

    def documents(self, part: Part, counter: _CountingTokenizer) -> datasets.IterableDataset:
        """A part's kept documents as an HF stream (for interleaving, which mixes cleaned documents)."""
        rows = stream_rows(self.specs[part.source], part.files, self.data_args)
        columns = self.source_columns[part.source]
        tokenized = rows.map(counter, batched=True, batch_size=TOKENIZE_BATCH, remove_columns=columns)
        return tokenized.filter(
            keep_document, input_columns="num_tokens", batched=True, batch_size=TOKENIZE_BATCH,
            fn_kwargs={"min_length": self.data_args.min_length},
        )

    def document_batches(
        self, shards: list[Shard], counters: dict[str, _CountingTokenizer]
    ) -> Iterator[list[list[int]]]:
        """Token ids (EOS appended) of the kept documents, a tokenisation batch at a time, in reading order."""
        data = self.data_args

        def counter(part: Part) -> _CountingTokenizer:
            if part.source not in counters:
                counters[part.source] = _CountingTokenizer(DocumentTokenizer(
                    self.tokenizer, self.text_columns[part.source], data.min_length, part.source,
                    document_bos_id(self.tokenizer),
                ))
            return counters[part.source]

        for shard in shards:
            if shard.mixed:  # map-style mixes cleaned documents, so the drops go before the mix
                mixed = mix_sources([self.documents(part, counter(part)) for part in shard.parts], data, self.seed)
                for batch in mixed.iter(batch_size=TOKENIZE_BATCH):
                    yield batch["input_ids"]
                continue
            for part in shard.parts:  # opened one at a time: thousands of files cost nothing up front
                tokenize = counter(part)
                # Called on HF's row batches directly: its per-example map/filter plumbing cost ~40% of throughput.
                for rows in stream_rows(self.specs[part.source], part.files, data).iter(batch_size=TOKENIZE_BATCH):
                    yield [ids for ids in tokenize(rows)["input_ids"] if ids]  # dropped documents come back empty

    def __call__(self, shards: list[Shard]) -> Iterator[dict[str, np.ndarray]]:
        data = self.data_args
        counters: dict[str, _CountingTokenizer] = {}
        batches = self.document_batches(shards, counters)
        cutter = TokenWindows(data.cutoff_len, data.stride or data.cutoff_len, data.tail)
        packing = PackingStats(samples=0, rows=0, tokens=0, cutoff_len=data.cutoff_len)
        finished = False
        try:
            if data.packing:  # as pretrain.document_chunks: each document cut at cutoff_len, chunks packed
                chunks = (
                    {"input_ids": piece, "labels": piece}
                    for batch in batches for ids in batch
                    for piece in np.array_split(_as_array(ids), range(data.cutoff_len, len(ids), data.cutoff_len))
                )
                yield from pack_lookahead(chunks, data.cutoff_len, data.buffer_size, packing)
            else:
                for batch in batches:
                    yield from cutter.push(_as_array(itertools.chain.from_iterable(batch)))
                yield from cutter.finish()
            finished = True
        finally:  # also when the Trainer stops mid-pass (max_steps) and the generator is closed
            _log_documents(counters, cutter, finished)
            _log_packing(packing, data.buffer_size)


def _shard_streams(shard: Shard, open_part, data_args: DataArguments, seed: int) -> Iterator[datasets.IterableDataset]:
    """A shard's streams in reading order: each part in turn (opened lazily), or one stream interleaving them all."""
    if shard.mixed:
        yield mix_sources([open_part(part) for part in shard.parts], data_args, seed)
    else:
        for part in shard.parts:
            yield open_part(part)


def _log_documents(counters: dict[str, _CountingTokenizer], cutter: TokenWindows, finished: bool) -> None:
    when = "end of a pass over the stream" if finished else "stream closed mid-pass"
    for name, counter in counters.items():
        s = counter.stats
        logger.info(
            "streaming %s (%s): %d documents read, %d kept, %d tokens", name, when, s.documents, s.kept, s.tokens
        )
        if s.kept < s.documents:
            logger.warning(
                "streaming %s: dropped %d of %d documents so far: %d empty, %d shorter than min_length=%d tokens",
                name, s.documents - s.kept, s.documents, s.dropped_empty, s.dropped_short, counter.inner.min_length,
            )
    if finished and cutter.tail == "drop" and cutter.tail_tokens:  # (never set with packing)
        logger.warning("streaming: tail: drop dropped the last %d tokens of the stream", cutter.tail_tokens)


def _sources(data_args: DataArguments) -> list[DatasetSpec]:
    registry = load_registry(data_args.dataset_dir)
    return [registry[name] for name in data_args.dataset or []]


def pretrain_stream(
    data_args: DataArguments, tokenizer, seed: int, readers: int = 1, shuffle_files: bool = False
) -> datasets.IterableDataset:
    """Stage pt train windows (input_ids, labels as int32 arrays), finite; by default map-style's, in order.

    `readers`: how many shards to split the files into (ranks x DataLoader workers); `shuffle_files`:
    read the files in an order shuffled by `seed` (see plan_shards).
    """
    if tokenizer.eos_token_id is None:
        raise ConfigError(
            "model_name_or_path: the tokenizer has no eos_token, which stage pt puts after every document; "
            "add eos_token to its tokenizer_config.json"
        )
    specs = _sources(data_args)
    _check_files(specs)
    columns, text_columns = {}, {}
    for spec in specs:  # resolve every column now, so a wrong text_column fails before training starts
        files = tuple(str(p) for p in resolve_files(spec)) if not spec.generator else ()
        columns[spec.name] = column_names(stream_rows(spec, files, data_args), spec.name)
        text_columns[spec.name] = resolve_text_columns(spec, columns[spec.name], data_args.text_column)
    generator = PretrainStream(tokenizer, data_args, {s.name: s for s in specs}, text_columns, columns, seed)
    shards = plan_shards(specs, data_args, readers, seed if shuffle_files else None)
    return datasets.IterableDataset.from_generator(generator, gen_kwargs={"shards": shards})


# --- stage sft: encoded examples, optionally packed within a look-ahead ------------------------


@dataclass
class _CountingEncoder:
    """SupervisedEncoder that also counts rows in and what came out (truncated, dropped, expanded)."""

    inner: SupervisedEncoder
    rows: int = 0
    examples: int = 0
    truncated: int = 0
    answers_dropped: int = 0
    added: int = 0  # examples added by conversations split per answer

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        out = self.inner(batch)
        self.rows += len(next(iter(batch.values()), []))
        self.examples += len(out["input_ids"])
        self.truncated += sum(out["truncated"])
        self.answers_dropped += sum(out["answers_dropped"])
        self.added += sum(out["expanded"])
        return out


def pack_lookahead(samples: Iterable[dict], cutoff_len: int, lookahead: int, stats: PackingStats) -> Iterator[dict]:
    """Packed rows (input_ids, labels, position_ids): pack_dataset over `lookahead` samples at a time."""

    def pack(group: list[dict]) -> Iterator[dict]:
        table = {key: [sample[key] for sample in group] for key in ("input_ids", "labels")}
        packed, packing = pack_dataset(datasets.Dataset.from_dict(table), cutoff_len)
        stats.samples, stats.rows, stats.tokens = (
            stats.samples + packing.samples, stats.rows + packing.rows, stats.tokens + packing.tokens
        )
        for row in packed.with_format("numpy"):
            yield {key: value.astype(np.int32) for key, value in row.items()}

    group: list[dict] = []
    for sample in samples:
        group.append(sample)
        if len(group) == lookahead:
            yield from pack(group)
            group = []
    if group:
        yield from pack(group)


@dataclass
class SupervisedStream:
    """`from_generator` callable: the encoded (or packed) examples of the given shards, in order."""

    encoder: SupervisedEncoder
    data_args: DataArguments
    specs: dict[str, DatasetSpec]
    source_columns: dict[str, list[str]]
    seed: int

    def canonical(self, part: Part) -> datasets.IterableDataset:
        spec = self.specs[part.source]
        columns = self.source_columns[part.source]
        rows = stream_rows(spec, part.files, self.data_args)
        # As map-style: a structurally wrong row is an error naming it (skip_bad_rows is not for streams),
        # an empty answer trains the end-of-turn, and a row must train what it says (data/trainable.py).
        files = [Path(f) for f in part.files] or None
        converter = RowConverter(spec, columns, row_check=TrainableRow(self.encoder), files=files)
        return rows.map(converter, with_indices=True, remove_columns=columns, features=CANONICAL_FEATURES)

    def examples(self, shards: list[Shard], counter: _CountingEncoder) -> Iterator[dict[str, np.ndarray]]:
        for shard in shards:
            for rows in _shard_streams(shard, self.canonical, self.data_args, self.seed):
                encoded = rows.map(
                    counter, batched=True, batch_size=ENCODE_BATCH, remove_columns=list(CANONICAL_FEATURES)
                )
                for example in encoded:
                    yield {"input_ids": _as_array(example["input_ids"]), "labels": _as_array(example["labels"])}

    def __call__(self, shards: list[Shard]) -> Iterator[dict[str, np.ndarray]]:
        counter = _CountingEncoder(self.encoder)
        packing = PackingStats(samples=0, rows=0, tokens=0, cutoff_len=self.data_args.cutoff_len)
        examples = self.examples(shards, counter)
        try:
            if self.data_args.packing:
                yield from pack_lookahead(examples, self.data_args.cutoff_len, self.data_args.buffer_size, packing)
            else:
                yield from examples
        finally:
            logger.info(
                "streaming train: %d rows → %d examples so far, %d truncated (%d answers lost), %d dropped with no "
                "supervised token",
                counter.rows, counter.examples, counter.truncated, counter.answers_dropped,
                counter.rows + counter.added - counter.examples,
            )
            _log_packing(packing, self.data_args.buffer_size)


def _log_packing(stats: PackingStats, lookahead: int) -> None:
    if stats.samples:
        logger.info(
            "streaming packing: %d samples into %d rows so far, efficiency %.2f%% (look-ahead of buffer_size=%d)",
            stats.samples, stats.rows, 100 * stats.efficiency, lookahead,
        )


def supervised_stream(
    data_args: DataArguments, tokenizer, template, seed: int, readers: int = 1, shuffle_files: bool = False
) -> datasets.IterableDataset:
    """Stage sft train examples (packed rows with packing), finite; with the defaults, map-style's in order."""
    encoder = SupervisedEncoder(
        tokenizer=tokenizer, template=template, cutoff_len=data_args.cutoff_len,
        train_on_prompt=data_args.train_on_prompt, mask_history=data_args.mask_history,
        template_vars=data_args.template_kwargs or {},
    )
    specs = _sources(data_args)
    _check_files(specs)
    columns = {}
    for spec in specs:
        files = tuple(str(p) for p in resolve_files(spec)) if not spec.generator else ()
        columns[spec.name] = column_names(stream_rows(spec, files, data_args), spec.name)
        RowConverter(spec, columns[spec.name])  # a missing mapped column fails now, not in a DataLoader worker
    generator = SupervisedStream(encoder, data_args, {s.name: s for s in specs}, columns, seed)
    shards = plan_shards(specs, data_args, readers, seed if shuffle_files else None)
    return datasets.IterableDataset.from_generator(generator, gen_kwargs={"shards": shards})


# --- what the stages call ---------------------------------------------------------------------


def shuffled(
    stream: datasets.IterableDataset, buffer_size: int, seed: int, repeat: bool = True
) -> datasets.IterableDataset:
    """The train order: repeated forever (repeat), then shuffled by shard and within a buffer of buffer_size."""
    return (stream.repeat(None) if repeat else stream).shuffle(seed=seed, buffer_size=buffer_size)


def _stream_report(data_args: DataArguments, shards: int) -> dict[str, Any]:
    sources = [describe(spec) for spec in _sources(data_args)]
    return {
        "sources": sources,
        "train": {"streaming": True, "shards": shards, "buffer_size": data_args.buffer_size,
                  "counts": "not known before the stream is read; logged as it runs"},
    }


def readers_of(args) -> int:
    """Processes that read the stream at once: ranks x DataLoader workers (the main process when 0)."""
    return max(1, args.world_size) * max(1, args.dataloader_num_workers)


def build_streaming_pretrain(data_args: DataArguments, tokenizer, args) -> DatasetBundle:
    """Stage pt with streaming: the shuffled, repeating train stream and map-style eval windows.

    `args` (TrainingArguments) gives the seed and the readers.
    """
    stream = pretrain_stream(data_args, tokenizer, args.seed, readers=readers_of(args), shuffle_files=True)
    report = _stream_report(data_args, stream.n_shards)
    cut = packed_report if data_args.packing else window_report
    evals = {}
    for name in data_args.eval_dataset or []:
        (documents,) = load_documents([name], data_args, tokenizer, report)
        evals[name] = cut(f"eval:{name}", documents, data_args, report)
    train = shuffled(stream, data_args.buffer_size, args.seed)
    return DatasetBundle(train=train, eval=evals, eval_rows={}, report=report)


def build_streaming_supervised(data_args: DataArguments, tokenizer, template, args) -> DatasetBundle:
    """Stage sft with streaming: the shuffled, repeating train stream and map-style eval sets (as pipeline.py)."""
    stream = supervised_stream(data_args, tokenizer, template, args.seed, readers=readers_of(args), shuffle_files=True)
    report = _stream_report(data_args, stream.n_shards)
    encoder = SupervisedEncoder(
        tokenizer=tokenizer, template=template, cutoff_len=data_args.cutoff_len,
        train_on_prompt=data_args.train_on_prompt, mask_history=data_args.mask_history,
        template_vars=data_args.template_kwargs or {},
    )
    eval_rows, evals = {}, {}
    for name in data_args.eval_dataset or []:
        (eval_rows[name],) = load_canonical([name], data_args, report, encoder)
        num_proc = data_args.preprocessing_num_workers
        evals[name], stats = encode_dataset(eval_rows[name], encoder, f"eval:{name}", num_proc)
        report[f"eval:{name}"] = asdict(stats)
        if data_args.packing:  # the trainer has one collator, and it takes packed rows
            evals[name], packing = pack_dataset(evals[name], data_args.cutoff_len)
            report.setdefault("packing", {})[f"eval:{name}"] = packing.as_dict()
    train = shuffled(stream, data_args.buffer_size, args.seed)
    return DatasetBundle(train=train, eval=evals, eval_rows=eval_rows, report=report)
