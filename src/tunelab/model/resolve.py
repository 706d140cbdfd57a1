"""The model options resolved to what transformers' loading takes: the weights' dtype and the attention
implementation. model/load.py loads with them; `tunelab data` builds the model class's skeleton with them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tunelab.config.args import FinetuningArguments, ModelArguments

if TYPE_CHECKING:
    from tunelab.config.training_args import TrainingArguments

# flash_attn option -> transformers' attn_implementation (None: let transformers choose).
ATTN_IMPLEMENTATIONS = {"auto": None, "disabled": "eager", "sdpa": "sdpa", "fa2": "flash_attention_2"}


def resolve_dtype(
    model_args: ModelArguments, training_args: TrainingArguments, finetuning_args: FinetuningArguments | None = None
) -> torch.dtype:
    """The dtype the weights load in. auto: float32 without mixed precision; with it, the half dtype of the flags
    for weights that stay frozen (freeze, LoRA, inference), and float32 for a full fine-tune, whose every weight is a
    float32 master copy under autocast (model/adapters.py) unless pure_bf16 trains bf16 weights themselves."""
    if model_args.compute_dtype != "auto":
        return getattr(torch, model_args.compute_dtype)
    full = finetuning_args is not None and finetuning_args.finetuning_type == "full"
    if training_args.bf16:
        return torch.bfloat16 if not full or finetuning_args.pure_bf16 else torch.float32
    if training_args.fp16:
        return torch.float32 if full else torch.float16
    return torch.float32
