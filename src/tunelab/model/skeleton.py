"""A model on the meta device: the class, attention backend, dtype and (set up for training) trainable parameters a
run would get, with no weights read. `tunelab data` chooses the stage's collator on it; `tunelab estimate` counts
the parameters and activations of model/adapters.py's trained_skeleton (it set up for training)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from tunelab.config.args import FinetuningArguments, ModelArguments
from tunelab.errors import ModelError, first_line
from tunelab.model import gguf, varlen_sdpa
from tunelab.model.resolve import ATTN_IMPLEMENTATIONS, resolve_dtype
from tunelab.model.vision import is_vision_model_folder

if TYPE_CHECKING:
    from tunelab.config.training_args import TrainingArguments


def skeleton(model: ModelArguments, finetuning: FinetuningArguments, training: TrainingArguments) -> torch.nn.Module:
    """The model class, attention backend and dtype training would load, on the meta device. flash_attn: fa2 builds
    with transformers' default attention (flash-attn need not be installed to plan a run). `training` gives the
    mixed-precision flags (TrainingValues under `tunelab data`)."""
    path = model.model_name_or_path
    kwargs: dict[str, Any] = {"dtype": resolve_dtype(model, training, finetuning),
                              "trust_remote_code": model.trust_remote_code}
    attn = ATTN_IMPLEMENTATIONS[model.flash_attn]
    if attn is not None and attn != "flash_attention_2":
        kwargs["attn_implementation"] = attn
    try:
        model_config = gguf.load_config(path, trust_remote_code=model.trust_remote_code)
        model_config.use_cache = False  # as load_model sets it for training
        model_config.get_text_config().use_cache = False
        auto_class = AutoModelForImageTextToText if is_vision_model_folder(path) else AutoModelForCausalLM
        with torch.device("meta"):
            built = auto_class.from_config(model_config, **kwargs)
        varlen_sdpa.use_for_training(built)  # as load_model switches it for training
        return built
    except Exception as exc:  # noqa: BLE001  (unknown architecture, unreadable config.json, ...)
        where = path if gguf.is_gguf(path) else f"{path}/config.json"
        raise ModelError(f"model_name_or_path: cannot build the model class from {where}: "
                         f"{first_line(exc)}") from exc


def vocab_size(model_dir: str | Path) -> int | None:
    """vocab_size from config.json (or its text_config), or a GGUF's metadata, without loading the model."""
    if gguf.is_gguf(model_dir):
        return gguf.vocab_size(model_dir)
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return int(size) if size else None
