"""Every cross-argument check, in one place, run before any model or data is loaded.

Each check raises ConfigError with one line naming the key(s) and the fix. Stages add their checks
here, beside the others, so a bad config fails in well under a second. The one check that needs the
loaded model (lora_target naming real modules) lives in model/adapters.py.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
from pathlib import Path

from tunelab.config.args import DataArguments, FinetuningArguments, RunConfig
from tunelab.errors import ConfigError

AVAILABLE_STAGES = ("pt", "sft")
PT_ONLY_KEYS = ("stride", "min_length", "tail", "text_column", "txt_sample_by")
# What `tunelab data stats` writes into output_dir; a folder holding only this still counts as empty.
DATA_STATS_DIR = "data_stats"
LORA_ONLY_KEYS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_target", "additional_target", "use_dora", "use_rslora")


def check_training_values(values: dict) -> None:
    """Checks on raw TrainingArguments values, run before transformers validates them its own way."""
    if values.get("fp16") and values.get("bf16"):
        raise ConfigError("fp16 and bf16 are both true: keep one (bf16 where the hardware supports it)")


def check_config(config: RunConfig, purpose: str = "train") -> None:
    """purpose "data" (`tunelab data ...`) reads data only, so output_dir is not checked."""
    for check in (
        _check_stage,
        _check_finetuning,
        _check_quantization,
        _check_model_folder,
        _check_template,
        _check_data,
        _check_stage_data,
        _check_streaming,
        _check_dedup,
        _check_eval,
        _check_output_dir,
    ):
        if purpose == "data" and check is _check_output_dir:
            continue
        check(config)


def _check_stage(config: RunConfig) -> None:
    stage = config.finetuning.stage
    if stage not in AVAILABLE_STAGES:
        raise ConfigError(
            f"stage: '{stage}' is not available in this version (available: {', '.join(AVAILABLE_STAGES)})"
        )


def _check_finetuning(config: RunConfig) -> None:
    ft = config.finetuning
    if ft.finetuning_type != "lora":
        defaults = {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
                    for f in dataclasses.fields(FinetuningArguments)}
        changed = [k for k in LORA_ONLY_KEYS if getattr(ft, k) != defaults[k]]
        if changed:
            raise ConfigError(
                f"{', '.join(changed)} only apply to finetuning_type: lora (got '{ft.finetuning_type}'): "
                "remove them or set finetuning_type: lora"
            )
    if ft.lora_rank < 1:
        raise ConfigError(f"lora_rank must be at least 1, got {ft.lora_rank}")
    if not 0.0 <= ft.lora_dropout < 1.0:
        raise ConfigError(f"lora_dropout must be in [0, 1), got {ft.lora_dropout}")


def _check_quantization(config: RunConfig) -> None:
    bits = config.model.quantization_bit
    if bits is None:
        return
    if bits not in (4, 8):
        raise ConfigError(f"quantization_bit must be 4 or 8, got {bits}")
    if config.finetuning.finetuning_type != "lora":
        raise ConfigError(
            f"quantization_bit: {bits} needs finetuning_type: lora (QLoRA), got '{config.finetuning.finetuning_type}'"
        )


def _check_model_folder(config: RunConfig) -> None:
    path = Path(config.model.model_name_or_path)
    if not path.is_dir():
        raise ConfigError(
            f"model_name_or_path: {path} is not a folder; point it at a local Hugging Face model folder"
        )
    if not (path / "config.json").is_file():
        raise ConfigError(f"model_name_or_path: {path} has no config.json; is it a complete Hugging Face model folder?")
    adapter = config.model.adapter_name_or_path
    if adapter and not (Path(adapter) / "adapter_config.json").is_file():
        raise ConfigError(f"adapter_name_or_path: {adapter} has no adapter_config.json")


def _check_template(config: RunConfig) -> None:
    from tunelab.data.templates import TEMPLATE_NAMES, tokenizer_chat_template  # noqa: PLC0415

    if config.finetuning.stage == "pt":
        return  # raw text trains without a chat template
    name = config.data.template
    if name is None or name == "model":
        if tokenizer_chat_template(config.model.model_name_or_path) is None:
            raise ConfigError(
                f"template: the tokenizer in {config.model.model_name_or_path} has no chat_template; "
                f"set template to one of {', '.join(TEMPLATE_NAMES)}"
            )
        return
    if name not in TEMPLATE_NAMES:
        close = difflib.get_close_matches(name, TEMPLATE_NAMES, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise ConfigError(f"template: '{name}' does not exist; {hint}built-ins: {', '.join(TEMPLATE_NAMES)}")


def _check_data(config: RunConfig) -> None:
    from tunelab.data.registry import load_registry  # noqa: PLC0415

    data = config.data
    if data.cutoff_len < 2:
        raise ConfigError(f"cutoff_len must be at least 2, got {data.cutoff_len}")
    if data.train_on_prompt and data.mask_history:
        raise ConfigError("train_on_prompt and mask_history contradict each other: keep one")
    if data.packing and config.model.flash_attn == "fa2" and config.model.trust_remote_code:
        # Packed fa2 relies on transformers' own attention code taking cu_seq_lens (data/packing.py).
        raise ConfigError(
            "packing with flash_attn: fa2 cannot keep samples isolated in trust_remote_code models; "
            "set flash_attn: sdpa (a block mask is used), or packing: false"
        )
    if not data.dataset:
        raise ConfigError("dataset is not set: name one or more datasets from dataset_info.json")
    if data.val_size < 0:
        raise ConfigError(f"val_size must be >= 0, got {data.val_size}")
    registry = load_registry(data.dataset_dir)
    for key in ("dataset", "eval_dataset"):
        for name in getattr(data, key) or []:
            if name not in registry:
                close = difflib.get_close_matches(name, list(registry), n=1)
                hint = f"did you mean '{close[0]}'? " if close else ""
                where = f"{data.dataset_dir}/dataset_info.json" if data.dataset_dir else "the built-in registry"
                raise ConfigError(f"{key}: '{name}' is not in {where}; {hint}add it to dataset_info.json")
    if data.interleave_probs is not None:
        if data.mix_strategy == "concat":
            raise ConfigError("interleave_probs needs mix_strategy: interleave_under or interleave_over")
        if len(data.interleave_probs) != len(data.dataset or []):
            raise ConfigError(
                f"interleave_probs has {len(data.interleave_probs)} values for {len(data.dataset or [])} datasets"
            )


def _check_stage_data(config: RunConfig) -> None:
    """Stage pt trains on raw text (formatting: text), every other stage on conversations; pt's window options."""
    from tunelab.data.registry import load_registry  # noqa: PLC0415

    data, stage = config.data, config.finetuning.stage
    registry = load_registry(data.dataset_dir)
    for key in ("dataset", "eval_dataset"):
        for name in getattr(data, key) or []:
            formatting = registry[name].formatting
            if stage == "pt" and formatting != "text":
                raise ConfigError(
                    f"{key}: '{name}' has formatting: {formatting}, but stage pt trains on raw documents; "
                    "use a dataset with formatting: text (e.g. demo_corpus) or another stage"
                )
            if stage != "pt" and formatting == "text":
                raise ConfigError(
                    f"{key}: '{name}' is a raw text corpus (formatting: text) for stage pt; "
                    f"stage {stage} needs an alpaca, sharegpt or openai dataset"
                )
    if stage != "pt":
        defaults = {f.name: f.default for f in dataclasses.fields(DataArguments) if f.name in PT_ONLY_KEYS}
        changed = [k for k in PT_ONLY_KEYS if getattr(data, k) != defaults[k]]
        if changed:
            raise ConfigError(f"{', '.join(changed)} only apply to stage pt (got stage: {stage}): remove them")
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
    if config.generation.eval_generation:
        raise ConfigError(
            "eval_generation: stage pt has no answers to match; remove it (eval_loss and eval_perplexity are reported)"
        )


def _check_streaming(config: RunConfig) -> None:
    """streaming: true reads the train set as it trains (data/streaming.py): no length, no split, no global pass."""
    data = config.data
    if data.buffer_size < 1:
        raise ConfigError(f"buffer_size must be at least 1, got {data.buffer_size}")
    if not data.streaming:
        default = next(f.default for f in dataclasses.fields(DataArguments) if f.name == "buffer_size")
        if data.buffer_size != default:
            raise ConfigError("buffer_size only applies to streaming: true: remove it or set streaming: true")
        return
    if config.training.max_steps <= 0:
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
    if getattr(config.training.accelerator_config, "dispatch_batches", None):
        raise ConfigError(
            "accelerator_config.dispatch_batches: true makes rank 0 read the whole stream and needs batches of one "
            "shape; remove it with streaming: true (each rank then reads its own shard)"
        )


def _check_dedup(config: RunConfig) -> None:
    data = config.data
    default_threshold = next(f.default for f in dataclasses.fields(DataArguments) if f.name == "dedup_threshold")
    if data.dedup_threshold != default_threshold and data.dedup != "near":
        raise ConfigError(f"dedup_threshold only applies to dedup: near (got dedup: {data.dedup}): remove it")
    if data.dedup == "none":
        return
    if config.finetuning.stage == "pt":
        raise ConfigError("dedup: stage pt does not deduplicate documents yet; remove dedup")
    if not 0.0 < data.dedup_threshold <= 1.0:
        raise ConfigError(f"dedup_threshold must be in (0, 1], got {data.dedup_threshold}")
    if data.dedup == "near" and importlib.util.find_spec("datasketch") is None:
        raise ConfigError("dedup: near needs the datasketch package: pip install tunelab[dedup]")


def _check_eval(config: RunConfig) -> None:
    has_eval_set = bool(config.data.eval_dataset) or config.data.val_size > 0
    strategy = str(getattr(config.training.eval_strategy, "value", config.training.eval_strategy))
    wants_eval = [
        name
        for name, on in (
            ("eval_strategy", strategy != "no"),
            ("do_eval", config.training.do_eval and strategy == "no"),
            ("eval_generation", config.generation.eval_generation),
        )
        if on
    ]
    if wants_eval and not has_eval_set:
        raise ConfigError(f"{', '.join(wants_eval)} needs an eval set: set eval_dataset or val_size")


def _check_output_dir(config: RunConfig) -> None:
    out = Path(config.training.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output_dir: {out} exists and is not a folder")
    if out.is_dir() and any(p.name != DATA_STATS_DIR for p in out.iterdir()):
        if not (config.training.overwrite_output_dir or config.training.resume_from_checkpoint):
            raise ConfigError(
                f"output_dir: {out} is not empty; set overwrite_output_dir: true, resume_from_checkpoint, "
                "or choose another folder"
            )
