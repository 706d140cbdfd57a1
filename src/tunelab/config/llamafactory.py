"""LlamaFactory options tunelab deliberately lacks, each with what to do instead.

Consulted only for keys that are not tunelab options, so that a LlamaFactory YAML fails with the way
forward rather than a guess at a similar name (`export_device` is not a misspelt `export_dir`). Keys
are LlamaFactory's (src/llamafactory/hparams/*.py); a family sharing a prefix (vllm_*, swanlab_*) has one
entry in LLAMAFACTORY_PREFIXES. Keys tunelab shares with LlamaFactory, or accepts as aliases, are not here.
docs/config.md ("Coming from LlamaFactory") lists the same table for people. LLAMAFACTORY_HABITS lists the values
of some of these keys that ask for what tunelab does anyway (use_fast_tokenizer: true): those are accepted with an
info line instead.
"""

from __future__ import annotations

from typing import Any

_TEXT_ONLY = "tunelab trains text and image models (video and audio are refused): remove it"
_IMAGE_OPTIONS = (
    "tunelab's image options are image_max_pixels and image_min_pixels (the model's own processor does the rest): "
    "remove it"
)
_NOT_SERVING_ENGINE = "tunelab chat and tunelab api generate with transformers: remove it"
_NO_PROFILER = "tunelab has no built-in profiler: remove it (torch.profiler around a short run measures the same)"
_KTRANSFORMERS = "KTransformers is not supported: remove it"

LLAMAFACTORY_KEYS: dict[str, str] = {
    # data
    "tokenized_path": "tokenized datasets are cached automatically and reused while their inputs are unchanged: "
    "remove it (tokenized_cache_dir sets where the cache lives)",
    "enable_thinking": "use template_kwargs: {enable_thinking: false}, which reaches training, eval, chat, the API "
    "and export alike (or template: qwen3_nothink)",
    "preserve_thinking": "the template decides how earlier reasoning is rendered (Qwen3 drops it, exactly as when "
    "serving): remove it",
    "default_system": "put a system message in the data (the system column of dataset_info.json): remove it",
    "tool_format": "tools are rendered by the chat template itself: remove it",
    "neat_packing": "packing: true always keeps packed samples isolated (attention and positions): use packing: true",
    "block_diag_attn": "packing: true always keeps packed samples isolated: use packing: true",
    "eval_on_each_dataset": "each eval_dataset is evaluated and logged separately already: remove it",
    "preprocessing_batch_size": "remove it (encoding batches are fixed; preprocessing_num_workers sets the processes)",
    "data_shared_file_system": "the tokenized cache is safe on shared file systems (one process builds, the others "
    "wait): remove it",
    "eval_num_beams": "generation-based evaluation is greedy: remove it",
    "media_dir": "image paths are read relative to dataset_dir (or give absolute paths): remove it",
    # model
    "infer_backend": _NOT_SERVING_ENGINE,
    "infer_dtype": "use tunelab chat / tunelab api --dtype: remove it",
    "model_max_length": "use cutoff_len",
    "use_fast_tokenizer": "fast tokenizers are used whenever the model folder has one: remove it",
    "resize_vocab": "add_special_tokens grows the embeddings when it adds tokens: remove it",
    "add_tokens": "only special tokens are added (add_special_tokens)",
    "new_special_tokens": "use add_special_tokens",
    "new_special_tokens_config": "use add_special_tokens (new rows start at the mean of the others)",
    "init_special_tokens": "use add_special_tokens (new rows start at the mean of the others)",
    "split_special_tokens": "the tokenizer's own setting is used: remove it",
    "low_cpu_mem_usage": "transformers always loads weights this way: remove it",
    "cache_dir": "Hub ids use the Hugging Face cache (HF_HOME / HF_HUB_CACHE): remove it",
    "shift_attn": "shifted sparse attention (LongLoRA) is not supported: remove it",
    "mixture_of_depths": "mixture-of-depths is not supported: remove it",
    "use_unsloth": "Unsloth is not supported: remove it",
    "use_unsloth_gc": "Unsloth is not supported: use gradient_checkpointing: true",
    "moe_aux_loss_coef": "set router_aux_loss_coef in the model folder's config.json: remove it",
    "disable_gradient_checkpointing": "gradient checkpointing is off unless gradient_checkpointing: true: remove it",
    "use_reentrant_gc": "use gradient_checkpointing_kwargs: {use_reentrant: true} (false is the default)",
    "upcast_layernorm": "remove it (under bf16 / fp16 the trainable parameters are kept in float32)",
    "upcast_lmhead_output": "the loss is computed in float32 already: remove it",
    "train_from_scratch": "training starts from the weights in model_name_or_path: remove it",
    "offload_folder": "remove it (model_name_or_path is loaded whole)",
    "use_kv_cache": "the cache is off while training and on for generation: remove it",
    "hf_hub_token": "set the HF_TOKEN environment variable instead: remove it",
    "ms_hub_token": "ModelScope is not supported: remove it",
    "om_hub_token": "Modelers is not supported: remove it",
    "print_param_status": "the run log counts trainable parameters: remove it",
    "quantization_method": "quantization_bit always uses bitsandbytes: remove it",
    "quantization_device_map": "quantized weights are placed by bitsandbytes: remove it",
    "device_map": "placement follows the launcher (one device per process): remove it",
    "adapter_folder": "use adapter_name_or_path",
    "image_do_pan_and_scan": _IMAGE_OPTIONS,
    "crop_to_patches": _IMAGE_OPTIONS,
    "use_audio_in_video": _TEXT_ONLY,
    "export_device": "tunelab export merges on the CPU in float32: remove it",
    "export_legacy_format": "tunelab export writes safetensors only: remove it",
    "export_hub_model_id": "tunelab export writes a local folder: upload it with `hf upload` and remove export_hub_model_id",
    "export_hf_on_finish": "run tunelab export after training: remove it",
    # fine-tuning
    "freeze_language_model": "use train_mm_proj_only: true (only the projector trains) or finetuning_type: lora, "
    "whose adapters never touch the vision tower unless lora_target names it",
    "create_new_adapter": "adapter_name_or_path always continues training that adapter: remove it",
    "pref_bco_weight": "BCO is not supported: remove it",
    "kto_chosen_weight": "use kto_desirable_weight",
    "kto_rejected_weight": "use kto_undesirable_weight",
    "ld_alpha": "LD-DPO is not supported: remove it",
    "ref_model": "the reference is the model training starts from (LoRA: the base with the adapter disabled): remove it",
    "ref_model_adapters": "the reference is the model training starts from (LoRA: the base with the adapter "
    "disabled): remove it",
    "ref_model_quantization_bit": "the reference shares the policy's quantization_bit: remove it",
    "reward_model_adapters": "reward_model is the output_dir of a stage rm run, full or LoRA: remove it",
    "reward_model_quantization_bit": "remove it (reward_model is loaded as its stage rm run saved it)",
    "reward_model_type": "reward_model is the output_dir of a stage rm run (full or LoRA): remove it",
    "ppo_epochs": "use num_iterations",
    "ppo_buffer_size": "remove it (each step's rollouts train num_iterations optimizer steps)",
    "ppo_score_norm": "remove it (advantages are whitened per batch)",
    "ppo_whiten_rewards": "remove it (advantages are whitened per batch)",
    "ppo_target": "remove it (the KL penalty has a fixed weight, kl_coef)",
    "pure_bf16": "use bf16: true (mixed precision)",
    "use_llama_pro": "LLaMA Pro block expansion is not supported: remove it",
    "badam_update_ratio": "BAdam's ratio mode is not supported (use_badam trains one decoder layer at a time): "
    "remove it",
    "badam_mask_mode": "BAdam's ratio mode is not supported (use_badam trains one decoder layer at a time): remove it",
    "badam_verbose": "each BAdam block switch is logged: remove it",
    "use_dft_loss": "DFT loss is not supported: remove it",
    "use_asft_loss": "ASFT loss is not supported: remove it",
    "use_eaft_loss": "EAFT loss is not supported: remove it",
    "asft_alpha": "ASFT loss is not supported: remove it",
    "eaft_alpha": "EAFT loss is not supported: remove it",
    "use_mca": "Megatron-Core is not supported: use deepspeed or fsdp",
    "use_megatron_bridge": "Megatron is not supported: use deepspeed or fsdp",
    "megatron_bridge_args": "Megatron is not supported: use deepspeed or fsdp",
    "use_hyper_parallel": "remove it (use deepspeed or fsdp)",
    "hyper_parallel_args": "remove it (use deepspeed or fsdp)",
    "hyper_parallel_cp_size": "remove it (use deepspeed or fsdp)",
    "compute_accuracy": "use compute_token_accuracy: true",
    "disable_shuffling": "remove it (training rows are shuffled with seed)",
    "include_effective_tokens_per_second": "trainer_log.jsonl reports tokens per second already: remove it",
    # generation (LlamaFactory's chat / predict sampling)
    "do_sample": "tunelab eval generates greedily; tunelab chat / api take --temperature: remove it",
    "top_p": "tunelab chat / tunelab api take --top-p: remove it",
    "top_k": "tunelab chat / tunelab api take --top-k: remove it",
    "num_beams": "generation is greedy or sampled, without beams: remove it",
    "max_length": "use max_new_tokens (cutoff_len for training)",
    "repetition_penalty": "tunelab chat / tunelab api take --repetition-penalty: remove it",
    "length_penalty": "generation is greedy or sampled, without beams: remove it",
    "skip_special_tokens": "answers are decoded without special tokens: remove it",
    "predict_with_generate": "tunelab eval (or do_predict: true) generates and scores answers: remove it",
    # training
    "fp8": "FP8 training is not supported: remove it",
    "fp8_backend": "FP8 training is not supported: remove it",
    "fp8_enable_fsdp_float8_all_gather": "FP8 training is not supported: remove it",
    "enable_torch_profiler": _NO_PROFILER,
    "profile_modules": _NO_PROFILER,
    "ray_num_workers": "Ray is not supported: use nproc_per_node (and nnodes) to launch processes",
    "ray_init_kwargs": "Ray is not supported: use nproc_per_node (and nnodes) to launch processes",
    # llamafactory-cli eval (MMLU-style benchmarks)
    "task": "tunelab eval scores generated answers on eval_dataset; run benchmarks on an exported model with "
    "lm-evaluation-harness",
    "task_dir": "benchmarks are not built in: use lm-evaluation-harness on an exported model",
    "n_shot": "benchmarks are not built in: use lm-evaluation-harness on an exported model",
    "lang": "benchmarks are not built in: use lm-evaluation-harness on an exported model",
    "save_dir": "tunelab eval writes to output_dir",
    "download_mode": "tunelab reads datasets from local files: remove it",
}

# Families of LlamaFactory keys, matched by prefix.
LLAMAFACTORY_PREFIXES: dict[str, str] = {
    "swanlab_": "set swanlab's environment variables instead (SWANLAB_PROJECT, SWANLAB_WORKSPACE, SWANLAB_MODE, "
    "SWANLAB_API_KEY, SWANLAB_LOG_DIR; run_name names the run)",
    "vllm_": _NOT_SERVING_ENGINE,
    "sglang_": _NOT_SERVING_ENGINE,
    "kt_": _KTRANSFORMERS,
    "use_kt": _KTRANSFORMERS,
    "profiler_": _NO_PROFILER,
    "export_quantization_": "tunelab export quantizes with torchao, without calibration data: use "
    "export_quantization: int8-int4, int4-weight or int8-weight (docs/quantization.md)",
    "image_": _IMAGE_OPTIONS,
    "video_": _TEXT_ONLY,
    "audio_": _TEXT_ONLY,
}


# LlamaFactory options whose value can ask for what tunelab does anyway (often LlamaFactory's own default, written
# out by its web UI): key -> {value: the info line logged after "key: value "}. Such a value is accepted when the
# config loads (config/loader.py); any other value is refused with the key's LLAMAFACTORY_KEYS advice. The type
# `int` stands for any positive integer.
LLAMAFACTORY_HABITS: dict[str, dict[Any, str]] = {
    # data
    "enable_thinking": {True: "is the chat template's own default (templates with the switch keep reasoning on; "
                              "template_kwargs: {enable_thinking: false} turns it off)"},
    "neat_packing": {True: "is how tunelab packs: packing: true, samples isolated (attention and positions)",
                     False: "is accepted: tunelab's packing always isolates samples (packing without isolation is "
                            "not available)"},
    "eval_on_each_dataset": {True: "is what tunelab does: each eval_dataset is evaluated and logged separately"},
    "preprocessing_batch_size": {int: "is accepted and not needed: tunelab encodes in batches of its own size (the "
                                      "encoded rows are the same)"},
    "data_shared_file_system": {True: "is accepted: the tokenized cache is safe on a shared file system (concurrent "
                                      "builders publish it atomically)",
                                False: "is tunelab's default (each node's main process builds the tokenized cache)"},
    "eval_num_beams": {None: "is tunelab's default (generation-based evaluation is greedy)",
                       1: "is what tunelab does (generation-based evaluation is greedy, one beam)"},
    # model
    "infer_backend": {"huggingface": "is what tunelab does (tunelab chat, api and eval generate with transformers)"},
    "infer_dtype": {"auto": "is tunelab's default (tunelab chat / api --dtype auto)"},
    "use_fast_tokenizer": {True: "is what tunelab does (the model folder's fast tokenizer is used when it has one)"},
    "resize_vocab": {False: "is tunelab's default (the embeddings grow only for add_special_tokens)"},
    "split_special_tokens": {False: "is the tokenizer's default, which tunelab keeps"},
    "low_cpu_mem_usage": {True: "is how transformers 5 always loads weights"},
    "cache_dir": {None: "is LlamaFactory's default (Hub ids use the Hugging Face cache: HF_HOME / HF_HUB_CACHE)"},
    "shift_attn": {False: "is tunelab's default (no shifted sparse attention)"},
    "use_unsloth": {False: "is tunelab's default (no Unsloth)"},
    "use_unsloth_gc": {False: "is tunelab's default (no Unsloth)"},
    "disable_gradient_checkpointing": {
        True: "is tunelab's default (gradient checkpointing is off unless gradient_checkpointing: true)",
        False: "keeps LlamaFactory's default, gradient checkpointing on: gradient_checkpointing: true",
    },
    "use_reentrant_gc": {False: "is tunelab's default (transformers checkpoints without reentrant autograd)"},
    "upcast_layernorm": {False: "is what tunelab does (frozen norm weights keep their dtype; trainable parameters "
                                "train in float32)"},
    "upcast_lmhead_output": {True: "is what tunelab does (the loss reads the logits in float32, chunk by chunk)",
                             False: "is accepted: the loss still reads the logits in float32, chunk by chunk"},
    "train_from_scratch": {False: "is tunelab's default (training starts from the weights in model_name_or_path)"},
    "use_kv_cache": {True: "is what tunelab does (the KV cache is on for generation, off while training)"},
    "print_param_status": {False: "is tunelab's default (the run log counts trainable parameters)"},
    "quantization_method": {"bnb": "is what quantization_bit uses (bitsandbytes)"},
    "export_device": {"cpu": "is what tunelab export does (it merges on the CPU in float32)"},
    "export_legacy_format": {False: "is what tunelab export does (safetensors)"},
    "export_hf_on_finish": {False: "is tunelab's default (run tunelab export after training)"},
    # fine-tuning
    "freeze_language_model": {False: "is tunelab's default (the language model trains)"},
    "create_new_adapter": {False: "is tunelab's default (adapter_name_or_path continues training that adapter)"},
    "pref_bco_weight": {0.0: "is tunelab's default (no BCO term)"},
    "use_llama_pro": {False: "is tunelab's default (no block expansion)"},
    "use_dft_loss": {False: "is tunelab's default (the token cross-entropy)"},
    "use_asft_loss": {False: "is tunelab's default (the token cross-entropy)"},
    "use_eaft_loss": {False: "is tunelab's default (the token cross-entropy)"},
    "compute_accuracy": {True: "is tunelab's compute_token_accuracy: true",
                         False: "is tunelab's default (compute_token_accuracy: false)"},
    "disable_shuffling": {False: "is tunelab's default (training rows are shuffled with seed)"},
    "include_effective_tokens_per_second": {
        True: "is reported already (trainer_log.jsonl logs tokens per second)",
        False: "is accepted (trainer_log.jsonl logs tokens per second anyway)",
    },
    # generation
    "num_beams": {1: "is what tunelab does (greedy or sampled generation, one beam)"},
    "length_penalty": {1.0: "is accepted (it only acts on beams, which tunelab does not use)"},
    "repetition_penalty": {1.0: "is tunelab's default (no penalty)"},
    "skip_special_tokens": {True: "is what tunelab does (answers are decoded without special tokens)"},
    "predict_with_generate": {True: "is what do_predict and tunelab eval do (they generate and score answers)"},
    # training
    "fp8": {False: "is tunelab's default (no FP8 training)"},
    "enable_torch_profiler": {False: "is tunelab's default (no profiler)"},
}
# The tunelab options an accepted LlamaFactory value stands for: (key, value) -> {option: value}.
LLAMAFACTORY_HABIT_OPTIONS: dict[tuple[str, Any], dict[str, Any]] = {
    ("neat_packing", True): {"packing": True},  # LlamaFactory turns packing on with neat_packing
    ("disable_gradient_checkpointing", False): {"gradient_checkpointing": True},  # LlamaFactory's default is on
    ("compute_accuracy", True): {"compute_token_accuracy": True},
}


def llamafactory_advice(key: str) -> str | None:
    """What to do instead of the LlamaFactory option `key`, or None when it is not one."""
    if key in LLAMAFACTORY_KEYS:
        return LLAMAFACTORY_KEYS[key]
    return next((advice for prefix, advice in LLAMAFACTORY_PREFIXES.items() if key.startswith(prefix)), None)
