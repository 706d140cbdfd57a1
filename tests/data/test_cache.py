"""The tokenized cache: a hit on identical inputs, a miss on any change, atomic and multi-process safe."""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import datasets
import pytest

from tunelab.config.args import DataArguments
from tunelab.data.cache import CachedDatasets, dataset_inputs, load_or_build
from tunelab.data.templates import get_template


@pytest.fixture
def user_data(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    rows = [{"instruction": f"q{i}", "input": "", "output": f"a{i}"} for i in range(10)]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "dataset_info.json").write_text(json.dumps({"mine": {"file_name": "train.jsonl"}}))
    return folder


def inputs_for(tokenizer, args: DataArguments, template="chatml", stage="sft", seed=0):
    return dataset_inputs(args, tokenizer, get_template(template, tokenizer).jinja, stage, seed)


def build_counter():
    calls = []

    def build():
        calls.append(1)
        return CachedDatasets({"train": datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]]})}, {"rows": 1})

    return build, calls


def test_hit_on_same_inputs_and_miss_on_every_change(tmp_path, tiny_tokenizer, user_data):
    base = DataArguments(dataset=["mine"], dataset_dir=str(user_data), cutoff_len=64)
    cache = tmp_path / "cache"
    build, calls = build_counter()
    first, hit, entry = load_or_build(inputs_for(tiny_tokenizer, base), build, cache)
    assert (hit, len(calls)) == (False, 1)
    again, hit, entry2 = load_or_build(inputs_for(tiny_tokenizer, base), build, cache)
    assert (hit, len(calls), entry2) == (True, 1, entry)
    assert again.datasets["train"]["input_ids"] == [[1, 2, 3]] and again.report == {"rows": 1}

    # Options that do not shape examples keep the entry.
    neutral = dataclasses.replace(base, preprocessing_num_workers=2, overwrite_cache=False)
    assert load_or_build(inputs_for(tiny_tokenizer, neutral), build, cache)[1] is True

    changes = {
        "cutoff_len": dict(args=dataclasses.replace(base, cutoff_len=65)),
        "train_on_prompt": dict(args=dataclasses.replace(base, train_on_prompt=True)),
        "mask_history": dict(args=dataclasses.replace(base, mask_history=True)),
        "packing": dict(args=dataclasses.replace(base, packing=True)),
        "stride": dict(args=dataclasses.replace(base, stride=32)),
        "max_samples": dict(args=dataclasses.replace(base, max_samples=5)),
        "template": dict(template="llama3"),
        "stage": dict(stage="pt"),
        "seed": dict(seed=1),
    }
    for name, change in changes.items():
        args = change.pop("args", base)
        before = len(calls)
        _, hit, _ = load_or_build(inputs_for(tiny_tokenizer, args, **change), build, cache)
        assert (name, hit, len(calls)) == (name, False, before + 1)


def test_data_file_and_tokenizer_changes_rebuild(tmp_path, tiny_tokenizer, user_data):
    args = DataArguments(dataset=["mine"], dataset_dir=str(user_data))
    cache = tmp_path / "cache"
    build, calls = build_counter()
    load_or_build(inputs_for(tiny_tokenizer, args), build, cache)
    path = user_data / "train.jsonl"
    path.write_text(path.read_text() + json.dumps({"instruction": "new", "input": "", "output": "x"}) + "\n")
    assert load_or_build(inputs_for(tiny_tokenizer, args), build, cache)[1] is False
    tokenizer = tiny_tokenizer.__class__.from_pretrained(tiny_tokenizer.name_or_path)
    tokenizer.add_tokens(["<brand_new>"])
    assert load_or_build(inputs_for(tokenizer, args), build, cache)[1] is False
    assert len(calls) == 3


def test_overwrite_rebuilds_and_failed_build_leaves_nothing(tmp_path, tiny_tokenizer):
    args = DataArguments(dataset=["demo_reverse"])
    inputs = inputs_for(tiny_tokenizer, args)
    cache = tmp_path / "cache"
    build, calls = build_counter()
    load_or_build(inputs, build, cache)
    assert load_or_build(inputs, build, cache, overwrite=True)[1] is False and len(calls) == 2

    def broken():
        raise RuntimeError("disk full")

    other = inputs_for(tiny_tokenizer, dataclasses.replace(args, cutoff_len=9))
    with pytest.raises(RuntimeError, match="disk full"):
        load_or_build(other, broken, cache)
    assert sorted(p.name for p in cache.iterdir()) == [load_or_build(inputs, build, cache)[2].name]


@pytest.mark.slow  # over 2 s on the 2-core AVX2 reference: out of test-fast
def test_other_processes_wait_for_the_main_one(tmp_path, tiny_tokenizer):
    inputs = inputs_for(tiny_tokenizer, DataArguments(dataset=["demo_reverse"]))
    cache = tmp_path / "cache"
    seen = {}

    def follower():
        value, hit, _ = load_or_build(inputs, lambda: pytest.fail("a follower must not build"), cache, is_main_process=False)
        seen["value"], seen["hit"] = value.datasets["train"]["input_ids"], hit

    thread = threading.Thread(target=follower)
    thread.start()
    time.sleep(0.5)
    assert thread.is_alive()  # still waiting: nothing built yet

    def slow_build():
        time.sleep(0.5)
        return CachedDatasets({"train": datasets.Dataset.from_dict({"input_ids": [[7]]})}, {})

    load_or_build(inputs, slow_build, cache)
    thread.join(timeout=10)
    assert seen == {"value": [[7]], "hit": True}


def test_generator_datasets_are_keyed_by_the_generators_source(tiny_tokenizer, user_data):
    """A generator's rows come from its code: editing synthetic.py must not reuse rows tokenized before the edit."""
    import hashlib  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from tunelab.data import synthetic  # noqa: PLC0415

    inputs = inputs_for(tiny_tokenizer, DataArguments(dataset=["demo_shapes"], cutoff_len=64))
    source = hashlib.sha256(Path(synthetic.__file__).read_bytes()).hexdigest()
    assert inputs["sources"]["demo_shapes"]["generator_source"] == source
    file_backed = inputs_for(tiny_tokenizer, DataArguments(dataset=["mine"], dataset_dir=str(user_data), cutoff_len=64))
    assert "generator_source" not in file_backed["sources"]["mine"]
