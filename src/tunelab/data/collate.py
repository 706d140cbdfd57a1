"""Batches from encoded examples: the only place padding happens.

Supervised batches are padded on the right to the longest example (optionally rounded up to a
multiple of `pad_to_multiple_of`): input_ids with the pad id, labels with -100, attention_mask 0.

    input_ids       labels               attention_mask
    [a b c d e]     [-100 -100 c d e]    [1 1 1 1 1]
    [f g h P P]     [-100 g h -100 -100] [1 1 1 0 0]

Packed batches (rows from data/packing.py) keep every sample isolated; the keys depend on how the
model's attention backend gets its block-causal mask (see the packing module docstring):

    attention       keys                                                       padding
    position_ids    input_ids, labels, position_ids (no attention_mask)        to the longest row
    varlen          input_ids, labels, position_ids, cu_seq_lens_q/k,          none: the batch is one
                    max_length_q/k (flash_attention_*; sdpa_varlen also an     flattened row
                    all-ones attention_mask, model/varlen_sdpa.py)
    block_mask      input_ids, labels, position_ids, attention_mask            to the longest row
                    (batch, 1, L, L) additive: 0 allowed, dtype min blocked

Padding is its own pseudo-sample (position ids 0, 1, ... and labels -100), so it is isolated like
any sample: real tokens never attend to it, and it attends only to itself (never an all-masked row).

Padding-free batches (PaddingFreeCollator, the default for unpacked training where the model isolates
packed samples natively) keep the examples of the step and lay them side by side instead of padding
each one: best-fit decreasing into rows as long as the micro-batch's longest example, then the packed
keys above. Eight examples of lengths 512, 90, 60, 40, 30, 25, 25, 20:

    padded          8 rows x 512 = 4,096 positions
    padding-free    2 rows x 512 = 1,024 positions: [512] and [90 60 40 30 25 25 20 + 222 padding]
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch

from tunelab.data.encode import IGNORE_INDEX
from tunelab.data.packing import pack_lengths
from tunelab.errors import ModelError

logger = logging.getLogger(__name__)

PackedAttention = Literal["position_ids", "varlen", "block_mask"]


@dataclass
class SupervisedCollator:
    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        width = _padded_width(examples, self.pad_to_multiple_of)
        lengths = torch.tensor([len(e["input_ids"]) for e in examples])
        return {
            "input_ids": _pad(examples, "input_ids", width, self.pad_token_id),
            "labels": _pad(examples, "labels", width, IGNORE_INDEX),
            "attention_mask": (torch.arange(width)[None, :] < lengths[:, None]).long(),
        }


@dataclass
class PairedCollator:
    """Rows that hold two encoded sequences each (data/pairwise.py) → one padded batch of 2B rows:
    every row's first sequence, then every row's second, padded together as supervised batches are.

        pairs (dpo, rm): first "chosen_", second "rejected_"     rows 0..B-1 chosen, B..2B-1 rejected
        kto:             first "",        second "kl_"           rows 0..B-1 examples, B..2B-1 KL examples

    Every other column (kto_tag, precomputed reference log-probs) becomes a (B,) tensor.

    With `padding_free`, the 2B sequences are laid out as PaddingFreeCollator lays out examples, and
    `sequence_ids` (same shape as input_ids) gives the sequence (0..2B-1, in the order above) that
    owns each position, -1 at padding: per-sequence sums come from it (preference_losses).
    """

    pad_token_id: int
    first: str = "chosen_"
    second: str = "rejected_"
    pad_to_multiple_of: int | None = None
    padding_free: PaddingFreeCollator | None = None  # lay the 2B sequences side by side instead of padding them

    @property
    def attention(self) -> PackedAttention | None:
        """How padding-free batches isolate the sequences; None when padded (attention_mask)."""
        return self.padding_free.attention if self.padding_free is not None else None

    @property
    def sides(self) -> tuple[str, str]:
        return self.first, self.second

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        sequences = [
            {"input_ids": row[f"{prefix}input_ids"], "labels": row[f"{prefix}labels"]}
            for prefix in (self.first, self.second) for row in rows
        ]
        if self.padding_free is not None:
            batch = self.padding_free(sequences, sequence_ids=True)
        else:
            batch = SupervisedCollator(self.pad_token_id, self.pad_to_multiple_of)(sequences)
        sequence_keys = {f"{p}{k}" for p in (self.first, self.second) for k in ("input_ids", "labels")}
        for key in rows[0]:
            if key not in sequence_keys:
                batch[key] = torch.tensor([row[key] for row in rows])
        return batch


def _padded_width(rows: list[dict], multiple: int | None) -> int:
    """The longest row, rounded up to a multiple of `multiple` when asked."""
    longest = max(len(r["input_ids"]) for r in rows)
    return -(-longest // multiple) * multiple if multiple else longest


def _pad(rows: list[dict], key: str, width: int, value: int) -> torch.Tensor:
    """(batch, width) long tensor of rows[i][key], right-padded with `value`."""
    out = torch.full((len(rows), width), value, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row[key])] = torch.as_tensor(row[key], dtype=torch.long)
    return out


@dataclass
class PackedCollator:
    """Batches of packed rows (input_ids, labels, position_ids); `attention` as in the table above."""

    pad_token_id: int
    attention: PackedAttention = "position_ids"
    mask_dtype: torch.dtype = torch.float32  # block_mask: the model's compute dtype (the mask is added to scores)
    pad_to_multiple_of: int | None = None
    # varlen for sdpa_varlen: a 2-D all-ones mask beside cu_seq_lens, so that transformers neither looks for packed
    # rows in the position ids nor builds the (1, 1, L, L) mask the per-sample attention never reads.
    ones_mask: bool = False

    @classmethod
    def for_model(cls, model, pad_token_id: int, pad_to_multiple_of: int | None = None) -> "PackedCollator":
        """The collator whose batches keep samples isolated in this model (PEFT-wrapped or not)."""
        base = _base_model(model)
        attn = getattr(base.config, "_attn_implementation", None) or "eager"
        native = _native(base)
        text_config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
        if getattr(base.config, "use_cache", False) or getattr(text_config, "use_cache", False):
            raise ModelError(
                "packing needs the model's use_cache=False: with a KV cache, packed samples attend to each other"
            )
        if native and takes_varlen(attn):
            attention: PackedAttention = "varlen"
        elif native and attn in ("sdpa", "eager", "flex_attention"):
            attention = "position_ids"
        elif attn in ("sdpa", "eager"):
            attention = "block_mask"
            logger.warning(
                "packing: %s is not transformers' own code; isolating samples with an explicit 4-D block mask, "
                "which this code is trusted (not tested) to honour", type(base).__name__,
            )
        else:
            raise ModelError(
                f"packing: cannot isolate packed samples with attention '{attn}' in {type(base).__name__}; "
                "set flash_attn: sdpa, or packing: false"
            )
        return cls(pad_token_id, attention, mask_dtype=base.dtype, pad_to_multiple_of=pad_to_multiple_of,
                   ones_mask=attn == SDPA_VARLEN)

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor | int]:
        if self.attention == "varlen":
            return self._flattened(rows)
        longest = _padded_width(rows, self.pad_to_multiple_of)
        position_ids = _pad(rows, "position_ids", longest, 0)
        for i, row in enumerate(rows):
            n = len(row["input_ids"])
            position_ids[i, n:] = torch.arange(longest - n)  # padding restarts at 0: a sample of its own
        out: dict[str, torch.Tensor | int] = {
            "input_ids": _pad(rows, "input_ids", longest, self.pad_token_id),
            "labels": _pad(rows, "labels", longest, IGNORE_INDEX),
            "position_ids": position_ids,
        }
        if self.attention == "block_mask":
            out["attention_mask"] = block_causal_mask(position_ids, self.mask_dtype)
        return out

    def _flattened(self, rows: list[dict]) -> dict[str, torch.Tensor | int]:
        def cat(key: str) -> torch.Tensor:
            return torch.as_tensor([v for r in rows for v in r[key]], dtype=torch.long).unsqueeze(0)

        position_ids = cat("position_ids")
        starts = (position_ids[0] == 0).nonzero().flatten()
        cu_seq_lens = torch.cat([starts, torch.tensor([position_ids.shape[1]])]).to(torch.int32)
        max_length = int(cu_seq_lens.diff().max())
        out: dict[str, torch.Tensor | int] = {
            "input_ids": cat("input_ids"), "labels": cat("labels"), "position_ids": position_ids,
            "cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens,
            "max_length_q": max_length, "max_length_k": max_length,
        }
        if self.ones_mask:
            out["attention_mask"] = torch.ones_like(position_ids)
        return out


# tunelab's sdpa run once per sample of a packed row (model/varlen_sdpa.py): it reads the row's boundaries from
# cu_seq_lens_q/k, as flash-attention's varlen kernels do, so its batches are the flattened "varlen" ones.
SDPA_VARLEN = "sdpa_varlen"


def takes_varlen(attn: str) -> bool:
    """Whether this attention implementation isolates samples by cu_seq_lens (one flattened row, no mask)."""
    return attn.startswith("flash_attention") or attn == SDPA_VARLEN


def block_causal_mask(position_ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(batch, 1, L, L) additive mask from restarting position ids: 0 where a token may attend, dtype min elsewhere."""
    sample = (position_ids == 0).cumsum(-1)  # sample number of every token
    same_sample = sample[:, :, None] == sample[:, None, :]
    length = position_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    allowed = (same_sample & causal).unsqueeze(1)
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


@dataclass
class PaddingFreeCollator:
    """Unpacked examples laid side by side (module docstring): the step has the same examples and the
    same supervised tokens as padded batches, so the same loss and gradients (pinned by
    tests/train/test_packed_equivalence.py); it never computes more positions, nor more attention
    pairs, than padding every example to the longest, because no row is longer than that example."""

    packed: PackedCollator

    @property
    def attention(self) -> PackedAttention:
        return self.packed.attention

    def __call__(self, examples: list[dict], sequence_ids: bool = False) -> dict[str, torch.Tensor | int]:
        """The packed batch; with `sequence_ids`, also which example (index into `examples`) owns each
        position, -1 at padding (not a model input: PairedCollator's per-sequence sums need it)."""
        layout = padding_free_layout([len(e["input_ids"]) for e in examples])
        batch = self.packed([side_by_side([examples[i] for i in row]) for row in layout])
        if sequence_ids:
            owners = [[i for i in row for _ in examples[i]["input_ids"]] for row in layout]
            if self.attention == "varlen":  # one flattened row, rows concatenated in order
                owners = [[i for row in owners for i in row]]
            batch["sequence_ids"] = torch.full(batch["input_ids"].shape, -1, dtype=torch.long)
            for r, row in enumerate(owners):
                batch["sequence_ids"][r, : len(row)] = torch.as_tensor(row, dtype=torch.long)
        return batch


def padding_free_layout(lengths: list[int]) -> list[list[int]]:
    """The examples (indices, ascending) of each padding-free row: best-fit decreasing into rows of the longest."""
    return pack_lengths(lengths, max(lengths))


def side_by_side(examples: list[dict]) -> dict[str, list[int]]:
    """One packed row of whole examples: position ids restart per example, and each example's first label
    is -100, as data/packing.py lays rows out (nothing predicts across a boundary)."""
    row: dict[str, list[int]] = {"input_ids": [], "labels": [], "position_ids": []}
    for example in examples:
        ids = list(example["input_ids"])
        row["input_ids"] += ids
        row["labels"] += [IGNORE_INDEX, *list(example["labels"])[1:]]
        row["position_ids"] += range(len(ids))
    return row


def padding_free_support(model) -> str | None:
    """Why this model cannot take padding-free batches by default, or None when it can: only where
    transformers' own modelling code isolates samples natively (position ids or varlen flash
    attention), not through the explicit O(L²) block mask, which would cost more than it saves;
    and only with rotary positions, which restart with the position ids (ALiBi or positions derived
    from the attention mask would not: packing such a model is the user's explicit choice)."""
    base = _base_model(model)
    attn = getattr(base.config, "_attn_implementation", None) or "eager"
    if not _native(base):
        return f"{_model_class(base).__name__} is not transformers' own model code"
    if attn not in ("sdpa", "eager", "flex_attention") and not takes_varlen(attn):
        return f"attention '{attn}' is not known to isolate packed samples"
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    if not (getattr(config, "rope_parameters", None) or getattr(config, "rope_theta", None)):
        return f"{type(base).__name__} has no rotary position embeddings"
    return None


def build_collator(
    model, pad_token_id: int, packing: bool, padding_free: bool | None = False
) -> SupervisedCollator | PackedCollator | PaddingFreeCollator:
    """The training collator of every stage: packed rows need the mechanism that isolates samples in
    this model's attention backend; plain examples go padding-free (None: where the model supports it,
    logged) or padded."""
    if packing:
        return PackedCollator.for_model(model, pad_token_id)
    side_by_side_collator = _padding_free(model, pad_token_id, padding_free)
    return side_by_side_collator if side_by_side_collator is not None else SupervisedCollator(pad_token_id)


def build_paired_collator(
    model, pad_token_id: int, first: str, second: str, padding_free: bool | None = False
) -> PairedCollator:
    """The collator of the pair stages that score sequences by summed log-probs (dpo and relatives, kto):
    padding-free as build_collator decides it for plain examples."""
    return PairedCollator(pad_token_id, first, second, padding_free=_padding_free(model, pad_token_id, padding_free))


def _padding_free(model, pad_token_id: int, padding_free: bool | None) -> PaddingFreeCollator | None:
    """The padding-free collator when asked (True), or by default (None) where the model supports it
    (logged when not); None means pad."""
    if padding_free is None:
        reason = padding_free_support(model)
        if reason is not None:
            logger.info("padding-free batches off (%s): examples are padded to the longest of each batch", reason)
        padding_free = reason is None
    return PaddingFreeCollator(PackedCollator.for_model(model, pad_token_id)) if padding_free else None


def _base_model(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _model_class(base) -> type:
    """The model's own class: FSDP2 (`fully_shard`, model/sharding.py) swaps it for a subclass FSDP<Name> that
    torch makes, whose first base it stays."""
    return next(cls for cls in type(base).__mro__ if not cls.__module__.startswith("torch.distributed.fsdp"))


def _native(base) -> bool:
    # Only transformers' own modelling code is known to read packed position ids (masking_utils).
    return _model_class(base).__module__.startswith("transformers.")
