"""A run's data as `tunelab data stats|verify|coverage` inspect it (data/stats.py, verify.py, coverage.py): the
stage's encoded samples (before packing), the packed rows when packing with each row's sample lengths, the
collator the stage's trainer uses, and the length arrays the three read.

The stage's recipe (train/recipe.py: `Recipe.inspection`) fills it with exactly what its trainer would get, from
the tokenizer alone (a model skeleton on the meta device chooses the collator; no weights load). A pair row holds
two sequences (`RunData.sides`: chosen_/rejected_, kto: the example and its KL example), which the inspections
count as sequences, batched as PairedCollator batches them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import datasets
import numpy as np
import pyarrow.compute as pc

from tunelab.config.args import RunConfig
from tunelab.data.encode import IGNORE_INDEX
from tunelab.data.packing import PackingStats, pack_dataset, pack_lengths


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
    collator: Any = None  # the collator the stage's trainer batches with
    vocab_size: int | None = None  # the model's (config.json): every input id must be below it

    @property
    def splits(self) -> dict[str, datasets.Dataset]:
        return {"train": self.train, **{f"eval:{name}": ds for name, ds in self.evals.items()}}


@dataclass
class PackedRows:
    rows: datasets.Dataset
    stats: PackingStats
    sample_lengths: list[list[int]]  # per row: the lengths of the samples it holds, in order


def pack_rows(samples: datasets.Dataset, cutoff_len: int) -> PackedRows:
    """pack_dataset's rows, with the sample lengths of each row (pack_lengths places them the same way)."""
    rows, stats = pack_dataset(samples, cutoff_len)
    lengths = token_lengths(samples).tolist()
    bins = pack_lengths(lengths, cutoff_len)
    return PackedRows(rows, stats, [[lengths[i] for i in b] for b in bins])


def flat_column(dataset: datasets.Dataset, column: str) -> tuple[np.ndarray, np.ndarray]:
    """(per-row lengths, all values flattened) of a list column, without a Python loop over rows."""
    values = dataset.select_columns([column]).with_format("arrow")[:].column(column)
    lengths = pc.list_value_length(values).to_numpy().astype(np.int64)
    return lengths, pc.list_flatten(values).to_numpy().astype(np.int64)


def token_lengths(dataset: datasets.Dataset, column: str = "input_ids") -> np.ndarray:
    return flat_column(dataset, column)[0]


def supervised_counts(dataset: datasets.Dataset, column: str = "labels") -> np.ndarray:
    """Per sample, the positions that reach the loss: labels != -100, the first position excluded (the loss shifts)."""
    lengths, labels = flat_column(dataset, column)
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


def batch_order(count: int, strategy: str, seed: int) -> np.ndarray:
    """Sample order of an epoch: as stored for a sequential sampler, else a seeded shuffle (like the
    Trainer's random sampler: the same statistics, not its exact order)."""
    if strategy == "sequential":
        return np.arange(count)
    return np.random.default_rng(seed).permutation(count)
