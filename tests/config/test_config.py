"""Config loading and every cross-argument check: exact one-line messages, before any model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.config.configs import error_of, write
from tunelab.config.loader import parse_overrides
from tunelab.config.loader import resolved_dict
from tunelab.preflight import load_config
from tunelab.errors import ConfigError


def test_yaml_and_overrides_are_typed(tmp_path, base):
    config = load_config(
        write(tmp_path, {**base, "learning_rate": 1.0e-4}),
        ["learning_rate=3e-4", "--lora_rank", "16", "--bf16", "lora_target=q_proj, v_proj", "dataset=demo_reverse,demo_add"],
    )
    assert config.training.learning_rate == 3e-4
    assert config.finetuning.lora_rank == 16
    assert config.training.bf16 is True
    assert config.finetuning.lora_target == ["q_proj", "v_proj"]
    assert config.data.dataset == ["demo_reverse", "demo_add"]
    assert config.data.padding_free is None  # on where the model supports it (data/collate.py)
    assert load_config(write(tmp_path, base), ["padding_free=false"]).data.padding_free is False
    assert config.training.report_to == [] or config.training.report_to == "none" or config.training.report_to == ["none"]


def test_parse_overrides_forms():
    assert parse_overrides(["a=1", "--b", "2", "--c=3", "--flag", "--d", "x"]) == {
        "a": "1", "b": "2", "c": "3", "flag": "true", "d": "x",
    }
    with pytest.raises(ConfigError, match="cannot read override 'oops': write key=value or --key value"):
        parse_overrides(["oops"])


def test_unknown_key_suggests(tmp_path, base):
    msg = error_of(tmp_path, {**base, "learnig_rate": 1e-4})
    assert msg == f"unknown key 'learnig_rate' in {tmp_path / 'cfg.yaml'}; did you mean 'learning_rate'?"


def test_wrong_type_names_key(tmp_path, base):
    assert error_of(tmp_path, {**base, "lora_rank": "eight"}) == "lora_rank: expected int, got 'eight'"
    assert error_of(tmp_path, base, ["finetuning_type=lorra"]) == "finetuning_type: 'lorra' is not one of lora, oft, vera, freeze, full"


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match=r"config file .*nope.yaml does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_bad_yaml_names_line(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("a: 1\nb: [1, 2\nc: 3\n")
    with pytest.raises(ConfigError, match=rf"{path}:\d+: not valid YAML"):
        load_config(path)


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"fp16": True, "bf16": True}, "fp16 and bf16 are both true: keep one (bf16 where the hardware supports it)"),
        ({"quantization_bit": 4, "finetuning_type": "full"},
         "quantization_bit: 4 needs finetuning_type: lora (QLoRA), got 'full'"),
        ({"quantization_bit": 3}, "quantization_bit must be 4 or 8, got 3"),
        ({"finetuning_type": "freeze", "lora_rank": 16},
         "lora_rank only applies to finetuning_type: lora (got 'freeze'): remove it or set finetuning_type: lora"),
        ({"finetuning_type": "full", "use_dora": True, "lora_target": "q_proj"},
         "lora_target, use_dora only apply to finetuning_type: lora (got 'full'): remove them or set finetuning_type: lora"),
        ({"cutoff_len": 1}, "cutoff_len must be at least 2, got 1"),
        ({"stage": "foo"}, "stage: 'foo' is not one of pt, sft, rm, dpo, kto, grpo, ppo, kd"),
        ({"train_on_prompt": True, "mask_history": True},
         "train_on_prompt and mask_history contradict each other: keep one"),
        ({"eval_strategy": "steps"}, "eval_strategy needs an eval set: set eval_dataset or val_size"),
        ({"eval_generation": True}, "eval_generation needs an eval set: set eval_dataset or val_size"),
        ({"dataset": None}, "dataset is not set: name one or more datasets from dataset_info.json"),
        ({"interleave_probs": [0.5, 0.5]}, "interleave_probs needs mix_strategy: interleave_under or interleave_over"),
        ({"output_dir": None}, "output_dir is not set: add `output_dir: saves/my-run` to the config"),
        ({"packing": True, "flash_attn": "fa2", "trust_remote_code": True},
         "packing with flash_attn: fa2 cannot keep samples isolated in trust_remote_code models; "
         "set flash_attn: sdpa (a block mask is used), or packing: false"),
        ({"padding_free": True, "flash_attn": "fa2", "trust_remote_code": True},
         "padding_free with flash_attn: fa2 cannot keep samples isolated in trust_remote_code models; "
         "set flash_attn: sdpa (a block mask is used), or padding_free: false"),
    ],
)
def test_cross_argument_checks(tmp_path, base, extra, message):
    data = {**base, **extra}
    data = {k: v for k, v in data.items() if v is not None}
    assert error_of(tmp_path, data) == message


def test_template_checks(tmp_path, base, model_dir):
    assert error_of(tmp_path, {**base, "template": "chatlm"}).startswith(
        "template: 'chatlm' does not exist; did you mean 'chatml'? built-ins: "
    )
    (model_dir / "tokenizer_config.json").write_text("{}")
    assert error_of(tmp_path, {**base, "template": None}).startswith(
        f"template: the tokenizer in {model_dir} has no chat_template; set template to one of "
    )


def test_dataset_not_in_registry(tmp_path, base):
    assert error_of(tmp_path, {**base, "dataset": "demo_revers"}) == (
        "dataset: 'demo_revers' is not in the built-in registry; did you mean 'demo_reverse'? "
        "add it to dataset_info.json"
    )
    user_dir = tmp_path / "data"
    user_dir.mkdir()
    (user_dir / "dataset_info.json").write_text(json.dumps({"mine": {"file_name": "mine.jsonl"}}))
    assert error_of(tmp_path, {**base, "dataset_dir": str(user_dir), "eval_dataset": "theirs"}) == (
        f"eval_dataset: 'theirs' is not in {user_dir}/dataset_info.json; add it to dataset_info.json"
    )


def test_model_folder_checks(tmp_path, base):
    missing = tmp_path / "missing"
    assert error_of(tmp_path, {**base, "model_name_or_path": str(missing)}) == (
        f"model_name_or_path: {missing} is not a folder; point it at a local Hugging Face model folder"
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    assert error_of(tmp_path, {**base, "model_name_or_path": str(empty)}) == (
        f"model_name_or_path: {empty} has no config.json; is it a complete Hugging Face model folder?"
    )


def test_output_dir_not_empty(tmp_path, base):
    out = Path(base["output_dir"])
    out.mkdir()
    (out / "old.txt").write_text("x")
    assert error_of(tmp_path, base) == (
        f"output_dir: {out} is not empty; set overwrite_output_dir: true, resume_from_checkpoint, or choose another folder"
    )
    assert load_config(write(tmp_path, {**base, "overwrite_output_dir": True})).training.overwrite_output_dir


def test_resolved_dict_round_trips(tmp_path, base):
    config = load_config(write(tmp_path, {**base, "learning_rate": 2e-4, "lora_rank": 4}))
    resolved = resolved_dict(config)
    assert resolved["learning_rate"] == 2e-4
    assert resolved["lora_rank"] == 4
    assert resolved["template"] == "chatml"
    again = load_config(write(tmp_path, {k: v for k, v in resolved.items() if k in base or k in ("learning_rate", "lora_rank")}))
    assert again.training.learning_rate == 2e-4


def test_transformers4_names_are_aliases(tmp_path, base):
    config = load_config(write(tmp_path, {**base, "warmup_ratio": 0.1, "evaluation_strategy": "no"}))
    assert config.training.warmup_steps == 0.1
    assert error_of(tmp_path, {**base, "warmup_ratio": 0.1, "warmup_steps": 5}) == (
        "warmup_ratio and warmup_steps are the same option: keep warmup_steps"
    )


def test_applicability_is_declared_on_the_options_and_errors_carry_key_and_fix():
    """Every option that acts only under some stage or method says so in its metadata (config/applicability.py), and
    the error names the option as `key` (the web UI marks that field) and the fix."""
    import dataclasses

    from tunelab.config.applicability import rules_of
    from tunelab.config.args import DataArguments, FinetuningArguments

    declared = {f.name: tuple((r.key, r.values) for r in rules_of(f))
                for group in (DataArguments, FinetuningArguments) for f in dataclasses.fields(group) if rules_of(f)}
    assert declared["stride"] == (("stage", ("pt",)),)
    assert declared["lora_rank"] == (("finetuning_type", ("lora",)),)
    assert declared["simpo_gamma"] == (("stage", ("dpo",)), ("pref_loss", ("simpo",)))
    assert declared["kl_coef"] == (("stage", ("grpo", "ppo")),)
    assert declared["loss_type"] == (("stage", ("grpo",)),)
    assert declared["rollout_merge_adapter"] == (("stage", ("grpo", "ppo")), ("finetuning_type", ("lora",)))
    assert declared["beta"] == (("stage", ("kd",)),)
    # 5 pt, 12 LoRA, 1 any adapter, 4 OFT, 2 VeRA, 8 preference, 19 grpo / ppo, 3 kd, 24 optimizers
    assert len(declared) == 80
    with pytest.raises(ConfigError) as caught:
        load_config(None, {"stage": "sft", "finetuning_type": "full", "use_dora": True, "lora_rank": 4,
                           "output_dir": "unused"})
    assert (str(caught.value), caught.value.key, caught.value.fix) == (
        "lora_rank, use_dora only apply to finetuning_type: lora (got 'full'): remove them or set finetuning_type: lora",
        "lora_rank", "remove lora_rank, use_dora")
