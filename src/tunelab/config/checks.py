"""The checks of option values: ranges and cross-option rules, on the values alone (no files, no imports of the
layers above, no environment).

Each check raises ConfigError with one line naming the key(s) and the fix, so a bad config fails in well under a
second. What needs more than the values is checked by the layer that owns it, called in order by
tunelab/preflight.py: the model folder (model/folder.py), the template (data/templates/choice.py), the datasets
(data/registry.py), the reward functions, callbacks, output folder and resume point (train/), the DeepSpeed file
(train/launch.py). The one check that needs the loaded model (lora_target naming real modules) lives in
model/adapters.py.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
from typing import TYPE_CHECKING

from tunelab.config.applicability import check_applicability
from tunelab.config.args import NONZERO_LORA_INITS, DataArguments, FinetuningArguments, RunConfig
from tunelab.config.export_formats import DEFAULT_GGUF_TYPE, check_gguf_type
from tunelab.config.metric_names import eval_metric_names
from tunelab.config.qat_schemes import check_scheme
from tunelab.config.stages import REFERENCE_FREE_LOSSES, stage_row, uses_reference
from tunelab.errors import ConfigError

if TYPE_CHECKING:
    from tunelab.config.training_args import TrainingArguments

# Training keys that only act under one value of a strategy key: key -> (strategy key, the value it needs).
STRATEGY_KEYS = {
    "save_steps": ("save_strategy", "steps"),
    "save_total_limit": ("save_strategy", None),  # any strategy that saves
    "eval_steps": ("eval_strategy", "steps"),
    "logging_steps": ("logging_strategy", "steps"),
}

logger = logging.getLogger(__name__)


def check_training_values(values: dict) -> None:
    """Checks on raw TrainingArguments values, run before transformers validates them its own way."""
    if values.get("fp16") and values.get("bf16"):
        raise ConfigError("fp16 and bf16 are both true: keep one (bf16 where the hardware supports it)")
    _check_training_ranges(values)
    _check_load_best_model_values(values)


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


# Numeric TrainingArguments values transformers takes as they are and torch trips over later (ZeroDivisionError,
# "Invalid learning rate") or trains nonsense with (lr 0 steps): key -> (valid, what it must be, the fix).
TRAINING_RANGES = {
    "learning_rate": (lambda v: _finite(v) and v > 0, "a number > 0",
                      "typical values: 1e-4 to 2e-4 for LoRA, 1e-5 for full fine-tuning"),
    "per_device_train_batch_size": (lambda v: v >= 1, "at least 1", "it is the rows per device in a micro-batch; to use less memory raise gradient_accumulation_steps instead"),
    "per_device_eval_batch_size": (lambda v: v >= 1, "at least 1", "it is the rows per device in an evaluation batch"),
    "gradient_accumulation_steps": (lambda v: v >= 1, "at least 1", "1 takes one micro-batch per optimizer step"),
    "max_steps": (lambda v: v >= 1 or v == -1, "at least 1, or -1",
                  "set the number of optimizer steps, or -1 to train num_train_epochs"),
    "num_train_epochs": (lambda v: _finite(v) and v >= 0, "a number >= 0", "it is the number of passes over the training set"),
    "warmup_steps": (lambda v: _finite(v) and v >= 0, "a number >= 0", "it is a number of steps, or a ratio of the total below 1"),
    "weight_decay": (lambda v: _finite(v) and v >= 0, "a number >= 0", "0 turns it off"),
    "max_grad_norm": (lambda v: _finite(v) and v >= 0, "a number >= 0", "0 turns gradient clipping off"),
    "adam_beta1": (lambda v: _finite(v) and 0 <= v < 1, "in [0, 1)", "the default is 0.9"),
    "adam_beta2": (lambda v: _finite(v) and 0 <= v < 1, "in [0, 1)", "the default is 0.999"),
    "adam_epsilon": (lambda v: _finite(v) and v >= 0, "a number >= 0", "the default is 1e-8"),
    "logging_steps": (lambda v: _finite(v) and v > 0, "a number > 0", "it is the steps between log lines, or a ratio of the total below 1"),
    "eval_steps": (lambda v: _finite(v) and v > 0, "a number > 0", "it is the steps between evaluations, or a ratio of the total below 1"),
    "save_steps": (lambda v: _finite(v) and v > 0, "a number > 0", "it is the steps between checkpoints, or a ratio of the total below 1"),
    "dataloader_num_workers": (lambda v: v >= 0, "at least 0", "0 loads batches in the training process"),
}


def _check_training_ranges(values: dict) -> None:
    """Each numeric training value in its range, named with the fix, before transformers or torch sees it."""
    for key, (valid, must, fix) in TRAINING_RANGES.items():
        value = values.get(key)
        if value is not None and not valid(value):
            shown = int(value) if isinstance(value, float) and value.is_integer() else value
            raise ConfigError(f"{key} must be {must}, got {shown}; {fix}")
    max_steps = values.get("max_steps", -1)
    if max_steps is not None and max_steps <= 0 and values.get("num_train_epochs", 3.0) == 0:
        raise ConfigError(
            "num_train_epochs: 0 trains nothing (max_steps is -1, so the epochs decide the length); set "
            "num_train_epochs > 0 or max_steps"
        )


def check_config(config: RunConfig, purpose: str = "train") -> None:
    """The value checks a purpose needs: "export" reads only the model and adapter (no template, dataset or
    output_dir); "serve" (tunelab chat / api with a YAML) the model and adapter (the engine checks the template it
    serves with, which may be the adapter's); callbacks only matter to the run that trains with them. Each check
    takes the option groups its row of VALUE_CHECKS names, no more."""
    without_data = (_check_dataset_named, _check_data, _check_stage_data, _check_streaming, _check_dedup, _check_eval)
    skipped = {
        "export": (_check_template_options, *without_data, *LOOP_CHECKS),
        "serve": (_check_template_options, *without_data, _check_preference, _check_rl, _check_distillation,
                  *LOOP_CHECKS),
    }.get(purpose, ())
    if purpose != "train":
        skipped = (*skipped, _check_callbacks)
    if purpose == "eval" and config.data.eval_dataset and config.data.val_size <= 0:  # it reads only the eval sets
        skipped = (*skipped, _check_dataset_named)  # (a val split is taken from the training datasets)
    _check_applicability([config.model, config.data, config.finetuning, config.generation], purpose)
    for check, groups in VALUE_CHECKS:
        if check not in skipped:
            check(*(getattr(config, group) for group in groups))
    if purpose == "eval" or (purpose == "train" and config.training.do_predict):
        _check_predict(config.data, config.finetuning, "tunelab eval" if purpose == "eval" else "do_predict")
    if purpose == "export":
        _check_export(config.model, config.export)


def _check_applicability(groups: list, purpose: str) -> None:
    """Options set where they do not act (their `applies` metadata): LoRA options without LoRA always; stage
    options unless the command only serves the model."""
    deciding = ("finetuning_type", "stage", "pref_loss", "advantage_estimator")
    keys = ("finetuning_type",) if purpose == "serve" else deciding
    check_applicability(groups, keys)


def _check_template_options(data, finetuning) -> None:
    if stage_row(finetuning.stage).reads == "text" and data.template_kwargs:
        raise ConfigError("template_kwargs: stage pt trains on raw text without a chat template; remove it")


def warn_ineffective_keys(training: TrainingArguments, finetuning: FinetuningArguments, precision: str | None,
                          given: set[str]) -> None:
    """Log once for each option the user set that the resolved run ignores: a `*_steps` key whose strategy is
    not "steps" (save_steps with save_strategy: no...), save options of stages that save only the final model."""
    args, stage = training, finetuning.stage
    for key, (strategy_key, needed) in STRATEGY_KEYS.items():
        if key not in given:
            continue
        if stage_row(stage).rl and strategy_key == "save_strategy":
            logger.warning("%s has no effect: stage %s saves only the final model, no checkpoints; remove %s",
                           key, stage, key)
            continue
        strategy = str(getattr(getattr(args, strategy_key), "value", getattr(args, strategy_key)))
        if strategy == "no" or (needed is not None and strategy != needed):
            value = getattr(args, key)
            value = int(value) if isinstance(value, float) and value.is_integer() else value
            logger.warning("%s: %s has no effect while %s is '%s'; set %s: %s (or remove %s)",
                           key, value, strategy_key, strategy, strategy_key, needed or "steps", key)
    if finetuning.pure_bf16 and not args.bf16:
        chose = f" ({precision})" if precision else ""
        logger.warning("pure_bf16 has no effect: this run does not train in bf16%s; remove pure_bf16 or set bf16: true",
                       chose)
    if stage_row(stage).rl and "save_strategy" in given and "save_steps" not in given:
        logger.warning("save_strategy has no effect: stage %s saves only the final model, no checkpoints; "
                       "remove save_strategy", stage)


def _check_predict(data, finetuning, what: str) -> None:
    """Generation-based evaluation (infer/predict.py) needs conversations with answers to compare against."""
    if stage_row(finetuning.stage).reads == "text":
        raise ConfigError(f"{what}: stage pt has no answers to generate and compare; use a conversation dataset and stage sft")
    if not data.eval_dataset and data.val_size <= 0:
        raise ConfigError(f"{what} needs an eval set: set eval_dataset (or val_size to use the training split's val part)")
    if data.streaming and not data.eval_dataset:
        raise ConfigError(f"{what} with streaming: true needs eval_dataset")


def _check_export(model, export) -> None:
    if not export.export_dir:
        raise ConfigError("export_dir is not set: add export_dir=saves/my-model-merged")
    if model.quantization_bit is not None:
        raise ConfigError(
            "quantization_bit: export merges the adapter into full-precision base weights; remove quantization_bit "
            "(the adapter of a QLoRA run merges into the unquantized base)"
        )
    size = export.export_size
    if isinstance(size, (int, float)) and size <= 0:
        raise ConfigError(f"export_size must be a positive number of GB or a size string like 500MB, got {size}")
    _check_export_format(export)


def _check_export_format(export) -> None:
    """export_gguf_type names a type tunelab writes and applies to GGUF only; the folder options apply to hf only."""
    check_gguf_type(export.export_gguf_type)
    if export.export_format == "hf":
        if export.export_gguf_type != DEFAULT_GGUF_TYPE:
            raise ConfigError(f"export_gguf_type: {export.export_gguf_type} applies to export_format: gguf; add "
                              "export_format=gguf, or remove export_gguf_type to export a Hugging Face folder")
        return
    defaults = type(export)()
    folder_only = {
        "export_quantization": "a GGUF is quantized by export_gguf_type (q8_0 ... q4_0), not torchao",
        "export_dtype": "a GGUF's tensor type is export_gguf_type (f32, f16, bf16, ...)",
        "export_size": "a GGUF is one file, never sharded",
    }
    for key, why in folder_only.items():
        if getattr(export, key) != getattr(defaults, key):
            raise ConfigError(f"{key} applies to export_format: hf, not gguf: {why}; remove {key}")


def _check_finetuning(finetuning, training) -> None:
    ft = finetuning
    if ft.pure_bf16 and training.fp16:
        raise ConfigError("pure_bf16 keeps bf16 weights, but fp16 is true: set bf16 (or leave it to auto) instead of fp16, "
                          "or remove pure_bf16")
    if ft.lora_rank < 1:
        raise ConfigError(f"lora_rank must be at least 1, got {ft.lora_rank}")
    if ft.lora_alpha is not None and ft.lora_alpha <= 0:
        raise ConfigError(f"lora_alpha must be > 0, got {ft.lora_alpha} (or remove it: 2 * lora_rank)")
    if not 0.0 <= ft.lora_dropout < 1.0:
        raise ConfigError(f"lora_dropout must be in [0, 1), got {ft.lora_dropout}")


def _check_adapter_methods(model, finetuning, training) -> None:
    """LoRA's initialisations (init_lora_weights, pissa_*) and OFT's / VeRA's sizes (model/adapters.py,
    docs/training.md#lora-initialisations)."""
    ft = finetuning
    init = ft.lora_init()
    if ft.pissa_init and ft.init_lora_weights not in ("default", "pissa"):
        raise ConfigError(f"pissa_init and init_lora_weights: {ft.init_lora_weights} are two initialisations: keep one",
                          key="pissa_init")
    defaults = type(ft)()
    for key in ("pissa_iter", "pissa_convert"):
        if init != "pissa" and getattr(ft, key) != getattr(defaults, key):
            raise ConfigError(f"{key} only applies with pissa_init: true: set it or remove {key}", key=key)
    if init == "pissa" and ft.pissa_iter < -1:
        raise ConfigError(f"pissa_iter must be -1 (the full SVD) or at least 0 (fast SVD iterations), got "
                          f"{ft.pissa_iter}", key="pissa_iter")
    if init == "pissa" and not ft.pissa_convert and ft.pissa_iter != -1:
        raise ConfigError(
            f"pissa_convert: false saves the adapter as trained, which peft decomposes the base again to load; the "
            f"randomized fast SVD of pissa_iter: {ft.pissa_iter} would not give the residual it trained on: set "
            "pissa_iter: -1 or remove pissa_convert", key="pissa_convert")
    if ft.finetuning_type == "lora" and init in NONZERO_LORA_INITS:
        _check_nonzero_lora_start(model, finetuning, training, init)
    if ft.finetuning_type == "oft" and (ft.oft_rank < 0 or ft.oft_block_size < 0 or (ft.oft_rank > 0) == (ft.oft_block_size > 0)):
        raise ConfigError(f"oft_rank and oft_block_size: set exactly one of them above 0 (blocks x block size = the "
                          f"layer's width), got oft_rank: {ft.oft_rank}, oft_block_size: {ft.oft_block_size}",
                          key="oft_rank")
    if ft.finetuning_type == "oft" and not 0.0 <= ft.module_dropout < 1.0:
        raise ConfigError(f"module_dropout must be in [0, 1), got {ft.module_dropout}", key="module_dropout")
    if ft.finetuning_type == "vera" and ft.vera_rank < 1:
        raise ConfigError(f"vera_rank must be at least 1, got {ft.vera_rank}", key="vera_rank")
    if ft.finetuning_type in ("oft", "vera") and model.add_special_tokens:
        raise ConfigError(f"add_special_tokens: the new tokens' rows train as peft trainable tokens, which only a LoRA "
                          f"adapter holds; finetuning_type {ft.finetuning_type} cannot train them: use finetuning_type: "
                          "lora (or full)", key="add_special_tokens")


def _check_nonzero_lora_start(model, finetuning, training, init: str) -> None:
    """pissa / olora / loftq: the adapter does not start at zero (model/adapters.py saves the change from its start)."""
    ft, args = finetuning, training
    key = "pissa_init" if ft.pissa_init else "init_lora_weights"
    name = "pissa_init" if ft.pissa_init else f"init_lora_weights: {init}"
    if ft.use_dora:
        raise ConfigError(f"{name} with use_dora: the adapter is saved as its change from the start, which DoRA's "
                          "magnitude vector has no form for: remove use_dora", key=key)
    if uses_reference(ft):
        rule = stage_row(ft.stage).reference
        without = {"pref_loss": " (or set pref_loss: orpo or simpo)", "kl_coef": " (or set kl_coef: 0)"}.get(rule, "")
        raise ConfigError(
            f"{name}: stage {ft.stage} takes the model with its adapter disabled as the reference, which is not the "
            f"model training starts from when the adapter starts away from zero: remove {key}{without}", key=key)
    if args.deepspeed or args.fsdp:
        engine = "deepspeed" if args.deepspeed else "fsdp"
        raise ConfigError(f"{name} decomposes and saves whole weight matrices, which {engine} shards: remove {key} or "
                          f"{engine}", key=key)
    bits = model.quantization_bit
    if init == "loftq":
        if bits != 4:
            raise ConfigError(f"init_lora_weights: loftq initialises LoRA for a 4-bit base: set quantization_bit: 4 "
                              f"(got {bits})", key=key)
        if ft.use_rslora or (ft.lora_alpha is not None and ft.lora_alpha != ft.lora_rank):
            raise ConfigError(
                f"init_lora_weights: loftq: peft sets B·A to the quantization error without the LoRA scale (peft issue "
                f"#1982), so the scale must be 1: set lora_alpha: {ft.lora_rank} (= lora_rank, or remove it) and "
                "remove use_rslora", key="lora_alpha")
        if model.gguf_file or model.model_name_or_path.lower().endswith(".gguf"):
            raise ConfigError("init_lora_weights: loftq reads the original weights from the model's safetensors "
                              "files, which a GGUF model has not: use a Hugging Face model folder", key=key)
    elif bits is not None:
        raise ConfigError(f"{name} decomposes the full-precision weights, which quantization_bit: {bits} replaces: "
                          "remove quantization_bit (init_lora_weights: loftq initialises LoRA for a 4-bit base)",
                          key=key)


def _check_quantization(model, finetuning) -> None:
    _check_gguf_file(model)
    bits = model.quantization_bit
    if bits is None:
        return
    if bits not in (4, 8):
        raise ConfigError(f"quantization_bit must be 4 or 8, got {bits}")
    if finetuning.finetuning_type != "lora":
        raise ConfigError(
            f"quantization_bit: {bits} needs finetuning_type: lora (QLoRA), got '{finetuning.finetuning_type}'"
        )


def _check_gguf_file(model) -> None:
    """gguf_file names a .gguf inside model_name_or_path (a folder or a Hub id), which is then not itself a file."""
    name, source = model.gguf_file, model.model_name_or_path
    if name is None:
        return
    if not name.lower().endswith(".gguf"):
        raise ConfigError(f"gguf_file: '{name}' is not a .gguf file name; name the GGUF file inside model_name_or_path")
    if name.startswith("/") or ".." in name.replace("\\", "/").split("/"):
        raise ConfigError(f"gguf_file: '{name}' must be a path inside model_name_or_path; to load a file from "
                          "anywhere, set model_name_or_path to its path and remove gguf_file")
    if source.lower().endswith(".gguf"):
        raise ConfigError(f"gguf_file: model_name_or_path {source} is already a GGUF file; remove gguf_file")


def _check_qat(model, finetuning, export) -> None:
    """qat (training) and export_quantization (export) name a quantization scheme (config/qat_schemes.py)."""
    ft, scheme, export_scheme = finetuning, finetuning.qat, export.export_quantization
    if not scheme:
        if ft.qat_start_step:
            raise ConfigError("qat_start_step only applies with qat: set qat (e.g. qat: int8-int4) or remove it")
        if ft.qat_group_size is not None and not export_scheme:
            raise ConfigError("qat_group_size only applies with qat or export_quantization: remove it")
    for key, name in (("qat", scheme), ("export_quantization", export_scheme)):
        if name:
            check_scheme(key, name)
    if not scheme:
        return
    if model.quantization_bit is not None:
        raise ConfigError(
            f"qat and quantization_bit ({model.quantization_bit}-bit QLoRA) cannot train together: QAT "
            "fake-quantizes full-precision weights; remove quantization_bit (qat with finetuning_type: lora trains "
            "LoRA on a fake-quantized base)"
        )
    if not stage_row(finetuning.stage).token_loss:
        raise ConfigError(f"qat applies to stages pt and sft (got stage: {finetuning.stage}): remove qat")
    if ft.qat_start_step < 0:
        raise ConfigError(f"qat_start_step must be >= 0, got {ft.qat_start_step}")


def _check_dataset_named(data) -> None:
    if not data.dataset:
        raise ConfigError("dataset is not set: name one or more datasets from dataset_info.json")


def _check_data(model, data, generation) -> None:
    if data.cutoff_len < 2:
        raise ConfigError(f"cutoff_len must be at least 2, got {data.cutoff_len}")
    if data.train_on_prompt and data.mask_history:
        raise ConfigError("train_on_prompt and mask_history contradict each other: keep one")
    for key in ("packing", "padding_free"):
        if getattr(data, key) and model.flash_attn == "fa2" and model.trust_remote_code:
            # Packed fa2 relies on transformers' own attention code taking cu_seq_lens (data/packing.py).
            raise ConfigError(
                f"{key} with flash_attn: fa2 cannot keep samples isolated in trust_remote_code models; "
                f"set flash_attn: sdpa (a block mask is used), or {key}: false"
            )
    if data.val_size < 0:
        raise ConfigError(f"val_size must be >= 0, got {data.val_size}")
    for key in ("max_samples", "preprocessing_num_workers"):
        if getattr(data, key) is not None and getattr(data, key) < 1:
            raise ConfigError(f"{key} must be at least 1, got {getattr(data, key)} (or remove it)")
    for key in ("max_new_tokens", "eval_generation_samples"):
        if getattr(generation, key) < 1:
            raise ConfigError(f"{key} must be at least 1, got {getattr(generation, key)}")
    if data.interleave_probs is not None:
        if data.mix_strategy == "concat":
            raise ConfigError("interleave_probs needs mix_strategy: interleave_under or interleave_over")
        if len(data.interleave_probs) != len(data.dataset or []):
            raise ConfigError(
                f"interleave_probs has {len(data.interleave_probs)} values for {len(data.dataset or [])} datasets"
            )


def _check_stage_data(data, finetuning, generation) -> None:
    """pt's window options (which datasets suit the stage is data/registry.py's check_datasets)."""
    if stage_row(finetuning.stage).reads != "text":
        return
    if data.stride is not None and not 1 <= data.stride <= data.cutoff_len:
        raise ConfigError(
            f"stride must be between 1 and cutoff_len ({data.cutoff_len}), got {data.stride}; "
            "stride < cutoff_len overlaps windows, stride = cutoff_len (the default) does not"
        )
    if data.packing and (data.stride is not None or data.tail != "keep"):
        raise ConfigError(
            "stride and tail shape concatenated windows; with packing: true each document is cut at cutoff_len "
            "and packed in isolation: remove stride/tail or packing"
        )
    if data.min_length < 1:
        raise ConfigError(f"min_length must be at least 1 (empty documents are always dropped), got {data.min_length}")
    if generation.eval_generation:
        raise ConfigError(
            "eval_generation: stage pt has no answers to match; remove it (eval_loss and eval_perplexity are reported)"
        )


def _check_preference(data, finetuning, generation) -> None:
    """Stages rm / dpo / kto: unpacked pairs and their own options (ranking data: data/registry.py)."""
    ft, stage = finetuning, finetuning.stage
    row = stage_row(stage)
    if not row.pairs:
        return
    if data.packing:
        layout = "pairs are padded" if row.head == "reward" else "each step's pairs are laid out padding-free instead"
        raise ConfigError(f"packing: true is not supported with stage {stage} ({layout}); set packing: false")
    if data.padding_free and row.head == "reward":
        raise ConfigError("padding_free: true does not apply to stage rm (a reward is read at each padded row's end); remove it")
    if data.streaming:
        raise ConfigError(f"streaming: true is not supported with stage {stage}; set streaming: false")
    if data.train_on_prompt:
        raise ConfigError(f"train_on_prompt does not apply to stage {stage} (only the final answer is scored): remove it")
    if row.head == "reward" and generation.eval_generation:
        raise ConfigError("eval_generation: a reward model does not generate; remove it (eval reports reward accuracy)")
    if ft.pref_beta <= 0:
        raise ConfigError(f"pref_beta must be > 0, got {ft.pref_beta}")
    if row.reads == "unpaired" and min(ft.kto_desirable_weight, ft.kto_undesirable_weight) < 0:
        raise ConfigError("kto_desirable_weight and kto_undesirable_weight must be >= 0")
    if row.reference != "pref_loss":
        return
    if ft.precompute_ref_log_probs and ft.pref_loss in REFERENCE_FREE_LOSSES:
        raise ConfigError(
            f"precompute_ref_log_probs: pref_loss {ft.pref_loss} uses no reference model; remove precompute_ref_log_probs"
        )
    if not 0.0 <= ft.dpo_label_smoothing < 0.5:
        raise ConfigError(f"dpo_label_smoothing must be in [0, 0.5), got {ft.dpo_label_smoothing}")
    if ft.pref_ftx < 0:
        raise ConfigError(f"pref_ftx must be >= 0, got {ft.pref_ftx}")
    if ft.pref_ftx and ft.pref_loss == "orpo":
        raise ConfigError("pref_ftx: pref_loss orpo already has an SFT term (weighted against pref_beta); remove pref_ftx")


def _check_rl(data, finetuning, generation, training) -> None:
    """Stages grpo / ppo: reward functions or a reward model, and the loop's own options."""
    ft, stage = finetuning, finetuning.stage
    if generation.temperature <= 0:
        raise ConfigError(f"temperature must be > 0 (rollouts are sampled), got {generation.temperature}")
    row = stage_row(stage)
    if not row.rl:
        return
    if row.scorer == "reward_functions":
        if not ft.reward_funcs:
            raise ConfigError(
                "reward_funcs: stage grpo needs reward functions; set reward_funcs: exact_match,format "
                "(built-ins) or path/to/file.py:function"
            )
        if ft.num_generations < 2:
            raise ConfigError(
                f"num_generations must be at least 2 (advantages compare completions of the same prompt), got {ft.num_generations}"
            )
        if ft.epsilon_high is not None and ft.epsilon_high < ft.epsilon:
            raise ConfigError(
                f"epsilon_high must be >= epsilon (the ratio is clipped to [1 - epsilon, 1 + epsilon_high]), got "
                f"{ft.epsilon_high} < {ft.epsilon}"
            )
        if ft.max_tool_turns < 1:
            raise ConfigError(f"max_tool_turns must be at least 1 (tool-calling turns per rollout), got {ft.max_tool_turns}")
        if not 0.0 <= ft.top_entropy_quantile <= 1.0:
            raise ConfigError(
                f"top_entropy_quantile must be in [0, 1] (the share of tokens kept), got {ft.top_entropy_quantile}"
            )
    if row.scorer == "reward_model":
        if not ft.reward_model:
            raise ConfigError(
                "reward_model: stage ppo needs a reward model; train one with stage: rm and set reward_model to its "
                "output_dir"
            )
        if not 0.0 <= ft.ppo_gamma <= 1.0 or not 0.0 <= ft.ppo_lam <= 1.0:
            raise ConfigError(f"ppo_gamma and ppo_lam must be in [0, 1], got {ft.ppo_gamma} and {ft.ppo_lam}")
        if ft.ppo_vf_coef < 0:
            raise ConfigError(f"ppo_vf_coef must be >= 0, got {ft.ppo_vf_coef}")
    if ft.kl_coef < 0:
        raise ConfigError(f"kl_coef must be >= 0, got {ft.kl_coef}")
    if ft.epsilon <= 0:
        raise ConfigError(f"epsilon must be > 0 (the ratio is clipped to 1 ± epsilon), got {ft.epsilon}")
    if ft.num_iterations < 1:
        raise ConfigError(f"num_iterations must be at least 1, got {ft.num_iterations}")
    args = training
    if data.packing:
        raise ConfigError(f"packing: true does not apply to stage {stage} (it trains on its own generations); set packing: false")
    if data.padding_free:
        raise ConfigError(f"padding_free: true does not apply to stage {stage} (it trains on its own generations); remove it")
    if data.streaming:
        raise ConfigError(f"streaming: true is not supported with stage {stage}; set streaming: false")
    if str(getattr(args.eval_strategy, "value", args.eval_strategy)) != "no":
        raise ConfigError(
            f"eval_strategy: stage {stage} has no eval loss; remove eval_strategy and use eval_generation "
            "(held-out exact match before and after)"
        )
    if args.resume_from_checkpoint:
        raise ConfigError(f"resume_from_checkpoint is not supported by stage {stage} yet; remove it")


def _check_distillation(finetuning) -> None:
    """A stage that learns from a teacher (kd): the teacher (its folder and tokenizer are the recipe's checks, before
    any weights load), beta and lmbda."""
    ft, stage = finetuning, finetuning.stage
    if not stage_row(stage).teacher:
        return
    if not ft.teacher_model_name_or_path:
        raise ConfigError(
            f"teacher_model_name_or_path: stage {stage} needs a teacher; set it to a model folder, Hub id or GGUF file "
            "whose tokenizer is the student's", key="teacher_model_name_or_path",
        )
    if not 0.0 <= ft.beta <= 1.0:
        raise ConfigError(f"beta must be in [0, 1] (0: forward KL, 1: reverse KL, between: JSD), got {ft.beta}",
                          key="beta")
    if not 0.0 <= ft.lmbda <= 1.0:
        raise ConfigError(f"lmbda must be in [0, 1] (the share of examples the student answers itself), got "
                          f"{ft.lmbda}", key="lmbda")


def _check_streaming(data, training) -> None:
    """streaming: true reads the train set as it trains (data/streaming.py): no length, no split, no global pass."""
    if data.buffer_size < 1:
        raise ConfigError(f"buffer_size must be at least 1, got {data.buffer_size}")
    if not data.streaming:
        default = next(f.default for f in dataclasses.fields(DataArguments) if f.name == "buffer_size")
        if data.buffer_size != default:
            raise ConfigError("buffer_size only applies to streaming: true: remove it or set streaming: true")
        return
    if training.max_steps <= 0:
        raise ConfigError(
            "streaming: true needs max_steps > 0: a stream has no length to derive the number of steps from; "
            "set max_steps"
        )
    if data.val_size > 0:
        raise ConfigError(
            "val_size cannot hold out rows of a stream (streaming: true); "
            "set eval_dataset to a held-out dataset and remove val_size"
        )
    if data.dedup != "none":
        raise ConfigError(
            f"dedup: {data.dedup} compares every row with every other and cannot run with streaming: true; "
            "remove dedup or set streaming: false"
        )
    if getattr(training.accelerator_config, "dispatch_batches", None):
        raise ConfigError(
            "accelerator_config.dispatch_batches: true makes rank 0 read the whole stream and needs batches of one "
            "shape; remove it with streaming: true (each rank then reads its own shard)"
        )


def _check_dedup(data, finetuning) -> None:
    default_threshold = next(f.default for f in dataclasses.fields(DataArguments) if f.name == "dedup_threshold")
    if data.dedup_threshold != default_threshold and data.dedup != "near":
        raise ConfigError(f"dedup_threshold only applies to dedup: near (got dedup: {data.dedup}): remove it")
    if data.dedup == "none":
        return
    if stage_row(finetuning.stage).reads == "text":
        raise ConfigError("dedup: stage pt does not deduplicate documents yet; remove dedup")
    if not 0.0 < data.dedup_threshold <= 1.0:
        raise ConfigError(f"dedup_threshold must be in (0, 1], got {data.dedup_threshold}")


def _check_eval(data, generation, training) -> None:
    has_eval_set = bool(data.eval_dataset) or data.val_size > 0
    strategy = str(getattr(training.eval_strategy, "value", training.eval_strategy))
    wants_eval = [
        name
        for name, on in (
            ("eval_strategy", strategy != "no"),
            ("do_eval", training.do_eval and strategy == "no"),
            ("eval_generation", generation.eval_generation),
        )
        if on
    ]
    if wants_eval and not has_eval_set:
        raise ConfigError(f"{', '.join(wants_eval)} needs an eval set: set eval_dataset or val_size")


def _check_nan_policy(training) -> None:
    args = training
    if args.nan_max_consecutive < 1:
        raise ConfigError(f"nan_max_consecutive must be at least 1, got {args.nan_max_consecutive}")
    if args.nan_policy != "skip" and args.nan_max_consecutive != 5:
        raise ConfigError(
            f"nan_max_consecutive only applies to nan_policy: skip (got nan_policy: {args.nan_policy}): "
            "remove it or set nan_policy: skip"
        )


def _check_skip_bad_rows(data, finetuning) -> None:
    if data.skip_bad_rows and (data.streaming or stage_row(finetuning.stage).reads == "text"):
        raise ConfigError(
            "skip_bad_rows applies to conversation datasets read whole (not stage pt, not streaming: true): remove it"
        )


def _check_label_smoothing(finetuning, training) -> None:
    """label_smoothing_factor smooths the token cross-entropy (train/losses.py): stages sft and pt only."""
    factor, stage = training.label_smoothing_factor, finetuning.stage
    if not factor:
        return
    if not stage_row(stage).token_loss:
        preference = stage_row(stage).reference == "pref_loss"
        hint = " (dpo_label_smoothing smooths the preference labels)" if preference else ""
        raise ConfigError(
            f"label_smoothing_factor smooths the token cross-entropy of stages sft and pt; stage {stage} does not "
            f"train on it: remove it{hint}"
        )
    if not 0.0 <= factor < 1.0:
        raise ConfigError(f"label_smoothing_factor must be in [0, 1), got {factor}")


def _check_neftune(finetuning, training) -> None:
    """neftune_noise_alpha: transformers' Trainer adds the noise to the input embeddings while training (sft, pt), as
    TRL does in SFT only."""
    alpha, stage = training.neftune_noise_alpha, finetuning.stage
    if alpha is None:
        return
    if not (_finite(alpha) and alpha > 0):
        raise ConfigError(f"neftune_noise_alpha must be > 0 (the noise scale; NEFTune's paper uses 5 to 15), got "
                          f"{alpha}; remove it to train without noise", key="neftune_noise_alpha")
    why = stage_row(stage).neftune  # why the noise does not act, or does not belong, in this stage
    if why:
        raise ConfigError(f"neftune_noise_alpha applies to stages sft and pt; stage {stage} {why}: remove it",
                          key="neftune_noise_alpha")


def _check_liger_kernel(finetuning, training) -> None:
    """use_liger_kernel (LlamaFactory's enable_liger_kernel): transformers applies Liger's kernels when its Trainer
    trains; the GPU itself is checked when the config is read (config/loader.py), the package by tunelab/preflight.py."""
    stage = finetuning.stage
    if training.use_liger_kernel and stage_row(stage).rl:
        raise ConfigError(f"use_liger_kernel: stage {stage} trains in its own loop, where transformers does not apply "
                          "Liger's kernels: remove it", key="use_liger_kernel")


def _check_rope_scaling(model) -> None:
    """rope_scaling's values; what the model allows (a RoPE model, not scaled already, the factor from cutoff_len)
    is model/rope.py's, run by tunelab/preflight.py."""
    if model.rope_factor is None:
        return
    if model.rope_scaling is None:
        raise ConfigError("rope_factor only applies with rope_scaling: set rope_scaling (linear, dynamic, yarn or "
                          "llama3) or remove rope_factor", key="rope_factor")
    if not (_finite(model.rope_factor) and model.rope_factor > 1):
        raise ConfigError(f"rope_factor must be > 1 (the context grows by that factor), got {model.rope_factor}; "
                          "remove it to derive it from cutoff_len", key="rope_factor")


def _check_distributed(model, training) -> None:
    """DeepSpeed and FSDP come from transformers/accelerate; what we can tell before they start."""
    args = training
    if args.deepspeed and args.fsdp:
        raise ConfigError("deepspeed and fsdp are two engines for the same job: keep one")
    if args.fsdp and model.quantization_bit is not None:
        raise ConfigError(
            f"fsdp cannot shard the {model.quantization_bit}-bit weights of quantization_bit (QLoRA); "
            "remove fsdp (QLoRA trains one copy per process with DDP) or quantization_bit"
        )
    if args.deepspeed and model.quantization_bit is not None:
        raise ConfigError(
            f"deepspeed cannot train the {model.quantization_bit}-bit weights of quantization_bit (QLoRA); "
            "remove deepspeed or quantization_bit"
        )


# ---- the training loop's extensions: callbacks, early stopping, generation at evaluation (docs/training.md) ----

def _strategy(value) -> str:
    return str(getattr(value, "value", value))


def _check_load_best_model_values(values: dict) -> None:
    """load_best_model_at_end reloads a checkpoint saved at an evaluation: say how before transformers does (its
    message runs to several lines, of which the CLI shows one)."""
    if not values.get("load_best_model_at_end"):
        return
    evaluation, save = _strategy(values.get("eval_strategy", "no")), _strategy(values.get("save_strategy", "no"))
    if evaluation == "no":
        raise ConfigError("load_best_model_at_end: true needs evaluations to pick the best: set eval_strategy (steps or epoch)")
    if save != "best" and save != evaluation:
        raise ConfigError(
            f"load_best_model_at_end: true reloads the best checkpoint, so checkpoints must be saved where evaluations "
            f"happen: set save_strategy: {evaluation} (got {save}){' with save_steps a multiple of eval_steps' if evaluation == 'steps' else ''}"
        )
    if evaluation == "steps" and save == "steps":
        eval_steps, save_steps = values.get("eval_steps") or values.get("logging_steps"), values.get("save_steps", 500)
        if eval_steps and save_steps and float(save_steps) % float(eval_steps):
            raise ConfigError(
                f"load_best_model_at_end: true needs save_steps ({float(save_steps):g}) to be a multiple of eval_steps "
                f"({float(eval_steps):g}), "
                "so that the best evaluation has a checkpoint"
            )


def _check_callbacks(finetuning, training) -> None:
    """callback_kwargs need callbacks; the RL stages' own loop fires no Trainer events. (The classes are imported and
    checked by train/callbacks.py, called from tunelab/preflight.py.)"""
    args, stage = training, finetuning.stage
    if args.callback_kwargs and not args.callbacks:
        raise ConfigError("callback_kwargs is set but callbacks is not: name the callback classes in callbacks")
    if not args.callbacks:
        return
    if stage_row(stage).rl:
        raise ConfigError(
            f"callbacks: stage {stage} trains in its own loop, where the Trainer's callback events do not fire; "
            "remove callbacks (trainer_log.jsonl still records every logged step)"
        )


def _check_early_stopping(data, finetuning, generation, training) -> None:
    args, stage = training, finetuning.stage
    patience = args.early_stopping_patience
    if patience is None:
        if args.early_stopping_threshold != 0.0:
            raise ConfigError("early_stopping_threshold only applies with early_stopping_patience: set it or remove the threshold")
        return
    if patience < 1:
        raise ConfigError(f"early_stopping_patience must be at least 1 (evaluations without improvement), got {patience}")
    if args.early_stopping_threshold < 0:
        raise ConfigError(f"early_stopping_threshold must be >= 0, got {args.early_stopping_threshold}")
    if stage_row(stage).rl:
        raise ConfigError(f"early_stopping_patience: stage {stage} has no evaluations to stop on; remove it")
    if not data.eval_dataset and data.val_size <= 0:
        raise ConfigError("early_stopping_patience needs an eval set to watch: set eval_dataset or val_size")
    if _strategy(args.eval_strategy) == "no":
        raise ConfigError(
            "early_stopping_patience counts evaluations, but eval_strategy is 'no': set eval_strategy: steps "
            "with eval_steps (or epoch)"
        )
    _check_metric_for_best_model(data, finetuning, generation, training, "early_stopping_patience")


def _check_metric_for_best_model(data, finetuning, generation, training, why: str) -> None:
    metric = training.metric_for_best_model
    if metric is None:
        return
    metric = metric if metric.startswith("eval_") else f"eval_{metric}"
    known = eval_metric_names(data, finetuning, generation, training)
    if metric not in known:
        close = difflib.get_close_matches(metric, known, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise ConfigError(
            f"metric_for_best_model: '{training.metric_for_best_model}' is not an eval metric this run logs "
            f"({why} watches it); {hint}it logs {', '.join(known)}"
        )


def _check_load_best_model(data, finetuning, generation, training) -> None:
    if training.load_best_model_at_end and not stage_row(finetuning.stage).rl:
        _check_metric_for_best_model(data, finetuning, generation, training, "load_best_model_at_end")


def _check_generate_at_eval(finetuning, generation, training) -> None:
    if not generation.generate_at_eval:
        return
    stage = finetuning.stage
    if stage_row(stage).reads != "supervised":
        raise ConfigError(
            f"generate_at_eval applies to stage sft (answers to generate and compare), got stage {stage}; remove it"
        )
    if _strategy(training.eval_strategy) == "no":
        raise ConfigError("generate_at_eval generates at each evaluation, but eval_strategy is 'no': set eval_strategy: steps with eval_steps")
    if generation.eval_generation_samples < 1:
        raise ConfigError(f"eval_generation_samples must be at least 1, got {generation.eval_generation_samples}")


def _check_ignore_pad_token_for_loss(data) -> None:
    if not data.ignore_pad_token_for_loss:
        raise ConfigError(
            "ignore_pad_token_for_loss: false would train on padding; tunelab never does (padding labels are always "
            "-100): remove it"
        )


# ---- the optimizer: memory-saving optimizers and LoRA+ (train/optimizers.py, docs/training.md) ----------------

# The option that turns each optimizer on, and the prefix of the options that tune it.
OPTIMIZER_SWITCHES = {"use_galore": "galore_", "use_apollo": "apollo_", "use_badam": "badam_", "use_adam_mini": None,
                      "use_muon": None, "loraplus_lr_ratio": None}
ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused")
# transformers' optim values that GaLore maps to its own AdamW / 8-bit AdamW / Adafactor (as LlamaFactory does).
GALORE_OPTIMS = (*ADAMW_OPTIMS, "adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit", "adafactor")
# transformers' own optimizers that build their parameter groups themselves or step inside backward.
SELF_GROUPING_OPTIMS = ("galore", "apollo", "lomo", "layerwise")


def chosen_optimizers(finetuning) -> list[str]:
    """The optimizer switches a run turned on (use_galore, ..., loraplus_lr_ratio), in declaration order."""
    return [key for key in OPTIMIZER_SWITCHES if getattr(finetuning, key) not in (False, None)]


def _check_optimizers(finetuning, training) -> None:
    ft, args = finetuning, training
    chosen = chosen_optimizers(ft)
    _check_optimizer_sub_options(ft, chosen)
    if len(chosen) > 1:
        raise ConfigError(f"{' and '.join(chosen)} each choose the optimizer: keep one", key=chosen[1])
    if not chosen:
        return
    key, optim = chosen[0], _strategy(args.optim)
    if key == "loraplus_lr_ratio":
        _check_loraplus(ft, optim)
        return
    if args.deepspeed or args.fsdp:
        engine = "deepspeed" if args.deepspeed else "fsdp"
        raise ConfigError(f"{key} builds its own optimizer states, which {engine} cannot shard: remove {key} or {engine}",
                          key=key)
    allowed = {"use_galore": GALORE_OPTIMS, "use_badam": None}.get(key, ADAMW_OPTIMS)
    if allowed is not None and optim not in allowed:
        raise ConfigError(f"{key} works with optim: {' / '.join(allowed)}, got optim: {optim}; remove optim", key="optim")
    if key == "use_badam":
        _check_badam(ft, args, optim)
    if (key == "use_galore" and ft.galore_layerwise) or (key == "use_apollo" and ft.apollo_layerwise):
        _check_layerwise(key.removeprefix("use_") + "_layerwise", args)
    for name in ("galore", "apollo"):
        if key == f"use_{name}":
            for option in ("rank", "update_interval"):
                if getattr(ft, f"{name}_{option}") < 1:
                    raise ConfigError(f"{name}_{option} must be at least 1, got {getattr(ft, f'{name}_{option}')}")
            if getattr(ft, f"{name}_scale") <= 0:
                raise ConfigError(f"{name}_scale must be > 0, got {getattr(ft, f'{name}_scale')}")


def _check_optimizer_sub_options(ft, chosen: list[str]) -> None:
    """galore_* / apollo_* / badam_* options set without their use_* switch do nothing: refused."""
    defaults = type(ft)()
    for switch, prefix in OPTIMIZER_SWITCHES.items():
        if prefix is None or switch in chosen:
            continue
        for option in dataclasses.fields(ft):
            if option.name.startswith(prefix) and getattr(ft, option.name) != getattr(defaults, option.name):
                raise ConfigError(f"{option.name} only applies with {switch}: true: set {switch}: true or remove "
                                  f"{option.name}", key=option.name)
    if ft.loraplus_lr_embedding != defaults.loraplus_lr_embedding and "loraplus_lr_ratio" not in chosen:
        raise ConfigError("loraplus_lr_embedding only applies with loraplus_lr_ratio (LoRA+): set loraplus_lr_ratio "
                          "or remove loraplus_lr_embedding", key="loraplus_lr_embedding")


def _check_loraplus(ft, optim: str) -> None:
    if not ft.loraplus_lr_ratio > 0:
        raise ConfigError(f"loraplus_lr_ratio must be > 0 (lr_B / lr_A, typically 2 to 16), got {ft.loraplus_lr_ratio}")
    if not ft.loraplus_lr_embedding > 0:
        raise ConfigError(f"loraplus_lr_embedding must be > 0, got {ft.loraplus_lr_embedding}")
    if any(word in optim for word in SELF_GROUPING_OPTIMS):
        raise ConfigError(f"loraplus_lr_ratio sets learning rates per parameter group, which optim: {optim} builds "
                          "itself: remove optim", key="optim")


def _check_badam(ft, args, optim: str) -> None:
    if ft.badam_mode == "ratio":
        raise ConfigError(
            "badam_mode: ratio is not supported: badam 1.4's ratio mode makes sparse gradients, which gradient "
            "clipping cannot take, and fails on models with tied embeddings; use badam_mode: layer", key="badam_mode")
    if ft.badam_switch_interval < 1:
        raise ConfigError(f"badam_switch_interval must be at least 1, got {ft.badam_switch_interval} (to train one "
                          "block only, set badam_switch_mode: fixed)", key="badam_switch_interval")
    if ft.badam_start_block is not None and ft.badam_start_block < 0:
        raise ConfigError(f"badam_start_block must be >= 0 (a decoder layer's index), got {ft.badam_start_block}")
    if stage_row(ft.stage).head:
        raise ConfigError(f"use_badam trains the decoder layers only, so stage {ft.stage}'s value head would never "
                          "learn: remove use_badam", key="use_badam")
    if any(word in optim for word in SELF_GROUPING_OPTIMS):
        raise ConfigError(f"use_badam steps a plain optimizer per block; optim: {optim} is not one: remove optim",
                          key="optim")
    if args.nan_policy == "skip":
        raise ConfigError("nan_policy: skip drops a step's gradients, which BAdam's step requires: remove "
                          "nan_policy: skip or use_badam", key="nan_policy")


def _check_layerwise(key: str, args) -> None:
    """Layer-wise steps happen inside backward, before anything the loop does after it."""
    if args.gradient_accumulation_steps != 1:
        raise ConfigError(f"{key} steps each weight during its backward pass, so gradients cannot accumulate: set "
                          "gradient_accumulation_steps: 1 or remove it", key=key)
    if args.resume_from_checkpoint:
        raise ConfigError(f"{key}: checkpoints do not hold its per-weight optimizer states, so a resume would not "
                          f"continue the run: remove resume_from_checkpoint or {key}", key=key)
    if args.nan_policy == "skip":
        raise ConfigError(f"nan_policy: skip cannot undo the steps {key} took during backward: remove nan_policy: "
                          f"skip or {key}", key=key)


LOOP_CHECKS = (_check_callbacks, _check_early_stopping, _check_load_best_model, _check_generate_at_eval,
               _check_ignore_pad_token_for_loss, _check_optimizers)

# Every value check check_config runs, in its order, with the option groups it reads (RunConfig's field names, which
# are its parameters' names too: tests/config/test_value_check_table.py holds them equal).
VALUE_CHECKS = (
    (_check_finetuning, ("finetuning", "training")),
    (_check_adapter_methods, ("model", "finetuning", "training")),
    (_check_quantization, ("model", "finetuning")),
    (_check_qat, ("model", "finetuning", "export")),
    (_check_template_options, ("data", "finetuning")),
    (_check_dataset_named, ("data",)),
    (_check_data, ("model", "data", "generation")),
    (_check_stage_data, ("data", "finetuning", "generation")),
    (_check_preference, ("data", "finetuning", "generation")),
    (_check_rl, ("data", "finetuning", "generation", "training")),
    (_check_distillation, ("finetuning",)),
    (_check_streaming, ("data", "training")),
    (_check_dedup, ("data", "finetuning")),
    (_check_eval, ("data", "generation", "training")),
    (_check_nan_policy, ("training",)),
    (_check_skip_bad_rows, ("data", "finetuning")),
    (_check_label_smoothing, ("finetuning", "training")),
    (_check_neftune, ("finetuning", "training")),
    (_check_liger_kernel, ("finetuning", "training")),
    (_check_rope_scaling, ("model",)),
    (_check_distributed, ("model", "training")),
    (_check_callbacks, ("finetuning", "training")),
    (_check_early_stopping, ("data", "finetuning", "generation", "training")),
    (_check_load_best_model, ("data", "finetuning", "generation", "training")),
    (_check_generate_at_eval, ("finetuning", "generation", "training")),
    (_check_ignore_pad_token_for_loss, ("data",)),
    (_check_optimizers, ("finetuning", "training")),
)
