"""Duplicate training rows, removed before encoding (the `dedup` option): exact and near duplicates.

This module owns what counts as a duplicate and which copy survives:

- exact: two rows whose rendered conversations (the text the template produces, what training
  tokenises) are byte-identical; compared by a 128-bit BLAKE2b hash.
- near: after exact removal, rows whose texts (system, tools and every turn's content; no template
  markup, which every row shares and would make all rows look alike) have an estimated Jaccard
  similarity of lower-cased character 5-grams >= dedup_threshold. MinHash signatures (128
  permutations) and LSH candidate search come from datasketch; every LSH candidate is confirmed on
  the signature estimate, so a removed row is always within the threshold of a kept one.

The training sources are compared together, in order (source by source, row by row), and the first
occurrence is kept, so a row repeated in a later source goes. Deduplication runs before mixing and
before the val split: a duplicate can never sit on both sides of the split, and interleave_over's
deliberate repeats are untouched. eval_dataset sets are not deduplicated.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import datasets
import numpy as np

from tunelab.config.args import DataArguments
from tunelab.errors import ConfigError

logger = logging.getLogger(__name__)

NUM_PERM = 128
MINHASH_SEED = 1
SHINGLE = 5  # characters per shingle
LSH_MAX_THRESHOLD = 0.95
_SPACES = re.compile(r"\s+")


@dataclass
class DedupStats:
    """What deduplication removed, for the run log and data_report.json."""

    mode: str
    rows: int  # training rows before deduplication
    exact: int = 0
    near: int = 0
    threshold: float | None = None  # near only

    @property
    def kept(self) -> int:
        return self.rows - self.exact - self.near

    def summary(self) -> str:
        return f"removed {self.exact} exact, {self.near} near duplicates"

    def as_dict(self) -> dict:
        return {**asdict(self), "kept": self.kept}


def content_text(row: dict) -> str:
    """The words of a canonical row, without template markup: what near-duplicate search compares."""
    parts = [row.get("system") or "", row.get("tools") or ""]
    for message in row["messages"]:
        parts += [message.get("reasoning") or "", message.get("content") or "", message.get("tool_calls") or ""]
    return "\n".join(p for p in parts if p)


def shingles(text: str, size: int = SHINGLE) -> set[str]:
    """Lower-cased character n-grams over whitespace-collapsed text (the whole text when shorter)."""
    text = _SPACES.sub(" ", text.lower()).strip()
    if len(text) <= size:
        return {text}
    return {text[i : i + size] for i in range(len(text) - size + 1)}


def exact_key(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


def _datasketch():
    try:
        import datasketch  # lazy: the dedup extra, which may be missing (config/checks refuses dedup: near without it)
    except ImportError:
        raise ConfigError("dedup: near needs the datasketch package: pip install tunelab[dedup]") from None
    return datasketch


@dataclass
class RowFeatures:
    """Batched map function: each row's exact key and, for near, its MinHash signature. Picklable.

    `render` turns a canonical row into its rendered text (see `rendered_text`).
    """

    render: Callable[[dict], str]
    near: bool
    _empty: Any = field(default=None, init=False, repr=False)

    def signature(self, text: str) -> np.ndarray:
        if self._empty is None:  # drawing the permutations costs more than hashing a row: copy them
            self._empty = _datasketch().MinHash(num_perm=NUM_PERM, seed=MINHASH_SEED)
        minhash = self._empty.copy()
        minhash.update_batch([s.encode("utf-8") for s in shingles(text)])
        return minhash.hashvalues

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        out: dict[str, list] = {"key": [exact_key(self.render(row)) for row in rows]}
        if self.near:
            out["signature"] = [self.signature(content_text(row)).tolist() for row in rows]
        return out


@dataclass(frozen=True)
class RenderedText:
    """The text training tokenises for a row: every example the encoder renders from it, joined."""

    encoder: Any  # SupervisedEncoder

    def __call__(self, row: dict) -> str:
        return "\n\x00".join(text for text, _ in self.encoder.examples(row))


def _lean_minhash(datasketch, values: np.ndarray):
    try:  # datasketch 2.x asks which hash scheme made the values (its default, affine32)
        return datasketch.LeanMinHash(seed=MINHASH_SEED, hashvalues=values, scheme="affine32")
    except TypeError:  # 1.x has a single scheme and no such argument
        return datasketch.LeanMinHash(seed=MINHASH_SEED, hashvalues=values)


def find_duplicates(
    keys: list[bytes], signatures: np.ndarray | None, threshold: float
) -> tuple[np.ndarray, np.ndarray]:
    """Boolean masks (exact, near) over rows in order; the first of each group is neither.

    signatures: (rows, NUM_PERM) MinHash values, or None for exact only.
    """
    exact = np.zeros(len(keys), dtype=bool)
    near = np.zeros(len(keys), dtype=bool)
    seen: set[bytes] = set()
    for i, key in enumerate(keys):
        if key in seen:
            exact[i] = True
        seen.add(key)
    if signatures is None:
        return exact, near
    datasketch = _datasketch()
    # Above ~0.97 the LSH would need fewer than 2 bands; a lower LSH threshold only proposes more candidates.
    lsh = datasketch.MinHashLSH(threshold=min(threshold, LSH_MAX_THRESHOLD), num_perm=NUM_PERM)
    for i in np.flatnonzero(~exact):
        minhash = _lean_minhash(datasketch, signatures[i])
        candidates = lsh.query(minhash)
        # LSH only proposes; the signature estimate decides (no removal below the threshold).
        if any(np.mean(signatures[j] == signatures[i]) >= threshold for j in candidates):
            near[i] = True
        else:
            lsh.insert(int(i), minhash)
    return exact, near


def deduplicate(
    parts: list[datasets.Dataset],
    mode: str,
    render: Callable[[dict], str],
    threshold: float = 0.85,
    num_proc: int | None = None,
) -> tuple[list[datasets.Dataset], DedupStats]:
    """The training sources without their duplicates (first occurrence kept), and the counts."""
    if mode not in ("exact", "near"):
        raise ConfigError(f"dedup: {mode!r} is not one of none, exact, near")
    near_mode = mode == "near"
    if near_mode:
        _datasketch()
    features = [
        part.map(
            RowFeatures(render, near_mode), batched=True, batch_size=256, remove_columns=list(part.column_names),
            num_proc=num_proc, desc="Hashing rows for dedup",
        )
        for part in parts
    ]
    keys = [key for f in features for key in f["key"]]
    signatures = None
    if near_mode:
        signatures = np.concatenate(
            [np.asarray(f.with_format("numpy")["signature"], dtype=np.uint32).reshape(len(f), NUM_PERM) for f in features]
        )
    exact, near = find_duplicates(keys, signatures, threshold)
    stats = DedupStats(
        mode=mode, rows=len(keys), exact=int(exact.sum()), near=int(near.sum()),
        threshold=threshold if near_mode else None,
    )
    drop = exact | near
    kept_parts, start = [], 0
    for part in parts:
        keep = np.flatnonzero(~drop[start : start + len(part)])
        kept_parts.append(part if len(keep) == len(part) else part.select(keep))
        start += len(part)
    return kept_parts, stats


def deduplicate_training_rows(
    parts: list[datasets.Dataset], data_args: DataArguments, encoder: Any
) -> tuple[list[datasets.Dataset], DedupStats]:
    """The pipeline's hook: deduplicate as data_args.dedup says, and log what went."""
    kept, stats = deduplicate(
        parts, data_args.dedup, RenderedText(encoder), data_args.dedup_threshold, data_args.preprocessing_num_workers
    )
    logger.info("dedup (%s): %s of %d training rows", stats.mode, stats.summary(), stats.rows)
    return kept, stats


def check_dedup_available(data_args) -> None:
    """dedup: near needs the datasketch package (the `dedup` extra)."""
    if data_args.dedup == "near" and importlib.util.find_spec("datasketch") is None:
        raise ConfigError("dedup: near needs the datasketch package: pip install tunelab[dedup]")
