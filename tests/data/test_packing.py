"""Bin packing and packed batches: fit, determinism, efficiency, exact row contents, isolation keys."""

from __future__ import annotations

import logging
import random

import datasets
import pytest
import torch
import transformers
from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

from tunelab.data.collate import PackedCollator, block_causal_mask
from tunelab.data.packing import log_packing, pack_dataset, pack_lengths
from tunelab.errors import ModelError


def mixed_lengths(n: int, seed: int = 0) -> list[int]:
    """Chat-like mix: mostly short exchanges, some medium, a few near the cutoff of 2048."""
    rng = random.Random(seed)
    lengths = []
    for _ in range(n):
        u = rng.random()
        low, high = (8, 200) if u < 0.7 else (200, 800) if u < 0.95 else (800, 2048)
        lengths.append(rng.randint(low, high))
    return lengths


def test_best_fit_decreasing_on_a_small_case():
    # Longest first; 2 goes to the bin with free space 2 (not 3), 1 to the bin with free space 1.
    assert pack_lengths([5, 4, 3, 2, 1], 6) == [[0, 4], [1, 3], [2]]


def test_bins_fit_cover_every_sample_once_and_are_deterministic():
    lengths = mixed_lengths(3000)
    bins = pack_lengths(lengths, 2048)
    assert all(sum(lengths[i] for i in b) <= 2048 for b in bins)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert pack_lengths(lengths, 2048) == bins


def test_efficiency_on_a_mixed_set(caplog):
    lengths = mixed_lengths(3000)
    rows = [[7] * n for n in lengths]
    encoded = datasets.Dataset.from_dict({"input_ids": rows, "labels": rows})
    packed, stats = pack_dataset(encoded, 2048)
    assert (stats.samples, stats.tokens, stats.rows) == (3000, sum(lengths), len(packed))
    assert stats.efficiency >= 0.99
    assert stats.as_dict()["efficiency"] == pytest.approx(stats.efficiency, abs=1e-6)
    with caplog.at_level(logging.INFO, logger="tunelab.data.packing"):
        log_packing("train", stats)
    assert f"efficiency {100 * stats.efficiency:.2f}%" in caplog.text


def test_pack_lengths_at_scale_places_every_sample_once_within_capacity():
    # 100k samples (its speed is measured in bench/, not asserted here): a valid, near-optimal packing.
    rng = random.Random(0)
    lengths = [min(2048, int(rng.lognormvariate(5, 1)) + 2) for _ in range(100_000)]
    bins = pack_lengths(lengths, 2048)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert max(sum(lengths[i] for i in b) for b in bins) <= 2048
    # best-fit decreasing needs one bin more than the lower bound ceil(total / capacity) = 11,813 here
    assert (len(bins), -(-sum(lengths) // 2048)) == (11814, 11813)


def test_rows_hold_each_sample_whole_with_restarting_positions_and_a_masked_first_label():
    samples = [  # A: prompt then answer; B: train_on_prompt (label 0 supervised); C; D
        {"input_ids": [10, 11, 12], "labels": [-100, 11, 12]},
        {"input_ids": [20, 21], "labels": [20, 21]},
        {"input_ids": [30, 31], "labels": [-100, 31]},
        {"input_ids": [40, 41, 42, 43], "labels": [-100, -100, 42, 43]},
    ]
    packed, stats = pack_dataset(datasets.Dataset.from_list(samples), cutoff_len=6)
    # D(4) opens row 0, A(3) row 1, B(2) fills row 0 exactly, C(2) joins row 1; samples keep dataset order in a row.
    assert packed.to_list() == [
        {"input_ids": [20, 21, 40, 41, 42, 43], "labels": [-100, 21, -100, -100, 42, 43],
         "position_ids": [0, 1, 0, 1, 2, 3]},
        {"input_ids": [10, 11, 12, 30, 31], "labels": [-100, 11, 12, -100, 31], "position_ids": [0, 1, 2, 0, 1]},
    ]
    assert (stats.rows, stats.tokens) == (2, 11)
    assert stats.efficiency == pytest.approx(11 / 12)


def test_supervised_count_is_unchanged_by_packing():
    lengths = mixed_lengths(200, seed=3)
    rng = random.Random(1)
    rows = []
    for n in lengths:
        ids = [rng.randrange(3, 200) for _ in range(n)]
        rows.append({"input_ids": ids, "labels": [i if rng.random() < 0.5 else -100 for i in ids]})
    packed, _ = pack_dataset(datasets.Dataset.from_list(rows), 2048)
    unpacked_count = sum(sum(label != -100 for label in r["labels"][1:]) for r in rows)  # what the shifted loss sees
    packed_count = sum(sum(label != -100 for label in r["labels"][1:]) for r in packed)
    assert packed_count == unpacked_count


def test_a_sample_longer_than_cutoff_len_is_an_error():
    with pytest.raises(ValueError, match="sample 1 has 7 tokens.*cutoff_len=6"):
        pack_lengths([3, 7], 6)


ROWS = [
    {"input_ids": [5, 6, 7, 8, 9], "labels": [-100, 6, 7, -100, 9], "position_ids": [0, 1, 2, 0, 1]},
    {"input_ids": [3, 4], "labels": [-100, 4], "position_ids": [0, 1]},
]


def test_position_ids_batch_pads_with_an_isolated_pseudo_sample():
    batch = PackedCollator(pad_token_id=0)(ROWS)
    assert set(batch) == {"input_ids", "labels", "position_ids"}  # no attention_mask: it would disable isolation
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9], [3, 4, 0, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9], [-100, 4, -100, -100, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]]


def test_block_mask_batch():
    batch = PackedCollator(pad_token_id=0, attention="block_mask")(ROWS)
    allowed = (batch["attention_mask"] == 0).squeeze(1).int().tolist()
    assert batch["attention_mask"].shape == (2, 1, 5, 5) and batch["attention_mask"].dtype == torch.float32
    assert allowed[0] == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]
    assert allowed[1] == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]
    blocked = block_causal_mask(torch.tensor([[0, 1, 0]]), torch.bfloat16)
    assert blocked.dtype == torch.bfloat16 and blocked[0, 0, 2, 0] == torch.finfo(torch.bfloat16).min


def test_varlen_batch_is_one_flat_row_with_the_cu_seqlens_transformers_would_derive():
    batch = PackedCollator(pad_token_id=0, attention="varlen")(ROWS)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 3, 4]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9, -100, 4]]
    assert batch["cu_seq_lens_q"].tolist() == batch["cu_seq_lens_k"].tolist() == [0, 3, 5, 7]
    assert batch["max_length_q"] == batch["max_length_k"] == 3
    # The same boundaries transformers infers from position ids for a batch of one row (pins its convention).
    (cu_q, _), (max_q, _) = prepare_fa_kwargs_from_position_ids(batch["position_ids"])
    assert cu_q.tolist() == [0, 3, 5, 7] and int(max_q) == 3


def _tiny_llama(**config) -> transformers.LlamaForCausalLM:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, **config,
    ))


@pytest.mark.parametrize(
    ("implementation", "attention"),
    [("sdpa", "position_ids"), ("eager", "position_ids"), ("flash_attention_2", "varlen")],
)
def test_collator_for_model_picks_the_mechanism_of_the_backend(implementation, attention):
    model = _tiny_llama(use_cache=False)
    model.config._attn_implementation = implementation
    assert PackedCollator.for_model(model, 0).attention == attention


def test_collator_for_model_refuses_a_model_with_the_cache_on():
    with pytest.raises(ModelError, match="use_cache=False"):
        PackedCollator.for_model(_tiny_llama(use_cache=True), 0)


class RemoteCodeLlama(transformers.LlamaForCausalLM):
    """Stands for trust_remote_code modelling code: its module is not transformers'."""


def test_collator_for_model_falls_back_to_a_block_mask_for_remote_code(caplog):
    model = RemoteCodeLlama(_tiny_llama(use_cache=False).config)
    with caplog.at_level(logging.WARNING, logger="tunelab.data.collate"):
        collator = PackedCollator.for_model(model, 0)
    assert (collator.attention, collator.mask_dtype) == ("block_mask", torch.float32)
    assert "RemoteCodeLlama is not transformers' own code" in caplog.text
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ModelError, match="flash_attention_2"):
        PackedCollator.for_model(model, 0)
