"""Streaming train sets: the same windows / examples as map-style, shuffling within a buffer, bounded
buffers, disjoint shards per rank, the config checks, and a whole streaming pt run.

pt corpora are words "w<i>" of a word-level tokenizer (w<i> → id i + 3, eos 2), as in test_pretrain.py.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from tunelab.config.args import DataArguments
from tunelab.preflight import load_config
from tunelab.data import streaming
from tunelab.data.collate import SupervisedCollator
from tunelab.data.pipeline import build_datasets
from tunelab.data.pretrain import build_pretrain_datasets, plan_windows
from tunelab.data.streaming import (
    TokenWindows, pretrain_stream, shuffled, supervised_stream,
)
from tunelab.errors import ConfigError, DataError

EOS = 2


def words(ids) -> str:
    return " ".join(f"w{i}" for i in ids)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Two sources: three .txt files in a folder (blank and short lines included) and a .jsonl file."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    (root / "books").mkdir()
    for name in ("a.txt", "b.txt", "c.txt"):
        lines = [words(rng.randrange(200) for _ in range(rng.choice([0, 1, 2, 5, 9, 14]))) for _ in range(40)]
        (root / "books" / name).write_text("\n".join(lines) + "\n")
    rows = [{"id": i, "content": words(rng.randrange(200) for _ in range(rng.randint(1, 12)))} for i in range(30)]
    (root / "web.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (root / "dataset_info.json").write_text(json.dumps({
        "books": {"file_name": "books", "formatting": "text"},
        "web": {"file_name": "web.jsonl", "formatting": "text"},
    }))
    return root


def rows_of(dataset, keys=("input_ids", "labels")) -> list[tuple]:
    return [tuple(np.asarray(row[k]).tolist() for k in keys) for row in dataset]


# --- stage pt: the same windows as map-style -----------------------------------------------------


@pytest.mark.parametrize(("window", "stride", "tail"), [
    (1, 1, "keep"), (5, 5, "drop"), (6, 4, "keep"), (7, 3, "drop"), (9, 9, "keep"),
])
def test_token_windows_match_plan_windows_for_any_pieces(window, stride, tail):
    rng = np.random.default_rng(window * 10 + stride)
    for total in (0, 3, window, 40, 101):
        stream = rng.integers(3, 100, total).astype(np.int32)
        cuts = np.sort(rng.choice(np.arange(1, total), size=min(6, total - 1), replace=False)) if total > 1 else []
        cutter, got = TokenWindows(window, stride, tail), []
        for piece in np.split(stream, cuts):
            got.extend(cutter.push(piece))
            assert len(cutter.buffer) < window  # only tokens the next window still needs
        got.extend(cutter.finish())
        plan = plan_windows(total, window, stride, tail)
        assert [w["input_ids"].tolist() for w in got] == [stream[s:e].tolist() for s, e in zip(plan.starts, plan.ends)]
        for w, s, first in zip(got, plan.starts, plan.first_targets):
            assert (w["labels"] == -100).sum() == first - s
        assert cutter.tail_tokens == plan.tail_tokens


@pytest.mark.parametrize("options", [
    {"cutoff_len": 8},
    {"cutoff_len": 8, "stride": 3},
    {"cutoff_len": 16, "stride": 11, "tail": "drop", "min_length": 3},
    {"cutoff_len": 5, "txt_sample_by": "paragraph"},
    {"cutoff_len": 12, "packing": True, "buffer_size": 10_000},
])
def test_pt_stream_equals_map_style_windows(corpus, word_tokenizer, options):
    args = DataArguments(dataset_dir=str(corpus), dataset=["books", "web"], **options)
    keys = ("input_ids", "labels", "position_ids") if args.packing else ("input_ids", "labels")
    expected = rows_of(build_pretrain_datasets(args, word_tokenizer, seed=0).train, keys)
    assert rows_of(pretrain_stream(args, word_tokenizer, seed=0), keys) == expected
    assert len(expected) > 10


def test_pt_stream_with_row_limits_and_interleaving_equals_map_style(corpus, word_tokenizer):
    for options in ({"max_samples": 25}, {"mix_strategy": "interleave_under"}):
        args = DataArguments(dataset_dir=str(corpus), dataset=["books", "web"], cutoff_len=8, **options)
        expected = rows_of(build_pretrain_datasets(args, word_tokenizer, seed=0).train)
        assert rows_of(pretrain_stream(args, word_tokenizer, seed=0)) == expected


def test_pt_stream_with_bos_and_mixed_text_columns_equals_map_style(tmp_path):
    from tests.data.test_pretrain import bos_tokenizer  # noqa: PLC0415

    rows = [{"text": words([1, 2])}, {"content": words([3])}, {"text": words([4, 5, 6])}] * 5
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"mixed": {"file_name": "mixed.jsonl", "formatting": "text"}}))
    for packing in (False, True):
        args = DataArguments(dataset_dir=str(tmp_path), dataset=["mixed"], cutoff_len=7, packing=packing)
        keys = ("input_ids", "labels", "position_ids") if packing else ("input_ids", "labels")
        expected = rows_of(build_pretrain_datasets(args, bos_tokenizer(True), seed=0).train, keys)
        assert rows_of(pretrain_stream(args, bos_tokenizer(True), seed=0), keys) == expected
        assert sum(row[0].count(3) for row in expected) == 15  # one BOS per document, none lost


def test_pt_stream_fails_before_reading_on_a_missing_column(corpus, word_tokenizer):
    args = DataArguments(dataset_dir=str(corpus), dataset=["web"], text_column="body")
    with pytest.raises(DataError, match=r"^dataset 'web': no column 'body' \(text_column\); columns: id, content"):
        pretrain_stream(args, word_tokenizer, seed=0)


# --- stage sft: the same examples as map-style ---------------------------------------------------


@pytest.fixture(scope="module")
def template(tiny_tokenizer):
    from tunelab.data.templates import get_template

    return get_template(None, tiny_tokenizer)


@pytest.mark.parametrize("packing", [False, True])
def test_sft_stream_equals_map_style_examples(tiny_tokenizer, template, packing):
    args = DataArguments(dataset=["demo_reverse", "demo_multiturn"], max_samples=60, cutoff_len=128,
                         packing=packing, buffer_size=10_000)
    keys = ("input_ids", "labels", "position_ids") if packing else ("input_ids", "labels")
    expected = rows_of(build_datasets(args, tiny_tokenizer, template, seed=0).train, keys)
    assert rows_of(supervised_stream(args, tiny_tokenizer, template, seed=0), keys) == expected


def test_packing_within_a_small_look_ahead_keeps_every_sample(tiny_tokenizer, template):
    args = DataArguments(dataset=["demo_multiturn"], max_samples=60, cutoff_len=128)
    samples = sorted(rows_of(supervised_stream(args, tiny_tokenizer, template, seed=0), ("input_ids",)))
    packed = list(supervised_stream(DataArguments(**{**vars(args), "packing": True, "buffer_size": 7}),
                                    tiny_tokenizer, template, seed=0))
    unpacked = []
    for row in packed:
        assert len(row["input_ids"]) <= 128
        starts = np.flatnonzero(row["position_ids"] == 0).tolist() + [len(row["input_ids"])]
        unpacked.extend((row["input_ids"][a:b].tolist(),) for a, b in zip(starts, starts[1:]))
    assert sorted(unpacked) == samples and len(packed) < len(samples)


# --- shuffling and bounded buffers ---------------------------------------------------------------


def test_shuffle_is_a_seeded_permutation_within_the_buffer(corpus, word_tokenizer):
    args = DataArguments(dataset_dir=str(corpus), dataset=["web"], cutoff_len=4)
    stream = pretrain_stream(args, word_tokenizer, seed=0)
    order = [tuple(ids) for ids, _ in rows_of(stream)]
    assert len(set(order)) == len(order) > 40  # distinct windows: positions can be traced
    first, again, other = (
        [tuple(ids) for ids, _ in rows_of(shuffled(stream, 8, seed, repeat=False))] for seed in (1, 1, 2)
    )
    assert first == again and first != other and first != order
    assert sorted(first) == sorted(order)
    position = {window: i for i, window in enumerate(order)}
    assert all(position[window] - 8 <= out for out, window in enumerate(first))  # at most 8 places earlier


def test_repeated_stream_runs_past_the_end(corpus, word_tokenizer):
    args = DataArguments(dataset_dir=str(corpus), dataset=["web"], cutoff_len=16)
    one_pass = len(list(pretrain_stream(args, word_tokenizer, seed=0)))
    repeated = iter(shuffled(pretrain_stream(args, word_tokenizer, seed=0), 4, seed=0))
    assert len([next(repeated) for _ in range(3 * one_pass)]) == 3 * one_pass


def test_pt_stream_holds_at_most_buffer_size_windows(corpus, word_tokenizer, monkeypatch):
    made = []
    emit = TokenWindows._emit
    monkeypatch.setattr(TokenWindows, "_emit", lambda self, *a, **k: made.append(1) or emit(self, *a, **k))
    args = DataArguments(dataset_dir=str(corpus), dataset=["books", "web"], cutoff_len=4, stride=2)
    held = []
    for consumed, _ in enumerate(shuffled(pretrain_stream(args, word_tokenizer, seed=0), 16, seed=0, repeat=False), 1):
        held.append(len(made) - consumed)
    # The buffer, plus at most the window being swapped in for the one drawn (whether that one is made before
    # the draw depends on how the stream's iterator batches its work, which other tests can change).
    assert 16 <= max(held) <= 16 + 1 and len(made) > 100


def test_sft_packing_holds_at_most_buffer_size_examples(tiny_tokenizer, template, monkeypatch):
    entered, left = [], []
    pack = streaming.pack_lookahead

    def counted(examples, *args):
        for row in pack((entered.append(1) or e for e in examples), *args):
            left.append(int((row["position_ids"] == 0).sum()))
            yield row

    monkeypatch.setattr(streaming, "pack_lookahead", counted)
    args = DataArguments(dataset=["demo_reverse"], max_samples=80, cutoff_len=128, packing=True, buffer_size=10)
    rows_held = []
    stream = shuffled(supervised_stream(args, tiny_tokenizer, template, seed=0), 10, 0, repeat=False)
    for consumed, _ in enumerate(stream, 1):
        assert len(entered) - sum(left) <= 10  # the look-ahead
        rows_held.append(len(left) - consumed)  # the shuffle buffer
    # The buffer, plus the row being swapped in; how far ahead datasets reads varies with the process's hash seed.
    assert max(rows_held) <= 10 + 1 and len(entered) == 80


# --- distributed: every rank reads its own shard ------------------------------------------------


@pytest.mark.parametrize("readers", [2, 1])  # 2 shards: by files; 1 shard: each rank keeps its own batches
def test_ranks_get_disjoint_data(corpus, word_tokenizer, readers):
    from accelerate.data_loader import prepare_data_loader

    args = DataArguments(dataset_dir=str(corpus), dataset=["books"], cutoff_len=6)
    stream = shuffled(pretrain_stream(args, word_tokenizer, seed=0, readers=readers, shuffle_files=True), 8, seed=0)
    assert stream.n_shards == readers
    seen = []
    for rank in range(2):
        loader = torch.utils.data.DataLoader(stream, batch_size=2, collate_fn=SupervisedCollator(0))
        loader = prepare_data_loader(
            loader, num_processes=2, process_index=rank, dispatch_batches=False, put_on_device=False
        )
        batches = iter(loader)
        seen.append({tuple(row.tolist()) for _ in range(10) for row in next(batches)["input_ids"]})
    assert not seen[0] & seen[1] and min(map(len, seen)) >= 15


def test_the_plan_turns_off_dispatching(tmp_path):
    options = {"stage": "pt", "dataset": "demo_corpus", "max_steps": 2, "output_dir": str(tmp_path / "out")}
    assert load_config(overrides=options).training.accelerator_config.dispatch_batches is None  # accelerate's default
    config = load_config(overrides={**options, "streaming": True})
    assert config.training.accelerator_config.dispatch_batches is False  # it would dispatch an iterable from rank 0


# --- config checks ------------------------------------------------------------------------------


@pytest.mark.parametrize(("options", "message"), [
    ({"streaming": True},
     "streaming: true needs max_steps > 0: a stream has no length to derive the number of steps from; set max_steps"),
    ({"streaming": True, "max_steps": 5, "val_size": 0.1},
     "val_size cannot hold out rows of a stream (streaming: true); "
     "set eval_dataset to a held-out dataset and remove val_size"),
    ({"streaming": True, "max_steps": 5, "buffer_size": 0}, "buffer_size must be at least 1, got 0"),
    ({"buffer_size": 64}, "buffer_size only applies to streaming: true: remove it or set streaming: true"),
    ({"stage": "sft", "dataset": "demo_reverse", "streaming": True, "max_steps": 5, "dedup": "exact"},
     "dedup: exact compares every row with every other and cannot run with streaming: true; "
     "remove dedup or set streaming: false"),
    ({"streaming": True, "max_steps": 5, "accelerator_config": {"dispatch_batches": True}},
     "accelerator_config.dispatch_batches: true makes rank 0 read the whole stream and needs batches of one shape; "
     "remove it with streaming: true (each rank then reads its own shard)"),
])
def test_streaming_checks(tmp_path, options, message):
    base = {"stage": "pt", "dataset": "demo_corpus", "output_dir": str(tmp_path / "out")}
    with pytest.raises(ConfigError) as info:
        load_config(overrides={**base, **options})
    assert str(info.value) == message


# --- a whole run --------------------------------------------------------------------------------


@pytest.mark.slow
def test_streaming_pt_run_trains_and_saves(tmp_path):
    from tunelab.cli import main
    from tunelab.run_folder import read_log

    out = tmp_path / "out"
    config = {
        "model_name_or_path": "tiny", "stage": "pt", "dataset": "demo_corpus", "eval_dataset": "demo_corpus_test",
        "max_samples": 200, "cutoff_len": 64, "streaming": True, "buffer_size": 128, "max_steps": 6,
        "per_device_train_batch_size": 8, "learning_rate": 3e-3, "logging_steps": 2, "finetuning_type": "full",
        "output_dir": str(out), "seed": 0, "disable_tqdm": True,
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["train", str(path)]) == 0
    losses = [r["loss"] for r in read_log(out) if "loss" in r]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert read_log(out)[-1]["step"] == 6 and (out / "model.safetensors").is_file()
    report = json.loads((out / "data_report.json").read_text())
    assert report["train"]["streaming"] is True and report["eval:demo_corpus_test"]["windows"] > 0
    assert "eval_perplexity" in json.loads((out / "all_results.json").read_text())
