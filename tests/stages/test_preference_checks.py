"""Config checks of stages rm / dpo / kto: exact one-line messages, before any model or data loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tunelab.preflight import load_config
from tunelab.errors import ConfigError


def base(tmp_path: Path, stage: str) -> dict:
    return {"model_name_or_path": "tiny", "template": "chatml", "stage": stage, "dataset": "demo_preference",
            "output_dir": str(tmp_path / "out")}


def error_of(tmp_path: Path, data: dict) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return str(info.value)


def test_valid_configs_load(tmp_path):
    path = tmp_path / "cfg.yaml"
    for stage, extra in (("rm", {}), ("dpo", {"pref_loss": "simpo", "simpo_gamma": 1.0}),
                         ("kto", {"precompute_ref_log_probs": True, "kto_undesirable_weight": 1.5})):
        path.write_text(yaml.safe_dump({**base(tmp_path, stage), **extra}))
        assert load_config(path).finetuning.stage == stage


@pytest.mark.parametrize("stage", ["rm", "dpo"])
def test_pairs_need_ranking_data(tmp_path, stage):
    assert error_of(tmp_path, {**base(tmp_path, stage), "dataset": "demo_sort"}) == (
        f"dataset: 'demo_sort' is not a ranking dataset, but stage {stage} trains on preference pairs; "
        "set ranking: true with chosen/rejected columns in dataset_info.json (e.g. demo_preference)"
    )


def test_kto_needs_ranking_data_or_a_kto_tag(tmp_path):
    assert error_of(tmp_path, {**base(tmp_path, "kto"), "eval_dataset": "demo_sort_test"}) == (
        "eval_dataset: 'demo_sort_test' is not a ranking dataset, but stage kto trains on preference pairs; "
        "set ranking: true with chosen/rejected columns in dataset_info.json or map a kto_tag column "
        "(columns.kto_tag) (e.g. demo_preference)"
    )
    data = tmp_path / "data"
    data.mkdir()
    (data / "tagged.json").write_text(json.dumps([{"instruction": "q", "output": "a", "good": True}]))
    (data / "dataset_info.json").write_text(json.dumps({"tagged": {"file_name": "tagged.json", "columns": {"kto_tag": "good"}}}))
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({**base(tmp_path, "kto"), "dataset": "tagged", "dataset_dir": str(data)}))
    assert load_config(path).data.dataset == ["tagged"]


def test_packing_is_refused(tmp_path):
    assert error_of(tmp_path, {**base(tmp_path, "dpo"), "packing": True}) == (
        "packing: true is not supported with stage dpo (each step's pairs are laid out padding-free instead); "
        "set packing: false"
    )
    assert error_of(tmp_path, {**base(tmp_path, "rm"), "packing": True}) == (
        "packing: true is not supported with stage rm (pairs are padded); set packing: false"
    )
    assert error_of(tmp_path, {**base(tmp_path, "rm"), "padding_free": True}) == (
        "padding_free: true does not apply to stage rm (a reward is read at each padded row's end); remove it"
    )
    for stage in ("dpo", "kto"):
        path = tmp_path / f"{stage}.yaml"
        path.write_text(yaml.safe_dump({**base(tmp_path, stage), "padding_free": True}))
        assert load_config(path).data.padding_free is True


def test_precompute_needs_a_reference(tmp_path):
    assert error_of(tmp_path, {**base(tmp_path, "dpo"), "pref_loss": "orpo", "precompute_ref_log_probs": True}) == (
        "precompute_ref_log_probs: pref_loss orpo uses no reference model; remove precompute_ref_log_probs"
    )


def test_options_of_other_stages_and_losses(tmp_path):
    assert error_of(tmp_path, {**base(tmp_path, "sft"), "dataset": "demo_sort", "pref_beta": 0.2}) == (
        "pref_beta only applies to stage dpo / kto (got stage: sft): remove it"
    )
    assert error_of(tmp_path, {**base(tmp_path, "rm"), "precompute_ref_log_probs": True}) == (
        "precompute_ref_log_probs only applies to stage dpo / kto (got stage: rm): remove it"
    )
    assert error_of(tmp_path, {**base(tmp_path, "dpo"), "pref_loss": "ipo", "dpo_label_smoothing": 0.1}) == (
        "dpo_label_smoothing only applies to pref_loss: sigmoid (got ipo): remove it"
    )
    assert error_of(tmp_path, {**base(tmp_path, "dpo"), "simpo_gamma": 1.0}) == (
        "simpo_gamma only applies to pref_loss: simpo (got sigmoid): remove it"
    )
    assert error_of(tmp_path, {**base(tmp_path, "dpo"), "pref_loss": "orpo", "pref_ftx": 1.0}) == (
        "pref_ftx: pref_loss orpo already has an SFT term (weighted against pref_beta); remove pref_ftx"
    )
    assert error_of(tmp_path, {**base(tmp_path, "dpo"), "pref_beta": 0}) == "pref_beta must be > 0, got 0.0"
    assert error_of(tmp_path, {**base(tmp_path, "rm"), "eval_generation": True, "val_size": 0.1}) == (
        "eval_generation: a reward model does not generate; remove it (eval reports reward accuracy)"
    )


def test_sft_refuses_ranking_data(tmp_path):
    config = {**base(tmp_path, "sft"), "dataset": "demo_sort", "eval_dataset": "demo_preference_test"}
    assert error_of(tmp_path, config) == (
        "eval_dataset: 'demo_preference_test' is a ranking dataset (chosen/rejected answers) for stages rm, dpo, "
        "kto, grpo and ppo; stage sft trains on conversations: use a dataset without ranking: true"
    )
