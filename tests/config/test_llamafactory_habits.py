"""What LlamaFactory users bring: save_steps, unknown keys, template aliases and template_kwargs, deepspeed on CPU,
keys whose value asks for what tunelab does anyway (accepted with an info line), Liger kernels without a GPU.

Exact messages, checked before any model or dataset loads.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import pytest

from tests.config.configs import error_of, write
from tunelab.config.llamafactory import LLAMAFACTORY_HABITS
from tunelab.config.loader import build_config, read_values
from tunelab.config.precision import Machine
from tunelab.errors import ConfigError
from tunelab.model import device
from tunelab.preflight import _check_liger_package as check_liger_package
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
    # These once drew "did you mean 'export_dir'?" and "did you mean 'freeze_trainable_modules'?"; the values
    # that ask for what tunelab does (export_device: cpu...) are accepted (below).
    assert error_of(tmp_path, {**base, "export_device": "auto"}) == (
        f"export_device: auto in {cfg}; LlamaFactory option: tunelab export merges on the CPU in float32: remove it "
        "(tunelab accepts export_device: cpu)"
    )
    assert error_of(tmp_path, base, ["freeze_language_model=true"]) == (
        "freeze_language_model: true on the command line; LlamaFactory option: use train_mm_proj_only: true "
        "(only the projector trains) or finetuning_type: lora, whose adapters never touch the vision tower unless "
        "lora_target names it (tunelab accepts freeze_language_model: false)"
    )
    assert error_of(tmp_path, base, ["enable_thinking=false"]) == (
        "enable_thinking: false on the command line; LlamaFactory option: use template_kwargs: "
        "{enable_thinking: false}, which reaches training, eval, chat, the API and export alike "
        "(or template: qwen3_nothink) (tunelab accepts enable_thinking: true)"
    )
    assert error_of(tmp_path, base, ["block_diag_attn=true"]) == (
        "unknown key 'block_diag_attn' on the command line; LlamaFactory option: packing: true always keeps packed "
        "samples isolated: use packing: true"
    )
    for key in ("image_do_pan_and_scan", "vllm_maxlen", "swanlab_project", "export_quantization_bit"):  # families by prefix
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


# ---- LlamaFactory keys whose value asks for what tunelab does ---------------------------------------------------

# examples/train_lora/llama3_lora_sft.yaml of LlamaFactory, key for key (the model and datasets are this test's),
# plus the keys its web UI and users write out with LlamaFactory's defaults.
LLAMAFACTORY_LORA_SFT = {
    "trust_remote_code": True, "stage": "sft", "do_train": True, "finetuning_type": "lora", "lora_rank": 8,
    "lora_target": "all", "template": "llama3", "cutoff_len": 2048, "max_samples": 1000, "overwrite_cache": True,
    "preprocessing_num_workers": 16, "dataloader_num_workers": 4, "logging_steps": 10, "save_steps": 500,
    "plot_loss": True, "overwrite_output_dir": True, "save_only_model": False, "report_to": "none",
    "per_device_train_batch_size": 1, "gradient_accumulation_steps": 8, "learning_rate": 1.0e-4,
    "num_train_epochs": 3.0, "lr_scheduler_type": "cosine", "warmup_ratio": 0.1, "bf16": True,
    "ddp_timeout": 180000000, "resume_from_checkpoint": None,
    # LlamaFactory's defaults, written out
    "disable_gradient_checkpointing": True, "use_fast_tokenizer": True, "low_cpu_mem_usage": True,
    "upcast_layernorm": False, "use_kv_cache": True, "print_param_status": False, "neat_packing": False,
    "preprocessing_batch_size": 1000, "enable_thinking": True, "use_unsloth": False, "enable_liger_kernel": False,
    "rope_scaling": None, "cache_dir": None, "flash_attn": "auto", "infer_backend": "huggingface",
}


def infos_of(caplog, tmp_path: Path, data: dict, overrides=None):
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tunelab.config.loader"):
        config = load_config(write(tmp_path, data), overrides)
    return config, [r.getMessage() for r in caplog.records if r.name == "tunelab.config.loader"]


def test_a_llamafactory_lora_config_loads_saying_what_tunelab_does_instead(caplog, tmp_path, base):
    config, infos = infos_of(caplog, tmp_path, {**base, **LLAMAFACTORY_LORA_SFT})
    assert infos == [  # (the YAML is written with sorted keys)
        "cache_dir: null is LlamaFactory's default (Hub ids use the Hugging Face cache: HF_HOME / HF_HUB_CACHE)",
        ("disable_gradient_checkpointing: true is tunelab's default (gradient checkpointing is off unless "
         "gradient_checkpointing: true)"),
        ("enable_thinking: true is the chat template's own default (templates with the switch keep reasoning on; "
         "template_kwargs: {enable_thinking: false} turns it off)"),
        "infer_backend: huggingface is what tunelab does (tunelab chat, api and eval generate with transformers)",
        "low_cpu_mem_usage: true is how transformers 5 always loads weights",
        ("neat_packing: false is accepted: tunelab's packing always isolates samples (packing without isolation is "
         "not available)"),
        ("preprocessing_batch_size: 1000 is accepted and not needed: tunelab encodes in batches of its own size (the "
         "encoded rows are the same)"),
        "print_param_status: false is tunelab's default (the run log counts trainable parameters)",
        ("upcast_layernorm: false is what tunelab does (frozen norm weights keep their dtype; trainable parameters "
         "train in float32)"),
        "use_fast_tokenizer: true is what tunelab does (the model folder's fast tokenizer is used when it has one)",
        "use_kv_cache: true is what tunelab does (the KV cache is on for generation, off while training)",
        "use_unsloth: false is tunelab's default (no Unsloth)",
    ]
    args = config.training
    assert (args.gradient_checkpointing, config.data.packing, args.use_liger_kernel) == (False, False, False)
    assert (config.model.rope_scaling, args.warmup_steps, args.gradient_accumulation_steps) == (None, 0.1, 8)
    # the same keys on the command line, as text
    _, infos = infos_of(caplog, tmp_path, base, ["use_fast_tokenizer=true", "preprocessing_batch_size=500",
                                                  "quantization_method=BNB", "num_beams=1"])
    assert infos == [
        "use_fast_tokenizer: true is what tunelab does (the model folder's fast tokenizer is used when it has one)",
        ("preprocessing_batch_size: 500 is accepted and not needed: tunelab encodes in batches of its own size (the "
         "encoded rows are the same)"),
        "quantization_method: BNB is what quantization_bit uses (bitsandbytes)",
        "num_beams: 1 is what tunelab does (greedy or sampled generation, one beam)",
    ]


def test_a_value_that_stands_for_a_tunelab_option_sets_it(caplog, tmp_path, base):
    # LlamaFactory checkpoints unless disable_gradient_checkpointing: true; its false asks for checkpointing on.
    config, infos = infos_of(caplog, tmp_path, {**base, "disable_gradient_checkpointing": False,
                                                "neat_packing": True, "compute_accuracy": True})
    assert (config.training.gradient_checkpointing, config.data.packing, config.training.compute_token_accuracy) == (
        True, True, True)
    assert infos == [
        "compute_accuracy: true is tunelab's compute_token_accuracy: true",
        ("disable_gradient_checkpointing: false keeps LlamaFactory's default, gradient checkpointing on: "
         "gradient_checkpointing: true"),
        "neat_packing: true is how tunelab packs: packing: true, samples isolated (attention and positions)",
    ]
    assert error_of(tmp_path, {**base, "disable_gradient_checkpointing": False, "gradient_checkpointing": False}) == (
        "disable_gradient_checkpointing: false means gradient_checkpointing: true, but gradient_checkpointing is "
        "false: keep one"
    )
    assert error_of(tmp_path, {**base, "neat_packing": True}, ["packing=false"]) == (
        "neat_packing: true means packing: true, but packing is false: keep one"
    )
    assert error_of(tmp_path, {**base, "disable_gradient_checkpointing": "sometimes"}) == (
        "disable_gradient_checkpointing: expected true or false, got 'sometimes'"
    )


# Each accepted key with a value that asks for what tunelab does not do: refused with what to do instead.
REFUSED_VALUES = [
    ("enable_thinking", False, ("use template_kwargs: {enable_thinking: false}, which reaches training, eval, chat, "
                                "the API and export alike (or template: qwen3_nothink)"), "true"),
    ("eval_on_each_dataset", False, "each eval_dataset is evaluated and logged separately already: remove it", "true"),
    ("preprocessing_batch_size", 0, ("remove it (encoding batches are fixed; preprocessing_num_workers sets the "
                                     "processes)"), "a positive integer"),
    ("eval_num_beams", 4, "generation-based evaluation is greedy: remove it", "null or 1"),
    ("infer_backend", "vllm", "tunelab chat and tunelab api generate with transformers: remove it", "huggingface"),
    ("infer_dtype", "bfloat16", "use tunelab chat / tunelab api --dtype: remove it", "auto"),
    ("use_fast_tokenizer", False, "fast tokenizers are used whenever the model folder has one: remove it", "true"),
    ("resize_vocab", True, "add_special_tokens grows the embeddings when it adds tokens: remove it", "false"),
    ("split_special_tokens", True, "the tokenizer's own setting is used: remove it", "false"),
    ("low_cpu_mem_usage", False, "transformers always loads weights this way: remove it", "true"),
    ("cache_dir", "/data/hf-cache", "Hub ids use the Hugging Face cache (HF_HOME / HF_HUB_CACHE): remove it", "null"),
    ("shift_attn", True, "shifted sparse attention (LongLoRA) is not supported: remove it", "false"),
    ("use_unsloth", True, "Unsloth is not supported: remove it", "false"),
    ("use_unsloth_gc", True, "Unsloth is not supported: use gradient_checkpointing: true", "false"),
    ("use_reentrant_gc", True, "use gradient_checkpointing_kwargs: {use_reentrant: true} (false is the default)",
     "false"),
    ("upcast_layernorm", True, "remove it (under bf16 / fp16 the trainable parameters are kept in float32)", "false"),
    ("train_from_scratch", True, "training starts from the weights in model_name_or_path: remove it", "false"),
    ("use_kv_cache", False, "the cache is off while training and on for generation: remove it", "true"),
    ("print_param_status", True, "the run log counts trainable parameters: remove it", "false"),
    ("quantization_method", "hqq", "quantization_bit always uses bitsandbytes: remove it", "bnb"),
    ("export_device", "auto", "tunelab export merges on the CPU in float32: remove it", "cpu"),
    ("export_legacy_format", True, "tunelab export writes safetensors only: remove it", "false"),
    ("export_hf_on_finish", True, "run tunelab export after training: remove it", "false"),
    ("freeze_language_model", True, ("use train_mm_proj_only: true (only the projector trains) or finetuning_type: "
                                     "lora, whose adapters never touch the vision tower unless lora_target names it"), "false"),
    ("create_new_adapter", True, "adapter_name_or_path always continues training that adapter: remove it", "false"),
    ("pref_bco_weight", 0.5, "BCO is not supported: remove it", "0.0"),
    ("use_llama_pro", True, "LLaMA Pro block expansion is not supported: remove it", "false"),
    ("use_dft_loss", True, "DFT loss is not supported: remove it", "false"),
    ("use_asft_loss", True, "ASFT loss is not supported: remove it", "false"),
    ("use_eaft_loss", True, "EAFT loss is not supported: remove it", "false"),
    ("disable_shuffling", True, "remove it (training rows are shuffled with seed)", "false"),
    ("num_beams", 4, "generation is greedy or sampled, without beams: remove it", "1"),
    ("length_penalty", 2.0, "generation is greedy or sampled, without beams: remove it", "1.0"),
    ("repetition_penalty", 2.0, "tunelab chat / tunelab api take --repetition-penalty: remove it", "1.0"),
    ("skip_special_tokens", False, "answers are decoded without special tokens: remove it", "true"),
    ("predict_with_generate", False, "tunelab eval (or do_predict: true) generates and scores answers: remove it",
     "true"),
    ("fp8", True, "FP8 training is not supported: remove it", "false"),
    ("enable_torch_profiler", True, ("tunelab has no built-in profiler: remove it (torch.profiler around a short run "
                                     "measures the same)"), "false"),
]


@pytest.mark.parametrize(("key", "value", "advice", "accepted"), REFUSED_VALUES, ids=[r[0] for r in REFUSED_VALUES])
def test_a_value_tunelab_does_not_do_is_refused_with_what_to_do(tmp_path, base, key, value, advice, accepted):
    shown = json.dumps(value) if isinstance(value, bool) else value
    assert error_of(tmp_path, {**base, key: value}) == (
        f"{key}: {shown} in {tmp_path / 'cfg.yaml'}; LlamaFactory option: {advice} (tunelab accepts {key}: {accepted})"
    )


def test_every_accepted_key_has_its_refusal_tested():
    both = {key for key, values in LLAMAFACTORY_HABITS.items() if set(values) == {True, False}}  # no value refused
    assert {r[0] for r in REFUSED_VALUES} == set(LLAMAFACTORY_HABITS) - both


# ---- Liger kernels -----------------------------------------------------------------------------------------------


def machine(has_cuda: bool) -> Machine:
    return Machine(has_cuda, has_cuda, device.device_facts)


@pytest.mark.parametrize("key", ["enable_liger_kernel", "use_liger_kernel"])
def test_liger_kernels_are_refused_without_a_gpu_before_anything_loads(tmp_path, base, key):
    path = write(tmp_path, {**base, key: True})
    with pytest.raises(ConfigError) as info:
        read_values(path, None, "train", machine(has_cuda=False))
    assert str(info.value) == f"{key}: Liger kernels need a CUDA GPU (Triton); this machine has none: remove it"
    with pytest.raises(ConfigError) as info:
        read_values(path, ["use_cpu=true"], "train", machine(has_cuda=True))
    assert str(info.value) == f"{key}: Liger kernels run on the GPU, but use_cpu is true: remove one of them"
    # on a GPU the LlamaFactory name is transformers' use_liger_kernel (which the Trainer passes to Liger)
    assert build_config(read_values(path, None, "train", machine(has_cuda=True))).training.use_liger_kernel is True
    # and `tunelab data` / export / chat on a CPU machine read the same config without training it
    assert read_values(path, None, "data", machine(has_cuda=False)).training["use_liger_kernel"] is True


def test_liger_kernels_where_they_cannot_act(tmp_path, base):
    grpo = write(tmp_path, {**base, "stage": "grpo", "reward_funcs": "exact_match", "enable_liger_kernel": True})
    with pytest.raises(ConfigError) as info:
        build_config(read_values(grpo, None, "train", machine(has_cuda=True)))
    assert str(info.value) == (
        "use_liger_kernel: stage grpo trains in its own loop, where transformers does not apply Liger's kernels: "
        "remove it"
    )
    assert error_of(tmp_path, {**base, "enable_liger_kernel": True, "use_liger_kernel": True}) == (
        "enable_liger_kernel and use_liger_kernel are the same option: keep use_liger_kernel"
    )
    if importlib.util.find_spec("liger_kernel") is None:  # (this machine; a GPU machine may have it)
        config = build_config(read_values(write(tmp_path, {**base, "use_liger_kernel": True}), None, "train",
                                          machine(has_cuda=True)))
        with pytest.raises(ConfigError) as info:
            check_liger_package(config.training)
        assert str(info.value) == (
            "use_liger_kernel: the liger-kernel package is not installed: pip install 'tunelab[liger]', or remove it"
        )
