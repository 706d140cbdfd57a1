"""build_datasets: registry → canonical → mixed → split → encoded, with every count reported."""

from __future__ import annotations

import json

import pytest

from tunelab.config.args import DataArguments
from tunelab.config.metric_names import VAL_SPLIT_NAME
from tunelab.data.pipeline import build_datasets
from tunelab.data.templates import get_template
from tunelab.errors import DataError


def build(tokenizer, **options):
    args = DataArguments(template="chatml", cutoff_len=options.pop("cutoff_len", 128), **options)
    return build_datasets(args, tokenizer, get_template("chatml", tokenizer), seed=0)


def test_val_split_and_separate_eval_sets(tiny_tokenizer):
    bundle = build(tiny_tokenizer, dataset=["demo_reverse"], eval_dataset=["demo_reverse_test"], max_samples=100, val_size=0.1)
    assert len(bundle.train) == 90
    assert set(bundle.eval) == {VAL_SPLIT_NAME, "demo_reverse_test"}
    assert len(bundle.eval[VAL_SPLIT_NAME]) == 10 and len(bundle.eval["demo_reverse_test"]) == 100
    train_prompts = {tuple(r["input_ids"]) for r in bundle.train}
    assert not train_prompts & {tuple(r["input_ids"]) for r in bundle.eval[VAL_SPLIT_NAME]}
    assert bundle.report["train"]["examples"] == 90
    assert [s["name"] for s in bundle.report["sources"]] == ["demo_reverse", "demo_reverse_test"]
    json.dumps(bundle.report)  # the report is written to data_report.json


def test_concat_and_interleave(tiny_tokenizer):
    concat = build(tiny_tokenizer, dataset=["demo_reverse", "demo_multiturn"], max_samples=20)
    assert len(concat.train) == 40
    under = build(tiny_tokenizer, dataset=["demo_reverse", "demo_multiturn"], max_samples=20,
                  mix_strategy="interleave_under", interleave_probs=[0.5, 0.5])
    assert 20 <= len(under.train) < 40


def test_val_size_too_large(tiny_tokenizer):
    with pytest.raises(DataError, match=r"^val_size=20 leaves no training rows \(the train set has 20\)$"):
        build(tiny_tokenizer, dataset=["demo_reverse"], max_samples=20, val_size=20)


def test_every_example_dropped_is_an_error(tiny_tokenizer):
    with pytest.raises(DataError, match=r"^train: every example was dropped; raise cutoff_len \(now 4\)$"):
        build(tiny_tokenizer, dataset=["demo_reverse"], max_samples=5, cutoff_len=4)
