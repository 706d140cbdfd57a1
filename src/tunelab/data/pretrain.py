"""Stage pt data: raw documents → cleaned → tokenised → one token stream → windows of cutoff_len.

This module owns everything between a text dataset's rows and the (input_ids, labels) windows the
Trainer sees in stage pt. Tokenising and cutting are batched HF datasets maps (Arrow files, cached,
parallel with preprocessing_num_workers):

1. Read. Each registry source (`"formatting": "text"`, or an entry with no formatting at all, as
   LlamaFactory writes its pretraining sets) gives one document per row: a .txt line,
   blank-line-separated paragraph or whole file (`txt_sample_by`), or the text of
   json/jsonl/csv/parquet/arrow rows. The text column: `text_column` (one name or a list), else the
   registry's `columns.text` or `columns.prompt`, else `text` and `content`; with several candidates
   each row takes the first one it has a value in (a JSONL may mix `text` and `content` rows), and
   the documents per column are counted (`documents_by_column`).
2. Clean and tokenise. Strip; tokenise without truncation or padding and without special tokens (a
   document longer than LONG_DOCUMENT_CHARS in pieces of about that size, so one huge document needs memory
   for a piece, not for the whole: see `DocumentTokenizer`);
   drop empty documents and those under `min_length` tokens (BOS/EOS not counted). Both drops are
   counted per source in data_report.json and logged. Every kept document gets EOS appended, and
   starts with BOS when the tokenizer declares one and adds it itself (`tokenizer("x")` starts with
   it: Llama-style models expect every document to begin with it); no real token is ever
   overwritten with one.
3. Mix sources (mix_strategy), hold out val_size documents (a split by document, so no val text is
   trained on), then cut each split's stream into windows.

Windows over the concatenated stream of T tokens, window W = cutoff_len, stride S (default W):

    stream   d0 d0 d0 E d1 d1 E d2 d2 d2 d2 d2 E d3 E        T = 15 tokens (E = eos)
    index     0  1  2 3  4  5 6  7  8  9 10 11 12 13 14
    W=6 S=4  [0  1  2 3  4  5]                               w0: labels = input_ids
                         [4  5  6  7  8  9]                  w1: 4 5 are context (-100)
                                     [8  9 10 11 12 13]      w2: 8 9 are context (-100)
                                                 [12 13 14]  tail: 12 13 context, 14 target

- Full windows start at 0, S, 2S, ...: exactly `(T - W) // S + 1` of them (0 when T < W). The
  count is exact for the whole split: windows are cut from the true concatenation of every
  document (global token offsets, read back from the memory-mapped Arrow file one batch of
  windows at a time), never per map batch, so no window is cut short at a batch boundary.
- Tail: tokens after the last full window (T=15 above: token 14) are kept as one final shorter
  window starting at the next stride step (`tail: keep`, default) or dropped (`tail: drop`),
  their count reported as `dropped_tail_tokens`.
- Labels: input_ids as they are (the loss shifts), except that a token already inside the previous
  window is context only, label -100. So with S < W every token of the stream but the first is a
  target exactly once, whatever the overlap (tail: keep). With S = W there is no overlap, and the
  first token of each window is not a target (nothing precedes it in the window), as in any chunking.
- Windows cross document boundaries (documents are separated by EOS only); attention is not
  isolated between documents here, as in standard concatenated pretraining.

With `packing: true` documents are not concatenated: each document (+ EOS) is cut into chunks of
at most cutoff_len, and the chunks are packed into rows with isolation (data/packing.py), so a
token attends only to its own document and positions restart per document. Loss and gradients then
equal training on every chunk as a row of its own (tested), with a fraction of the padding.
"""

from __future__ import annotations

import logging
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import datasets
import numpy as np
from datasets.fingerprint import Hasher

from tunelab.config.args import DataArguments
from tunelab.data.encode import IGNORE_INDEX, PieceTokenizer
from tunelab.config.metric_names import VAL_SPLIT_NAME
from tunelab.data.packing import log_packing, pack_dataset
from tunelab.data.pipeline import DatasetBundle, mix_sources, split_validation
from tunelab.data.dataset_files import describe, load_rows
from tunelab.data.registry import DatasetSpec, load_registry
from tunelab.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

DEFAULT_TEXT_COLUMNS = ("text", "content")
# Documents longer than this many characters are tokenised piece by piece (bounded memory; every token is kept).
LONG_DOCUMENT_CHARS = 1 << 20
_WORD_START = re.compile(r"(?<=\S) (?=\S)")
_SEAM_WINDOW = 2000  # characters each side of a cut, tokenised whole and cut to check the cut changes no token
TOKENIZE_BATCH = 1000  # documents per tokeniser call
WINDOW_BATCH = 256  # windows cut per map batch: bounds the tokens read back at once to ~256 * stride + W


@dataclass
class DocumentStats:
    """What cleaning did to one source."""

    documents: int = 0  # rows read
    kept: int = 0
    dropped_empty: int = 0  # empty after stripping
    dropped_short: int = 0  # fewer than min_length tokens
    tokens: int = 0  # tokens of the kept documents, BOS/EOS included
    documents_by_column: dict[str, int] = field(default_factory=dict)  # kept documents per text column


@dataclass
class WindowPlan:
    """Where every window of a stream of `total_tokens` tokens starts and ends, before reading any token.

    Window i covers stream positions [starts[i], ends[i]); positions before first_targets[i] were
    already in window i-1 and get label -100.
    """

    starts: np.ndarray
    ends: np.ndarray
    first_targets: np.ndarray
    total_tokens: int
    full_windows: int
    tail_tokens: int  # tokens after the last full window
    tail_kept: bool

    @property
    def windows(self) -> int:
        return len(self.starts)

    @property
    def dropped_tail_tokens(self) -> int:
        return 0 if self.tail_kept else self.tail_tokens

    @property
    def target_tokens(self) -> int:
        """Positions the loss trains on: labels != -100, the first position of a window excluded."""
        return int(np.sum(self.ends - np.maximum(self.first_targets, self.starts + 1)))


def plan_windows(total_tokens: int, window: int, stride: int, tail: str = "keep") -> WindowPlan:
    """Window boundaries over a stream of `total_tokens`: `(T - W) // S + 1` full windows, then the tail."""
    full = (total_tokens - window) // stride + 1 if total_tokens >= window else 0
    starts = np.arange(full, dtype=np.int64) * stride
    ends = starts + window
    # A window's targets begin where the previous window ended (stride <= window, so no gap).
    first_targets = np.concatenate([np.zeros(min(full, 1), dtype=np.int64), ends[:-1]])
    covered = int(ends[-1]) if full else 0
    tail_tokens = total_tokens - covered
    keep_tail = tail == "keep" and tail_tokens > 0
    if keep_tail:
        starts = np.append(starts, full * stride)
        ends = np.append(ends, total_tokens)
        first_targets = np.append(first_targets, covered)
    return WindowPlan(starts, ends, first_targets, total_tokens, full, tail_tokens, tail == "keep")


def resolve_text_columns(
    spec: DatasetSpec, column_names: list[str], configured: list[str] | str | None
) -> tuple[str, ...]:
    """The candidate columns of a source's documents, in order: text_column, the registry's columns, then
    whichever of text/content the rows have. Every named candidate must exist unless it is a default."""
    if isinstance(configured, str):
        configured = [configured]
    mapped = spec.columns.get("text") or spec.columns.get("prompt")
    if configured or mapped:
        names = list(configured) if configured else [mapped]
        missing = [column for column in names if column not in column_names]
        if missing:
            key = "text_column" if configured else f"columns of '{spec.name}' in dataset_info.json"
            raise DataError(
                f"dataset '{spec.name}': no column '{missing[0]}' ({key}); columns: {', '.join(column_names)}; "
                "set text_column to the column holding the documents"
            )
        return tuple(names)
    found = tuple(column for column in DEFAULT_TEXT_COLUMNS if column in column_names)
    if not found:
        raise DataError(
            f"dataset '{spec.name}': no 'text' or 'content' column (columns: {', '.join(column_names)}); "
            "set text_column to the column holding the documents"
        )
    return found


def document_bos_id(tokenizer: Any) -> int | None:
    """The BOS id every document starts with: the tokenizer's, when it declares one and adds it itself
    (``tokenizer("x")`` starts with it, as Llama's does); None otherwise."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return None
    plain = tokenizer("x", add_special_tokens=False)["input_ids"]
    special = tokenizer("x", add_special_tokens=True)["input_ids"]
    return bos if special[:1] == [bos] and plain[:1] != [bos] else None


@dataclass(frozen=True)
class DocumentTokenizer:
    """Batched map function: pick the text, strip, tokenise, drop empty/short (length 0 rows, filtered
    after), add BOS (bos_token_id, when set) and EOS. Outputs input_ids, length (of input_ids), num_tokens
    (text tokens, for min_length) and text_column (which candidate column the text came from; -1 for none).

    Picklable, so datasets.map can run it in worker processes.

    A document longer than LONG_DOCUMENT_CHARS is cut before word starts (" x") into pieces of about that size,
    each tokenised as the text that follows the previous one (encode.py's `PieceTokenizer`); the ids are the whole
    document's when every cut changes nothing, which is checked: the text around each cut is tokenised whole and
    cut, and on any difference the document is tokenised whole after all (exact first, bounded where it can be).
    A piece's encoding (ids, offsets, token strings: tens of bytes a token) is freed before the next one.
    """

    tokenizer: Any
    text_columns: tuple[str, ...]
    min_length: int
    source: str
    bos_token_id: int | None = None
    _tokens: PieceTokenizer = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self):
        object.__setattr__(self, "_tokens", PieceTokenizer(self.tokenizer))

    def _long_ids(self, text: str) -> np.ndarray:
        """A long document's ids (an int64 array, 8 bytes a token instead of a Python int's 28 + 8), tokenised in
        pieces when cutting changes no token (else whole)."""
        cuts, at = [], LONG_DOCUMENT_CHARS
        while at < len(text):
            match = _WORD_START.search(text, at)
            if match is None:
                break
            cuts.append(match.start())
            at = match.start() + LONG_DOCUMENT_CHARS
        for cut in cuts:  # the pieces must meet as the whole text's tokens do
            start = _WORD_START.search(text, max(cut - _SEAM_WINDOW, 0))
            start = start.start() if start is not None and start.start() < cut else cut
            end = _WORD_START.search(text, min(cut + _SEAM_WINDOW, len(text)))
            end = end.start() if end is not None else len(text)
            whole = self._tokens([(text[start:end], True)])[0]
            parts = self._tokens([(text[start:cut], True), (text[cut:end], False)])
            if start == cut or whole != parts[0] + parts[1]:
                return np.asarray(self._tokens([(text, True)])[0], dtype=np.int64)
        pieces = [np.asarray(self._tokens([(text[begin:finish], begin == 0)])[0], dtype=np.int64)
                  for begin, finish in zip([0, *cuts], [*cuts, len(text)])]
        return np.concatenate(pieces)

    @property
    def special_tokens(self) -> int:
        """Tokens added to every kept document (EOS, and BOS when set)."""
        return 1 + (self.bos_token_id is not None)

    def _pick(self, values: tuple[Any, ...]) -> tuple[str, int]:
        for index, value in enumerate(values):
            if value is None:
                continue
            if not isinstance(value, str):
                raise DataError(
                    f"dataset '{self.source}': column '{self.text_columns[index]}' holds {type(value).__name__} "
                    "values, not text; set text_column to the column holding the documents"
                )
            if value.strip():
                return value.strip(), index
        return "", -1

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        picked = [self._pick(values) for values in zip(*(batch[column] for column in self.text_columns))]
        present = [text for text, _ in picked if text and len(text) <= LONG_DOCUMENT_CHARS]
        # verbose=False: documents longer than model_max_length are expected here, not a warning.
        encoded = iter(self.tokenizer(present, add_special_tokens=False, verbose=False)["input_ids"] if present else [])
        eos = self.tokenizer.eos_token_id
        bos = [] if self.bos_token_id is None else [self.bos_token_id]
        # A batch with a long document gives arrays for every row: arrow refuses a column that mixes arrays and
        # lists (an empty list reads as float), and int64 is the lists' own type, so batches agree.
        arrays = any(len(text) > LONG_DOCUMENT_CHARS for text, _ in picked)
        input_ids, num_tokens = [], []
        for text, _ in picked:
            if len(text) > LONG_DOCUMENT_CHARS:
                ids = self._long_ids(text)
            else:
                ids = list(next(encoded)) if text else []
            keep = len(ids) >= max(self.min_length, 1)
            if arrays:
                row = np.concatenate([np.asarray(bos, np.int64), np.asarray(ids, np.int64), [eos]]) if keep else []
                input_ids.append(np.asarray(row, dtype=np.int64))
            else:
                input_ids.append(bos + ids + [eos] if keep else [])
            num_tokens.append(len(ids))
        return {
            "input_ids": input_ids, "length": [len(ids) for ids in input_ids], "num_tokens": num_tokens,
            "text_column": [index for _, index in picked],
        }


def _int_column(dataset: datasets.Dataset, name: str) -> np.ndarray:
    return np.asarray(dataset.select_columns([name]).with_format("numpy")[:][name], dtype=np.int64)


def keep_document(num_tokens: list[int], min_length: int) -> list[bool]:
    """A batch's filter: the documents of at least min_length tokens (and never an empty one)."""
    return [n >= max(min_length, 1) for n in num_tokens]


def tokenize_documents(
    rows: datasets.Dataset, spec: DatasetSpec, tokenizer, data_args: DataArguments
) -> tuple[datasets.Dataset, DocumentStats]:
    """Cleaned, tokenised documents of one source (columns input_ids, length, num_tokens) and the cleaning counts."""
    columns = resolve_text_columns(spec, list(rows.column_names), data_args.text_column)
    function = DocumentTokenizer(tokenizer, columns, data_args.min_length, spec.name, document_bos_id(tokenizer))
    reuse = False if data_args.overwrite_cache else None  # None: datasets' own caching default
    tokenized = rows.map(
        function, batched=True, batch_size=TOKENIZE_BATCH, remove_columns=list(rows.column_names),
        num_proc=data_args.preprocessing_num_workers, load_from_cache_file=reuse, desc=f"Tokenising {spec.name}",
    )
    num_tokens = _int_column(tokenized, "num_tokens")
    kept = num_tokens >= max(data_args.min_length, 1)
    by_column = np.bincount(_int_column(tokenized, "text_column")[kept], minlength=len(columns))
    stats = DocumentStats(
        documents=len(num_tokens), kept=int(kept.sum()), dropped_empty=int((num_tokens == 0).sum()),
        dropped_short=int(((num_tokens > 0) & ~kept).sum()),
        tokens=int((num_tokens[kept] + function.special_tokens).sum()),
        documents_by_column={column: int(count) for column, count in zip(columns, by_column)},
    )
    tokenized = tokenized.remove_columns("text_column")
    if stats.kept < stats.documents:
        tokenized = tokenized.filter(
            keep_document, input_columns="num_tokens", batched=True, fn_kwargs={"min_length": data_args.min_length},
            num_proc=data_args.preprocessing_num_workers, load_from_cache_file=reuse,
            desc=f"Dropping empty/short documents of {spec.name}",
        )
    return tokenized, stats


@dataclass(frozen=True)
class WindowGather:
    """Batched map function over planned windows: reads the documents they span, slices tokens, masks overlap.

    `offsets[i]` is document i's first position in the stream (len = documents + 1). One batch of
    consecutive windows reads one contiguous range of documents from the (memory-mapped) dataset.
    """

    documents: datasets.Dataset
    offsets: np.ndarray

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        starts, ends, firsts = (np.asarray(batch[key], dtype=np.int64) for key in ("start", "end", "first_target"))
        first_doc = int(np.searchsorted(self.offsets, starts.min(), side="right")) - 1
        end_doc = int(np.searchsorted(self.offsets, ends.max(), side="left"))
        table = self.documents.with_format("arrow")[first_doc:end_doc]
        stream = table["input_ids"].combine_chunks().flatten().to_numpy()
        base = int(self.offsets[first_doc])
        input_ids, labels = [], []
        for start, end, first in zip(starts, ends, firsts):
            ids = stream[start - base : end - base]
            target = ids.copy()
            target[: first - start] = IGNORE_INDEX
            input_ids.append(ids)
            labels.append(target)
        return {"input_ids": input_ids, "labels": labels}


def cut_windows(
    documents: datasets.Dataset, data_args: DataArguments, name: str
) -> tuple[datasets.Dataset, WindowPlan]:
    """Windows (input_ids, labels) over the concatenation of `documents`, exactly as plan_windows places them."""
    window = data_args.cutoff_len
    stride = data_args.stride or window
    offsets = np.concatenate([[0], np.cumsum(_int_column(documents, "length"))]).astype(np.int64)
    plan = plan_windows(int(offsets[-1]), window, stride, data_args.tail)
    if plan.windows == 0:
        raise DataError(
            f"{name}: all {plan.total_tokens} tokens are fewer than cutoff_len={window} and tail: drop drops them; "
            "set tail: keep or lower cutoff_len"
        )
    fingerprint = Hasher.hash(["pt-windows-v2", documents._fingerprint, window, stride, data_args.tail])
    cache_file = None
    if documents.cache_files:  # file-backed sources: windows go to an Arrow file beside the documents, not RAM
        cache_file = str(Path(documents.cache_files[0]["filename"]).parent / f"pt-windows-{fingerprint}.arrow")
    starts = datasets.Dataset.from_dict(
        {"start": plan.starts, "end": plan.ends, "first_target": plan.first_targets}
    )
    windows = starts.map(
        WindowGather(documents, offsets), batched=True, batch_size=WINDOW_BATCH,
        remove_columns=["start", "end", "first_target"], num_proc=data_args.preprocessing_num_workers,
        new_fingerprint=fingerprint, cache_file_name=cache_file,
        load_from_cache_file=not data_args.overwrite_cache, desc=f"Cutting {name} into windows",
    )
    return windows, plan


def load_documents(
    names: list[str], data_args: DataArguments, tokenizer, report: dict
) -> list[datasets.Dataset]:
    registry = load_registry(data_args.dataset_dir)
    loaded = []
    for name in names:
        spec = registry[name]
        rows = load_rows(spec, txt_sample_by=data_args.txt_sample_by)
        if data_args.max_samples is not None and len(rows) > data_args.max_samples:
            rows = rows.select(range(data_args.max_samples))
        documents, stats = tokenize_documents(rows, spec, tokenizer, data_args)
        report.setdefault("sources", []).append({**describe(spec), **asdict(stats)})
        if stats.kept < stats.documents:
            logger.warning(
                "dataset %s: dropped %d of %d documents: %d empty, %d shorter than min_length=%d tokens",
                name, stats.documents - stats.kept, stats.documents, stats.dropped_empty, stats.dropped_short,
                data_args.min_length,
            )
        if stats.kept == 0:
            raise DataError(
                f"dataset '{name}': no usable documents (all {stats.documents} were empty or shorter than "
                f"min_length={data_args.min_length} tokens); check text_column or lower min_length"
            )
        loaded.append(documents)
    return loaded


def window_report(name: str, documents: datasets.Dataset, data_args: DataArguments, report: dict) -> datasets.Dataset:
    """A dataset's documents cut into cutoff_len windows (stride, tail), its counts written to report[name]."""
    windows, plan = cut_windows(documents, data_args, name)
    stride = data_args.stride or data_args.cutoff_len
    report[name] = {
        "documents": len(documents), "tokens": plan.total_tokens, "window": data_args.cutoff_len, "stride": stride,
        "windows": plan.windows, "full_windows": plan.full_windows, "tail": data_args.tail,
        "tail_tokens": plan.tail_tokens, "dropped_tail_tokens": plan.dropped_tail_tokens,
        "target_tokens": plan.target_tokens,
    }
    logger.info(
        "%s: %d documents, %d tokens → %d windows of cutoff_len=%d, stride %d (%d full + tail of %d tokens %s); "
        "%d target tokens",
        name, len(documents), plan.total_tokens, plan.windows, data_args.cutoff_len, stride, plan.full_windows,
        plan.tail_tokens, "kept" if plan.tail_kept else "dropped", plan.target_tokens,
    )
    if plan.dropped_tail_tokens:
        logger.warning("%s: tail: drop dropped the last %d tokens of the stream", name, plan.dropped_tail_tokens)
    return windows


def document_chunks(documents: datasets.Dataset, cutoff_len: int) -> datasets.Dataset:
    """Each document's tokens (EOS included) cut into consecutive chunks of at most cutoff_len; labels = ids."""

    def chunk(batch: dict[str, list]) -> dict[str, list]:
        pieces = [ids[i : i + cutoff_len] for ids in batch["input_ids"] for i in range(0, len(ids), cutoff_len)]
        return {"input_ids": pieces, "labels": pieces}

    return documents.map(
        chunk, batched=True, remove_columns=documents.column_names, desc="Cutting documents for packing"
    )


def packed_report(name: str, documents: datasets.Dataset, data_args: DataArguments, report: dict) -> datasets.Dataset:
    """A dataset's documents cut into chunks and packed into cutoff_len rows, its counts written to report[name]."""
    chunks = document_chunks(documents, data_args.cutoff_len)
    rows, stats = pack_dataset(chunks, data_args.cutoff_len)
    report[name] = {"documents": len(documents), "chunks": len(chunks), "packing": stats.as_dict()}
    log_packing(name, stats)
    return rows


def build_pretrain_datasets(data_args: DataArguments, tokenizer, seed: int) -> DatasetBundle:
    """Train and eval windows for stage pt, with a report of every count (sources, cleaning, windows)."""
    if tokenizer.eos_token_id is None:
        raise ConfigError(
            "model_name_or_path: the tokenizer has no eos_token, which stage pt puts after every document; "
            "add eos_token to its tokenizer_config.json"
        )
    report: dict[str, Any] = {}
    train_docs = mix_sources(load_documents(data_args.dataset or [], data_args, tokenizer, report), data_args, seed)
    eval_docs: dict[str, datasets.Dataset] = {}
    if data_args.val_size > 0:  # split by whole documents: no val text is trained on
        train_docs, eval_docs[VAL_SPLIT_NAME] = split_validation(train_docs, data_args.val_size, seed, "documents")
    for name in data_args.eval_dataset or []:
        (eval_docs[name],) = load_documents([name], data_args, tokenizer, report)

    cut = packed_report if data_args.packing else window_report
    train = cut("train", train_docs, data_args, report)
    evals = {name: cut(f"eval:{name}", docs, data_args, report) for name, docs in eval_docs.items()}
    return DatasetBundle(train=train, eval=evals, eval_rows={}, report=report)
