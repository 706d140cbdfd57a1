"""What LlamaFactory users bring: save_steps, unknown keys, template aliases and template_kwargs, deepspeed on CPU.

Exact messages, checked before any model or dataset loads.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tests.config.configs import error_of, write
from tunelab.preflight import load_config

DS_Z2 = Path(__file__).resolve().parents[2] / "examples" / "deepspeed" / "ds_z2_config.json"


def warnings_of(caplog, tmp_path: Path, data: dict, overrides=None) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tunelab.config.checks"):
        load_config(write(tmp_path, data), overrides)
    return [r.getMessage() for r in caplog.records if r.name == "tunelab.config.checks"]


# ---- save_steps and the other *_steps keys ---------------------------------------------------------------


def test_save_steps_turns_on_checkpoints_as_in_llamafactory(tmp_path, base):
    assert str(load_config(write(tmp_path, base)).training.save_strategy.value) == "no"  # checkpoints stay opt-in
    config = load_config(write(tmp_path, {**base, "save_steps": 500}))
    assert (config.training.save_strategy.value, config.training.save_steps) == ("steps", 500)
    # an explicit strategy wins
    assert load_config(write(tmp_path, base), ["save_steps=5", "save_strategy=epoch"]).training.save_strategy.value == "epoch"


def test_each_ineffective_steps_key_is_warned_once_with_the_fix(caplog, tmp_path, base):
    data = {**base, "save_strategy": "no", "save_steps": 500, "save_total_limit": 2, "eval_steps": 50,
            "logging_strategy": "epoch", "logging_steps": 5}
    assert warnings_of(caplog, tmp_path, data) == [
        "save_steps: 500 has no effect while save_strategy is 'no'; set save_strategy: steps (or remove save_steps)",
        "save_total_limit: 2 has no effect while save_strategy is 'no'; set save_strategy: steps (or remove save_total_limit)",
        "eval_steps: 50 has no effect while eval_strategy is 'no'; set eval_strategy: steps (or remove eval_steps)",
        "logging_steps: 5 has no effect while logging_strategy is 'epoch'; set logging_strategy: steps (or remove logging_steps)",
    ]
    # keys that act, and tunelab's own defaults (logging_steps 10), say nothing
    assert warnings_of(caplog, tmp_path, {**base, "save_steps": 100, "save_total_limit": 2, "logging_steps": 5}) == []


def test_generating_stages_save_no_checkpoints(caplog, tmp_path, base):
    grpo = {**base, "stage": "grpo", "reward_funcs": "exact_match", "dataset": "demo_sort"}
    assert warnings_of(caplog, tmp_path, grpo, ["save_steps=100"]) == [
        "save_steps has no effect: stage grpo saves only the final model, no checkpoints; remove save_steps"
    ]
    assert warnings_of(caplog, tmp_path, grpo, ["save_strategy=steps"]) == [
        "save_strategy has no effect: stage grpo saves only the final model, no checkpoints; remove save_strategy"
    ]


# ---- unknown keys ----------------------------------------------------------------------------------------


def test_all_unknown_keys_at_once_with_where_each_came_from(tmp_path, base):
    cfg = tmp_path / "cfg.yaml"
    # (the YAML is written with sorted keys; tokenized_path is in both, so it counts as the command line's)
    message = error_of(tmp_path, {**base, "lora_rnak": 8, "tokenized_path": "x", "frobnicate": 1},
                       ["tokenized_path=y", "learnig_rate=1e-4"])
    assert message == (
        f"4 unknown keys — in {cfg}: 'frobnicate'; 'lora_rnak' → did you mean 'lora_rank'?; "
        "on the command line: 'tokenized_path' → LlamaFactory option: tokenized datasets are cached automatically "
        "and reused while their inputs are unchanged: remove it (tokenized_cache_dir sets where the cache lives); "
        "'learnig_rate' → did you mean 'learning_rate'?; see `tunelab train --help` for the options"
    )


def test_llamafactory_options_say_what_to_do_instead_of_a_distant_guess(tmp_path, base):
    cfg = tmp_path / "cfg.yaml"
    # These once drew "did you mean 'export_dir'?" and "did you mean 'freeze_trainable_modules'?"
    assert error_of(tmp_path, {**base, "export_device": "cpu"}) == (
        f"unknown key 'export_device' in {cfg}; LlamaFactory option: tunelab export merges on the CPU in float32: "
        "remove it"
    )
    assert error_of(tmp_path, base, ["freeze_language_model=true"]) == (
        "unknown key 'freeze_language_model' on the command line; LlamaFactory option: use train_mm_proj_only: true "
        "(only the projector trains) or finetuning_type: lora, whose adapters never touch the vision tower unless "
        "lora_target names it"
    )
    assert error_of(tmp_path, base, ["enable_thinking=false"]) == (
        "unknown key 'enable_thinking' on the command line; LlamaFactory option: use template_kwargs: "
        "{enable_thinking: false}, which reaches training, eval, chat, the API and export alike "
        "(or template: qwen3_nothink)"
    )
    for key in ("image_do_pan_and_scan", "vllm_maxlen", "galore_rank", "export_quantization_bit"):  # families by prefix
        assert "LlamaFactory option: " in error_of(tmp_path, base, [f"{key}=1"])
    assert error_of(tmp_path, base, ["export_quantization_bit=4"]).endswith(
        "tunelab export quantizes with torchao, without calibration data: use export_quantization: int8-int4, "
        "int4-weight or int8-weight (docs/quantization.md)"
    )
    assert error_of(tmp_path, base, ["gradient_accumulation=4"]) == (
        "unknown key 'gradient_accumulation' on the command line; did you mean 'gradient_accumulation_steps'?"
    )
    assert error_of(tmp_path, base, ["zzz_option=1"]) == (
        "unknown key 'zzz_option' on the command line; see `tunelab train --help` for the options"
    )


# ---- template aliases and template_kwargs ----------------------------------------------------------------


def test_llamafactory_template_aliases(tmp_path, base):
    config = load_config(write(tmp_path, {**base, "template": "qwen3_nothink"}))
    assert (config.data.template, config.data.template_kwargs) == ("qwen3", {"enable_thinking": False})
    config = load_config(write(tmp_path, {**base, "template": "qwen"}))
    assert (config.data.template, config.data.template_kwargs) == ("qwen2_5", None)
    assert load_config(write(tmp_path, {**base, "template": "gemma"})).data.template == "gemma3"
    # the user's own template_kwargs win over what the alias implies
    config = load_config(write(tmp_path, {**base, "template": "qwen3_nothink"}), ['template_kwargs={"enable_thinking": true}'])
    assert config.data.template_kwargs == {"enable_thinking": True}


def test_llamafactory_template_without_an_identical_builtin(tmp_path, base):
    assert error_of(tmp_path, {**base, "template": "mistral"}) == (
        "template: 'mistral' is LlamaFactory's, and no built-in renders exactly like it; use template: model "
        "(the model's own chat_template, what it is served with) or a built-in (tunelab template list)"
    )


def test_template_kwargs_from_yaml_and_command_line(tmp_path, base):
    data = {**base, "template": "llama3_1", "template_kwargs": {"date_string": "01 Jan 2025"}}
    assert load_config(write(tmp_path, data)).data.template_kwargs == {"date_string": "01 Jan 2025"}
    config = load_config(write(tmp_path, {**base, "template": "qwen3"}), ['template_kwargs={"enable_thinking": false}'])
    assert config.data.template_kwargs == {"enable_thinking": False}
    assert error_of(tmp_path, {**base, "template": "qwen3"}, ["template_kwargs=enable_thinking=false"]) == (
        "template_kwargs: expected a mapping (YAML, or JSON on the command line: template_kwargs='{\"name\": value}'), "
        "got 'enable_thinking=false'"
    )
    assert error_of(tmp_path, {**base, "template": "qwen3"}, ["template_kwargs=[1]"]).startswith(
        "template_kwargs: expected a mapping"
    )


def test_a_variable_the_template_does_not_read_is_refused(tmp_path, base):
    assert error_of(tmp_path, {**base, "template": "qwen3", "template_kwargs": {"enable_thinkng": False}}) == (
        "template_kwargs: template 'qwen3' does not read 'enable_thinkng'; it reads enable_thinking"
    )
    assert error_of(tmp_path, {**base, "template_kwargs": {"enable_thinking": False}}) == (
        "template_kwargs: template 'chatml' does not read 'enable_thinking'; it reads no variables besides the "
        "conversation"
    )
    assert error_of(tmp_path, {**base, "template": "llama3_1", "template_kwargs": {"date": "x", "tools_in_user_message": False}}) == (
        "template_kwargs: template 'llama3_1' does not read 'date'; it reads builtin_tools, custom_tools, date_string, "
        "tools_in_user_message"
    )
    assert error_of(tmp_path, {**base, "template": "model", "template_kwargs": {"enable_thinking": False}}) == (
        "template_kwargs: template 'model' does not read 'enable_thinking'; it reads no variables besides the conversation"
    )
    assert error_of(tmp_path, {**base, "template": "qwen3", "template_kwargs": {"messages": []}}) == (
        "template_kwargs: 'messages' is set by tunelab for every render (from the conversation and the tokenizer); "
        "remove it from template_kwargs"
    )
    pt = {**base, "stage": "pt", "dataset": "demo_corpus", "template_kwargs": {"enable_thinking": False}}
    assert error_of(tmp_path, pt) == "template_kwargs: stage pt trains on raw text without a chat template; remove it"


# ---- deepspeed -------------------------------------------------------------------------------------------


def test_deepspeed_json_is_checked_before_any_worker_starts(tmp_path, base):
    """DeepSpeed validates zero_optimization only inside each worker, as a multi-line pydantic error; on CPU it
    runs (docs/distributed.md) except offloading, which has nothing to offload to."""
    pytest.importorskip("deepspeed", reason="the ZeRO section is checked by deepspeed's own config model")
    typo = tmp_path / "typo.json"
    typo.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_sav": True}}))
    assert error_of(tmp_path, {**base, "deepspeed": str(typo)}) == (
        f"deepspeed: {typo}: zero_optimization.stage3_gather_16bit_weights_on_model_sav is not a DeepSpeed ZeRO "
        "option; did you mean stage3_gather_16bit_weights_on_model_save?"
    )
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"zero_optimization": {"stage": "two"}}))
    assert error_of(tmp_path, {**base, "deepspeed": str(wrong)}).startswith(
        f"deepspeed: {wrong}: zero_optimization.stage: "
    )
    offload = tmp_path / "offload.json"
    offload.write_text(json.dumps({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}))
    assert error_of(tmp_path, {**base, "deepspeed": str(offload), "use_cpu": True}) == (
        f"deepspeed: zero_optimization.offload_optimizer (device cpu) offloads from GPU memory to the host; a "
        "CPU-only run has nothing to offload: remove offload_optimizer, or run it on GPUs"
    )
    config = load_config(write(tmp_path, {**base, "deepspeed": str(DS_Z2), "use_cpu": True}))  # it runs on CPU
    assert config.training.deepspeed == str(DS_Z2)
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    assert error_of(tmp_path, {**base, "deepspeed": str(listed), "use_cpu": True}) == (
        f"deepspeed: {listed} holds a JSON list, not a DeepSpeed config object"
    )
    assert error_of(tmp_path, {**base, "deepspeed": str(tmp_path / "none.json")}) == (
        f"deepspeed: {tmp_path / 'none.json'} does not exist; point it at a DeepSpeed JSON config "
        "(examples/deepspeed/ds_z2_config.json or ds_z3_config.json)"
    )
