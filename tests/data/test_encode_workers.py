"""preprocessing_num_workers: the default for large sets, and the same examples whatever the process count."""

from __future__ import annotations

import logging

from transformers import AutoTokenizer

from tunelab.assets import TINY_MODEL_DIR
from tunelab.data import pipeline
from tunelab.data.encode import SupervisedEncoder
from tunelab.data.formats import to_canonical
from tunelab.data.pipeline import LARGE_SET_ROWS, encode_dataset, encode_workers
from tunelab.data.dataset_files import load_rows
from tunelab.data.registry import load_registry
from tunelab.data.templates import get_template


def test_one_process_per_cpu_only_for_large_sets_unless_given() -> None:
    assert encode_workers(LARGE_SET_ROWS - 1, None, cpus=16) is None
    assert encode_workers(LARGE_SET_ROWS, None, cpus=2) == 2
    assert encode_workers(200_000, None, cpus=64) == 8  # at most 8
    assert encode_workers(200_000, None, cpus=1) is None  # one CPU: no second process to start
    assert encode_workers(100, 3, cpus=1) == 3  # a given value always wins
    assert encode_workers(200_000, 1, cpus=16) == 1


def test_two_processes_give_the_same_examples_and_the_choice_is_logged(monkeypatch, caplog) -> None:
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    spec = load_registry()["demo_sort"]
    rows, _ = to_canonical(load_rows(spec).select(range(600)), spec)
    encoder = SupervisedEncoder(tokenizer=tokenizer, template=get_template("chatml", tokenizer), cutoff_len=64)
    alone, stats = encode_dataset(rows, encoder, "train", None)
    monkeypatch.setattr(pipeline, "LARGE_SET_ROWS", 500)  # 600 rows count as a large set here
    monkeypatch.setattr(pipeline, "_usable_cpus", lambda: 2)
    with caplog.at_level(logging.INFO, logger="tunelab.data.pipeline"):
        shared, shared_stats = encode_dataset(rows, encoder, "train", None)
    assert shared.to_dict() == alone.to_dict() and shared_stats == stats
    assert ("train: 600 rows, tokenising with 2 processes (preprocessing_num_workers unset: one per CPU, at most 8, "
            "for sets of 500 rows or more)") in [r.getMessage() for r in caplog.records]
