"""Stage pt config checks: exact one-line messages, before any model or data loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tunelab.preflight import load_config
from tunelab.errors import ConfigError


@pytest.fixture
def base(tmp_path: Path) -> dict:
    """A pt config whose model folder has no chat template: pt must not need one."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return {"model_name_or_path": str(model), "stage": "pt", "dataset": "demo_corpus", "output_dir": str(tmp_path / "out")}


def load(tmp_path: Path, data: dict):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


def error_of(tmp_path: Path, data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, data)
    return str(info.value)


def test_pt_needs_no_template_and_accepts_window_options(tmp_path, base):
    config = load(tmp_path, {**base, "cutoff_len": 64, "stride": 32, "min_length": 3, "tail": "drop",
                             "txt_sample_by": "paragraph", "text_column": "body"})
    assert config.finetuning.stage == "pt" and config.data.template is None
    assert (config.data.stride, config.data.tail) == (32, "drop")
    assert load(tmp_path, {**base, "stride": 64, "cutoff_len": 64}).data.stride == 64


def test_pt_eval_with_val_size_or_text_eval_set(tmp_path, base):
    assert load(tmp_path, {**base, "val_size": 0.1, "eval_strategy": "steps", "eval_steps": 5}).data.val_size == 0.1
    assert load(tmp_path, {**base, "eval_dataset": "demo_corpus_test", "do_eval": True}).data.eval_dataset == ["demo_corpus_test"]
    assert error_of(tmp_path, {**base, "eval_strategy": "steps"}) == "eval_strategy needs an eval set: set eval_dataset or val_size"


@pytest.mark.parametrize(("key", "name", "expected"), [
    ("dataset", "demo_reverse",
     "dataset: 'demo_reverse' has formatting: alpaca, but stage pt trains on raw documents; "
     "use a dataset with formatting: text (e.g. demo_corpus) or another stage"),
    ("eval_dataset", "demo_multiturn_test",
     "eval_dataset: 'demo_multiturn_test' has formatting: sharegpt, but stage pt trains on raw documents; "
     "use a dataset with formatting: text (e.g. demo_corpus) or another stage"),
])
def test_pt_with_a_conversation_dataset(tmp_path, base, key, name, expected):
    assert error_of(tmp_path, {**base, key: name}) == expected


def test_sft_with_a_text_corpus(tmp_path, base):
    sft = {**base, "stage": "sft", "template": "chatml", "dataset": "demo_corpus"}
    assert error_of(tmp_path, sft) == (
        "dataset: 'demo_corpus' is a raw text corpus (formatting: text) for stage pt; "
        "stage sft needs an alpaca, sharegpt or openai dataset"
    )
    sft = {**base, "stage": "sft", "template": "chatml", "dataset": "demo_reverse", "eval_dataset": "demo_corpus_test"}
    assert error_of(tmp_path, sft).startswith("eval_dataset: 'demo_corpus_test' is a raw text corpus")


def test_pt_only_options_with_sft(tmp_path, base):
    sft = {**base, "stage": "sft", "template": "chatml", "dataset": "demo_reverse", "stride": 8, "tail": "drop"}
    assert error_of(tmp_path, sft) == "stride, tail only apply to stage pt (got stage: sft): remove them"


@pytest.mark.parametrize("stride", [0, -1, 65])
def test_stride_bounds(tmp_path, base, stride):
    assert error_of(tmp_path, {**base, "cutoff_len": 64, "stride": stride}) == (
        f"stride must be between 1 and cutoff_len (64), got {stride}; "
        "stride < cutoff_len overlaps windows, stride = cutoff_len (the default) does not"
    )


def test_min_length_and_tail_values(tmp_path, base):
    assert error_of(tmp_path, {**base, "min_length": 0}) == (
        "min_length must be at least 1 (empty documents are always dropped), got 0"
    )
    assert "tail" in error_of(tmp_path, {**base, "tail": "pad"})


def test_eval_generation_is_not_for_pt(tmp_path, base):
    assert error_of(tmp_path, {**base, "eval_generation": True, "val_size": 8}) == (
        "eval_generation: stage pt has no answers to match; remove it (eval_loss and eval_perplexity are reported)"
    )


def test_sft_still_needs_a_template(tmp_path, base):
    sft = {**base, "stage": "sft", "dataset": "demo_reverse"}
    assert error_of(tmp_path, sft).startswith("template: the tokenizer in ")


def test_pt_accepts_llamafactory_pretraining_entries(tmp_path, base):
    # LlamaFactory writes its pt sets without a formatting: {"file_name": ..., "columns": {"prompt": "text"}}
    (tmp_path / "dataset_info.json").write_text(
        '{"c4_demo": {"file_name": "c4.jsonl", "columns": {"prompt": "text"}}, "chat": {"file_name": "c.jsonl", '
        '"formatting": "alpaca"}}'
    )
    assert load(tmp_path, {**base, "dataset_dir": str(tmp_path), "dataset": "c4_demo"}).data.dataset == ["c4_demo"]
    assert error_of(tmp_path, {**base, "dataset_dir": str(tmp_path), "dataset": "chat"}) == (
        "dataset: 'chat' has formatting: alpaca, but stage pt trains on raw documents; "
        "use a dataset with formatting: text (e.g. demo_corpus) or another stage"
    )
