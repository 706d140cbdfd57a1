"""data/stats.py, verify.py, coverage.py (on data/run_data.py): stats on hand-computed numbers, verify_batch's exact messages, coverage of byte pieces."""

from __future__ import annotations

import datasets
import numpy as np
import pytest
import torch

from tunelab.config.args import DataArguments
from tunelab.data.collate import PackedCollator, PaddingFreeCollator, PairedCollator, SupervisedCollator
from tunelab.data.coverage import byte_piece_kind, id_coverage, split_characters
from tunelab.data.run_data import batch_order, in_batches, pack_rows, supervised_counts
from tunelab.data.stats import histogram, histogram_lines, length_stats, padded_slots, padding_free_slots, source_line
from tunelab.data.verify import verify_batch, verify_split
from tunelab.data.pipeline import build_datasets
from tunelab.data.templates import get_template

IGNORE = -100


# ---- stats


def test_length_stats_on_a_hand_computed_example() -> None:
    # Batches of 2 in this order: [2, 4] -> 2 x 4 slots, [4, 5] -> 2 x 5, [10] -> 1 x 10: 28 slots.
    stats = length_stats([2, 4, 4, 5, 10], [1, 2, 2, 3, 4], cutoff_len=10, batch_size=2)
    assert (stats.count, stats.min, stats.max, stats.tokens, stats.supervised) == (5, 2, 10, 25, 12)
    assert stats.mean == 5.0
    assert stats.median == 4.0
    assert stats.p95 == pytest.approx(9.0)  # sorted index 0.95 * 4 = 3.8: 5 + 0.8 * (10 - 5)
    assert stats.padded_to_longest == 28
    assert stats.utilisation_longest == pytest.approx(25 / 28)
    assert stats.utilisation_cutoff == pytest.approx(25 / 50)
    assert stats.supervised_share == pytest.approx(12 / 25)


def test_padded_slots_and_batch_order() -> None:
    assert padded_slots([3, 1, 1, 7], 3) == 3 * 3 + 7
    # Padding-free, rows of each batch's longest: [3] [1 1] then [7]; [10] [4 3 2].
    assert padding_free_slots([3, 1, 1, 7], 3) == 2 * 3 + 7
    assert padding_free_slots([10, 3, 4, 2], 4) == 2 * 10
    assert length_stats([10, 3, 4, 2], [1, 1, 1, 1], cutoff_len=10, batch_size=4).utilisation_padding_free == 19 / 20
    assert batch_order(4, "sequential", 0).tolist() == [0, 1, 2, 3]
    shuffled = batch_order(50, "random", 42)
    assert sorted(shuffled.tolist()) == list(range(50)) and shuffled.tolist() != list(range(50))
    assert shuffled.tolist() == batch_order(50, "random", 42).tolist()


def test_supervised_counts_skip_the_first_position() -> None:
    data = datasets.Dataset.from_dict({
        "input_ids": [[5, 6, 7], [1, 3, 2, 4]],
        "labels": [[5, 6, 7], [IGNORE, 3, IGNORE, 4]],
    })
    assert supervised_counts(data).tolist() == [2, 2]


def test_histogram_bins_and_bars() -> None:
    hist = histogram([2, 4, 4, 5, 10], bins=3)
    assert hist == [(2, 4, 3), (5, 7, 1), (8, 10, 1)]
    assert histogram_lines(hist, width=6) == [
        "   2-4  ██████      3  60.0%",
        "   5-7  ██          1  20.0%",
        "   8-10 ██          1  20.0%",
    ]


# ---- verify_batch: hand-made batches with one thing wrong


def padded_batch(examples: list[dict]) -> dict:
    return SupervisedCollator(pad_token_id=0)(examples)


GOOD = [
    {"input_ids": [5, 6, 7, 8], "labels": [IGNORE, 6, 7, 8]},
    {"input_ids": [9, 10, 11], "labels": [IGNORE, 10, 11]},
]


def test_a_correct_padded_batch_passes() -> None:
    assert verify_batch(padded_batch(GOOD), pad_token_id=0, sample_lengths=[[4], [3]], vocab_size=12) is None
    assert verify_batch(padded_batch(GOOD), pad_token_id=0) is None  # lengths read from the mask


def test_labels_shifted_by_one_are_caught() -> None:
    # The classic bug: labels = input_ids[1:] although the loss shifts again.
    shifted = [{"input_ids": e["input_ids"], "labels": e["input_ids"][1:] + [IGNORE]} for e in GOOD]
    assert verify_batch(padded_batch(shifted), pad_token_id=0, sample_lengths=[[4], [3]], batch_index=3) == (
        "batch 3, sample 0, position 1: label 7 != input_id 6; labels must equal input_ids where supervised "
        "(the loss shifts them); it equals the next input_id: were the labels shifted already?"
    )


def test_a_wrong_attention_mask_is_caught() -> None:
    batch = padded_batch(GOOD)
    batch["attention_mask"][1, 3] = 1  # a pad position marked real
    assert verify_batch(batch, pad_token_id=0, sample_lengths=[[4], [3]]) == (
        "batch 0, sample 1, position 3: attention_mask is 1 on padding, expected 0"
    )
    batch = padded_batch(GOOD)
    batch["attention_mask"][0, 1] = 0  # a hole in a real sample: caught even without the lengths
    assert verify_batch(batch, pad_token_id=0) == (
        "batch 0, sample 0, position 1: attention_mask is 0 on a real token, expected 1"
    )


def test_padding_labels_ids_shapes_and_dtypes() -> None:
    batch = padded_batch(GOOD)
    batch["labels"][1, 3] = 4
    assert verify_batch(batch, pad_token_id=0, sample_lengths=[[4], [3]]) == (
        "batch 0, sample 1, position 3: label 4 on padding, expected -100"
    )
    batch = padded_batch(GOOD)
    assert verify_batch(batch, pad_token_id=2, sample_lengths=[[4], [3]]) == (
        "batch 0, sample 1, position 3: input_id 0 on padding, expected the pad id 2"
    )
    assert verify_batch(batch, pad_token_id=0, vocab_size=10) == (
        "batch 0, sample 1, position 1: input_id 10 is outside the model's vocabulary (vocab_size 10)"
    )
    batch["input_ids"] = batch["input_ids"].to(torch.int32)
    assert verify_batch(batch, pad_token_id=0) == "batch 0: input_ids has dtype torch.int32, expected torch.int64"
    batch = padded_batch(GOOD)
    batch["labels"] = batch["labels"][:, :3]
    assert verify_batch(batch, pad_token_id=0) == "batch 0: labels has shape (2, 3), input_ids (2, 4); they must match"


# Two packed samples A (3 tokens) and B (2 tokens) in one row.
PACKED_ROW = {"input_ids": [5, 6, 7, 8, 9], "labels": [IGNORE, 6, 7, IGNORE, 9], "position_ids": [0, 1, 2, 0, 1]}
PACKED_SHORT = {"input_ids": [3, 4], "labels": [IGNORE, 4], "position_ids": [0, 1]}


def test_packed_batches_pass_on_every_attention_path() -> None:
    for attention in ("position_ids", "block_mask", "varlen"):
        batch = PackedCollator(pad_token_id=0, attention=attention)([PACKED_ROW, PACKED_SHORT])
        lengths = [[3, 2, 2]] if attention == "varlen" else [[3, 2], [2]]
        assert verify_batch(batch, pad_token_id=0, sample_lengths=lengths) is None, attention


def test_a_position_id_that_does_not_restart_is_caught() -> None:
    row = {**PACKED_ROW, "position_ids": [0, 1, 2, 3, 4]}
    batch = PackedCollator(pad_token_id=0)([row, PACKED_SHORT])
    assert verify_batch(batch, pad_token_id=0, sample_lengths=[[3, 2], [2]]) == (
        "batch 0, sample 0, position 3: position_id 3 at the start of packed sample 1, expected 0 "
        "(position ids restart at every sample start)"
    )
    row = {**PACKED_ROW, "position_ids": [0, 1, 0, 1, 2]}  # a restart inside sample 0
    batch = PackedCollator(pad_token_id=0)([row])
    assert verify_batch(batch, pad_token_id=0, sample_lengths=[[3, 2]]) == (
        "batch 0, sample 0, position 2: position_id 0 inside packed sample 0, expected 2"
    )


def test_a_label_at_a_packed_sample_start_is_caught() -> None:
    row = {**PACKED_ROW, "labels": [IGNORE, 6, 7, 8, 9]}  # sample A's last token would predict B's first
    batch = PackedCollator(pad_token_id=0)([row])
    assert verify_batch(batch, pad_token_id=0, sample_lengths=[[3, 2]]) == (
        "batch 0, sample 0, position 3: label 8 at the start of packed sample 1, expected -100 "
        "(the sample before must not predict it)"
    )


def test_packed_attention_problems_are_caught() -> None:
    batch = PackedCollator(pad_token_id=0)([PACKED_ROW])
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    assert verify_batch(batch, pad_token_id=0) == (
        "batch 0: a 2-D attention_mask beside packed position_ids lets samples attend to each other; leave it out"
    )
    batch = PackedCollator(pad_token_id=0, attention="block_mask")([PACKED_ROW])
    batch["attention_mask"][0, 0, 3, 2] = 0.0  # B's first token may see A's last
    assert verify_batch(batch, pad_token_id=0) == (
        "batch 0, sample 0: the 4-D attention_mask is not the block-causal mask of its position_ids"
    )
    batch = PackedCollator(pad_token_id=0, attention="varlen")([PACKED_ROW])
    assert verify_batch(batch, pad_token_id=0, sample_lengths=[[2, 3]]) == (
        "batch 0, sample 0, position 2: position_id 2 at the start of packed sample 1, expected 0 "
        "(position ids restart at every sample start)"
    )


# ---- verify on real batches of the pipelines


@pytest.fixture(scope="module")
def sft_samples(tiny_tokenizer) -> datasets.Dataset:
    args = DataArguments(template="chatml", dataset=["demo_multiturn"], max_samples=24, cutoff_len=96)
    return build_datasets(args, tiny_tokenizer, get_template("chatml", tiny_tokenizer), seed=0).train


def test_verify_passes_on_real_sft_batches(sft_samples, tiny_tokenizer) -> None:
    order = batch_order(len(sft_samples), "random", 0)
    problem, counts = verify_split(
        "train", sft_samples, SupervisedCollator(tiny_tokenizer.pad_token_id), 5, order,
        pad_token_id=tiny_tokenizer.pad_token_id, vocab_size=864, max_batches=0,
    )
    assert problem is None
    assert (counts.batches, counts.rows) == (5, 24)
    assert counts.supervised == int(supervised_counts(sft_samples).sum())


def test_verify_passes_on_real_packed_batches(sft_samples, tiny_tokenizer) -> None:
    packed = pack_rows(sft_samples, 96)
    assert [sum(row) for row in packed.sample_lengths] == [len(r) for r in packed.rows["input_ids"]]
    for attention in ("position_ids", "block_mask", "varlen"):
        problem, counts = verify_split(
            "train", packed.rows, PackedCollator(tiny_tokenizer.pad_token_id, attention), 4,
            np.arange(len(packed.rows)), pad_token_id=tiny_tokenizer.pad_token_id, vocab_size=864, max_batches=0,
            lengths_per_row=packed.sample_lengths,
        )
        assert problem is None, attention
        assert counts.samples == len(sft_samples)


def test_verify_passes_on_real_pt_windows(tiny_tokenizer) -> None:
    from tunelab.data.pretrain import build_pretrain_datasets

    args = DataArguments(dataset=["demo_corpus"], max_samples=16, cutoff_len=64, stride=48)
    windows = build_pretrain_datasets(args, tiny_tokenizer, seed=0).train
    problem, counts = verify_split(
        "train", windows, SupervisedCollator(tiny_tokenizer.pad_token_id), 4, np.arange(len(windows)),
        pad_token_id=tiny_tokenizer.pad_token_id, vocab_size=864, max_batches=0,
    )
    assert problem is None
    assert counts.rows == len(windows)


# ---- coverage


def test_byte_level_characters_split_in_several_tokens(tiny_tokenizer) -> None:
    assert byte_piece_kind(tiny_tokenizer) == "byte-level"
    # é is 2 bytes (2 tokens alone), 中 3 bytes (3 tokens); every ASCII character is one token.
    total, split, top = split_characters(["héllo café 中"], tiny_tokenizer)
    assert (total, split) == (12, 3)
    assert top == [("é", 2, 2), ("中", 1, 3)]


def test_byte_fallback_pieces_are_counted() -> None:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "a": 1, "b": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    assert byte_piece_kind(tokenizer) == "byte-fallback"
    assert split_characters(["abéé"], tokenizer) == (4, 2, [("é", 2, 2)])


def test_id_coverage_counts_unk_and_out_of_range() -> None:
    cov = id_coverage(np.array([0, 5, 0, 900, 7]), vocab_size=864, unk_id=0)
    assert (cov.tokens, cov.distinct, cov.unk, cov.out_of_range, cov.max_id) == (5, 4, 2, 1, 900)
    assert id_coverage(np.array([1]), vocab_size=None, unk_id=None).unk is None


# ---- pairs (stages rm, dpo, kto)


def test_in_batches_orders_sequences_as_paired_batches() -> None:
    """Per batch of rows: every first side, then every second side (PairedCollator's 2B rows)."""
    values = np.array([[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]])
    order = np.array([3, 0, 4, 1, 2])
    assert in_batches(values, order, 2).tolist() == [13, 10, 23, 20, 14, 11, 24, 21, 12, 22]
    assert in_batches(values[:1], order, 2).tolist() == [13, 10, 14, 11, 12]  # plain samples: just the order


PAIR_ROWS = [
    {"chosen_input_ids": [5, 6, 7, 8], "chosen_labels": [IGNORE, IGNORE, 7, 8],
     "rejected_input_ids": [5, 9], "rejected_labels": [IGNORE, 9]},
    {"chosen_input_ids": [3, 4], "chosen_labels": [IGNORE, 4],
     "rejected_input_ids": [3, 2, 1], "rejected_labels": [IGNORE, 2, 1]},
]


def padding_free_pairs() -> dict:
    return PairedCollator(0, padding_free=PaddingFreeCollator(PackedCollator(0)))(PAIR_ROWS)


# Sequences 0..3 (chosen, chosen, rejected, rejected) of lengths 4, 2, 2, 3 in rows [0] [3] [1 2].
PAIR_LAYOUT = {"sample_lengths": [[4], [3], [2, 2]], "sequence_lengths": [4, 2, 2, 3]}


def test_a_correct_padding_free_pair_batch_passes() -> None:
    assert verify_batch(padding_free_pairs(), pad_token_id=0, **PAIR_LAYOUT) is None


@pytest.mark.parametrize("row, columns, owner, message", [
    (2, slice(0, 4), 1, "batch 0: sequence_ids cover [0, 1, 1, 3], expected each of 0..3 once"),
    (0, slice(3, 4), 1, "batch 0, sample 0, position 0: sequence_ids [0, 1] within one sequence, expected one id"),
    (1, slice(0, 3), 2, "batch 0, sample 1, position 0: sequence_ids 2 on 3 tokens, but that sequence has 2"),
    (1, slice(3, 4), 3, "batch 0, sample 1, position 3: sequence_ids on padding must be -1, got [3]"),
])
def test_bad_sequence_ids_are_caught(row: int, columns: slice, owner: int, message: str) -> None:
    batch = padding_free_pairs()
    batch["sequence_ids"][row, columns] = owner
    assert verify_batch(batch, pad_token_id=0, **PAIR_LAYOUT) == message


def test_verify_split_lays_out_pairs_as_the_collator_does() -> None:
    dataset = datasets.Dataset.from_list(PAIR_ROWS)
    collator = PairedCollator(0, padding_free=PaddingFreeCollator(PackedCollator(0)))
    problem, counts = verify_split("train", dataset, collator, 2, np.arange(2), pad_token_id=0, vocab_size=16,
                                   max_batches=0)
    assert problem is None
    assert (counts.batches, counts.rows, counts.samples, counts.batch_rows) == (1, 2, 4, 3)
    assert (counts.tokens, counts.padding, counts.supervised) == (11, 1, 6)
    assert counts.keys == ("input_ids", "labels", "position_ids", "sequence_ids")
    problem, counts = verify_split("train", dataset, PairedCollator(0), 2, np.arange(2), pad_token_id=0,
                                   vocab_size=16, max_batches=0)
    assert problem is None
    assert (counts.batch_rows, counts.padding, counts.keys) == (4, 5, ("input_ids", "labels", "attention_mask"))


# ---- the pipeline's row counts


def test_stats_count_rows_with_reasoning_and_empty_answers(tmp_path, tiny_tokenizer) -> None:
    import json  # noqa: PLC0415

    rows = [
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "r"}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]},
        {"messages": [{"role": "assistant", "content": "a"}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}]},
    ]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"chats": {"file_name": "data.jsonl", "formatting": "openai"}}))
    args = DataArguments(dataset_dir=str(tmp_path), dataset=["chats"], template="qwen3", cutoff_len=64, skip_bad_rows=True)
    report = build_datasets(args, tiny_tokenizer, get_template("qwen3", tiny_tokenizer), seed=0).report
    assert source_line(report["sources"][0]) == (
        "rows (chats): 4 read, 1 with an empty answer (trains the end-of-turn), 1 with reasoning, "
        "1 skipped (skip_bad_rows: 1 answer_first)"
    )
    ranking = {"name": "prefs", "rows": 3, "empty_answers": 0, "rows_with_reasoning": 0, "dropped_identical_pairs": 1}
    assert source_line(ranking) == (
        "rows (prefs): 3 read, 0 with an empty answer (trains the end-of-turn), 0 with reasoning, "
        "1 pairs dropped with identical answers"
    )
