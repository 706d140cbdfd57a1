"""`tunelab data coverage`: the UNK rate, ids outside the model's vocab_size (config.json), and the characters the
tokenizer can only spell as several byte pieces; on the run's data (data/run_data.py).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from tunelab.config.stages import stage_row
from tunelab.data.encode import IGNORE_INDEX
from tunelab.data.run_data import RunData, flat_column

TOP_CHARACTERS = 20
_BYTE_PIECE = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")  # SentencePiece byte-fallback tokens


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
    pt = stage_row(data.config.finetuning.stage).reads == "text"
    for side in data.sides or ("",):
        for sample in data.train.select_columns([f"{side}input_ids", f"{side}labels"]):  # row by row: lazy
            ids, labels = sample[f"{side}input_ids"], sample[f"{side}labels"]
            if pt:
                ids = ids[next((t for t, label in enumerate(labels) if label != IGNORE_INDEX), len(ids)) :]
            yield data.tokenizer.decode(ids, skip_special_tokens=True)


def coverage_report(data: RunData) -> list[str]:
    """The `tunelab data coverage` output for the training samples."""
    tokenizer = data.tokenizer
    vocab_size = data.vocab_size
    flat = np.concatenate([flat_column(data.train, f"{side}input_ids")[1] for side in data.sides or ("",)])
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
