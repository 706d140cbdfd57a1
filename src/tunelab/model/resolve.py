"""The model options resolved to what transformers' loading takes: the weights' dtype and the attention
implementation. model/load.py loads with them; `tunelab data` builds the model class's skeleton with them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tunelab.config.args import ModelArguments

if TYPE_CHECKING:
    from tunelab.config.training_args import TrainingArguments

# flash_attn option -> transformers' attn_implementation (None: let transformers choose).
ATTN_IMPLEMENTATIONS = {"auto": None, "disabled": "eager", "sdpa": "sdpa", "fa2": "flash_attention_2"}


def resolve_dtype(model_args: ModelArguments, training_args: TrainingArguments) -> torch.dtype:
    if model_args.compute_dtype != "auto":
        return getattr(torch, model_args.compute_dtype)
    if training_args.bf16:
        return torch.bfloat16
    if training_args.fp16:
        return torch.float16
    return torch.float32
