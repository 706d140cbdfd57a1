"""Packing: several encoded samples per row of cutoff_len, each one isolated from the others.

Bin packing is best-fit decreasing: samples are taken longest first (ties by index) and each goes to
the open row with the least space that still fits it, else to a new row. It is deterministic, and
on chat-like length mixes it fills > 99% of the rows' tokens (PackingStats.efficiency, logged).

A row of three samples A (3 tokens), B (2) and C (2):

    input_ids      a0   a1   a2   b0   b1   c0   c1
    position_ids    0    1    2    0    1    0    1     restart per sample: each sees positions as if alone
    labels         -100 a1   a2  -100 b1  -100 c1      first label of every sample -100: nothing is
                                                       predicted across a boundary (b1 never predicts c0)

    block-causal mask, query rows x key columns (1: may attend):

              a0 a1 a2 b0 b1 c0 c1
         a0 [ 1  .  .  .  .  .  . ]
         a1 [ 1  1  .  .  .  .  . ]
         a2 [ 1  1  1  .  .  .  . ]
         b0 [ .  .  .  1  .  .  . ]
         b1 [ .  .  .  1  1  .  . ]
         c0 [ .  .  .  .  .  1  . ]
         c1 [ .  .  .  .  .  1  1 ]

With those labels a packed row has exactly the supervised tokens of its samples unpacked (there,
label 0 of a sample is dropped by the shift), so the step-normalised loss is unchanged.

How the mask is obtained, per attention backend (PackedCollator builds the batch; transformers 5.x,
pinned by tests/train/test_packed_equivalence.py, which also pins that the conditions below matter):

- sdpa, eager, flex_attention (model code shipped with transformers): position ids only. In
  `masking_utils._preprocess_mask_arguments`, `find_packed_sequence_indices(position_ids)` splits a
  row wherever consecutive position ids do not step by +1, and `create_causal_mask` ANDs "same
  sequence" into the causal mask — but only when all of: position_ids is passed, attention_mask is
  None (a 2-D all-ones mask disables it), and there is no KV cache (use_cache=False; with the cache
  on, a DynamicCache is created and detection is skipped). The model still materialises a
  (batch, 1, L, L) mask for sdpa/eager (bool / dtype-sized), as the block mask below would.
- sdpa_varlen (what tunelab trains transformers' own text models with where transformers picks sdpa,
  model/varlen_sdpa.py): the flattened row of flash-attention below, plus an all-ones 2-D attention
  mask, which turns the detection above off and lets transformers skip the L² mask; the attention
  function runs sdpa once per sample between the cu_seq_lens boundaries (is_causal), so the pairs
  the block mask would discard are never computed.
- flash_attention_2/3/4: transformers infers cu_seqlens from position ids only for a batch of one
  row (`_is_packed_sequence` needs batch_size == 1), so the collator flattens the batch into one
  row and passes `cu_seq_lens_q/k` and `max_length_q/k`, which `_flash_attention_forward` hands to
  the varlen kernel directly. No mask, no padding.
- anything else it can still serve (sdpa/eager in trust_remote_code models, which may not read
  packed position ids): an explicit 4-D additive block-causal mask, which `create_causal_mask`
  passes through untouched, as most older mask code does. It costs batch × L² elements of the
  model dtype (L=4096, batch 8, bf16: 256 MiB) and keeps sdpa off its flash kernel.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import asdict, dataclass
from typing import Sequence

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets.fingerprint import generate_random_fingerprint

from tunelab.data.encode import IGNORE_INDEX

logger = logging.getLogger(__name__)


@dataclass
class PackingStats:
    """What packing did to a dataset, for the run log and data_report.json."""

    samples: int
    rows: int
    tokens: int
    cutoff_len: int

    @property
    def efficiency(self) -> float:
        """Real tokens over row capacity: 1.0 means no padding at all."""
        return self.tokens / max(self.rows * self.cutoff_len, 1)

    def as_dict(self) -> dict:
        return {**asdict(self), "efficiency": round(self.efficiency, 6)}


def pack_lengths(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: bins of sample indices (ascending within a bin), each summing to <= capacity."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    # Open bins grouped by their exact free space; `spaces` keeps the distinct free spaces sorted, so
    # the tightest fit is one bisect (at most capacity distinct values, whatever the sample count).
    open_bins: dict[int, list[int]] = {}
    spaces: list[int] = []
    for i in order:
        need = int(lengths[i])
        if not 1 <= need <= capacity:
            raise ValueError(
                f"sample {i} has {need} tokens, outside 1..cutoff_len={capacity}; encoding should have truncated it"
            )
        k = bisect.bisect_left(spaces, need)
        if k == len(spaces):
            target, free = len(bins), capacity
            bins.append([])
        else:
            free = spaces[k]
            stack = open_bins[free]
            target = stack.pop()
            if not stack:
                del open_bins[free]
                spaces.pop(k)
        bins[target].append(i)
        left = free - need
        if left:
            if left not in open_bins:
                open_bins[left] = []
                bisect.insort(spaces, left)
            open_bins[left].append(target)
    return [sorted(b) for b in bins]


def pack_dataset(encoded: datasets.Dataset, cutoff_len: int) -> tuple[datasets.Dataset, PackingStats]:
    """Rows of input_ids, labels and position_ids (restarting per sample), each at most cutoff_len long.

    Only input_ids and labels are read; other columns do not survive packing, except a vision run's `images`
    (data/vision.py): a row holds its samples' images in the order of the samples, so the image features the
    model places at a row's image tokens (in order) are each sample's own.
    """
    table = encoded.select_columns(["input_ids", "labels"]).with_format("arrow")[:]
    # Chunked columns straight to numpy (combine_chunks would copy every token once more).
    ids_col, labels_col = table.column("input_ids"), table.column("labels")
    lengths = pc.list_value_length(ids_col).to_numpy().astype(np.int64)
    if not np.array_equal(lengths, pc.list_value_length(labels_col).to_numpy()):
        raise ValueError("pack_dataset: input_ids and labels differ in length in some sample")
    flat_ids = pc.list_flatten(ids_col).to_numpy()
    flat_labels = pc.list_flatten(labels_col).to_numpy()

    bins = pack_lengths(lengths.tolist(), cutoff_len)
    order = np.fromiter((i for b in bins for i in b), dtype=np.int64, count=len(lengths))
    src_starts = np.cumsum(lengths) - lengths
    out_lengths = lengths[order]
    out_starts = np.cumsum(out_lengths) - out_lengths
    total = int(out_lengths.sum())
    # Token j of the output comes from source token (its sample's source start + its offset in the sample).
    offset_in_sample = np.arange(total, dtype=np.int64) - np.repeat(out_starts, out_lengths)
    gather = np.repeat(src_starts[order], out_lengths) + offset_in_sample
    labels = flat_labels[gather]
    labels[out_starts] = IGNORE_INDEX  # the first token of a sample is never a target of the one before

    token_ends = np.concatenate(([0], np.cumsum(out_lengths)))
    sample_ends = np.cumsum([0] + [len(b) for b in bins])
    row_offsets = pa.array(token_ends[sample_ends], type=pa.int64())

    def column(values: np.ndarray) -> pa.LargeListArray:
        return pa.LargeListArray.from_arrays(row_offsets, pa.array(values))

    columns = {
        "input_ids": column(flat_ids[gather]),
        "labels": column(labels),
        "position_ids": column(offset_in_sample.astype(np.int32)),
    }
    if "images" in encoded.column_names:
        images = encoded.select_columns(["images"]).with_format("arrow")[:].column("images").combine_chunks()
        taken = images.take(pa.array(order))  # samples in packed order, then concatenated per row
        columns["images"] = pa.ListArray.from_arrays(
            pa.array(np.concatenate(([0], np.cumsum(pc.list_value_length(taken).to_numpy())))[sample_ends].astype(np.int32)),
            taken.flatten(),
        )
    table = pa.table(columns)
    # A given fingerprint spares datasets from hashing every token (over a second per 10M tokens).
    packed = datasets.Dataset(table, fingerprint=generate_random_fingerprint())
    stats = PackingStats(samples=len(lengths), rows=len(bins), tokens=total, cutoff_len=cutoff_len)
    return packed, stats


def log_packing(name: str, stats: PackingStats) -> None:
    logger.info(
        "%s: packed %d samples into %d rows of %d tokens, efficiency %.2f%%",
        name, stats.samples, stats.rows, stats.cutoff_len, 100 * stats.efficiency,
    )
