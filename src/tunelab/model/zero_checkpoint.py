"""DeepSpeed ZeRO checkpoints as plain weights: the folder a ZeRO run saves (`checkpoint-N/`, or the output folder
when `stage3_gather_16bit_weights_on_model_save` is false) holds each rank's partition of the float32 master
weights under `global_stepN/` and names that step in `latest`, beside transformers' config.json and tokenizer.

`consolidated_state_dict` joins the partitions into one float32 state dict with DeepSpeed's own `zero_to_fp32`
(no process group: it reads the files), so `tunelab export model_name_or_path=out/checkpoint-N` writes one plain
Hugging Face folder. The master weights are what training updates; the 16-bit copy a ZeRO-3 save may also gather
(model.safetensors) is their rounding under bf16 / fp16, so the shards win when both are there.

DeepSpeed's files are pickles (torch.load with weights_only=False inside zero_to_fp32): reading them runs code
from the file, so it takes `allow_pickle_weights: true`, as any pickle weights do (docs/distributed.md).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from tunelab.errors import ModelError

logger = logging.getLogger(__name__)

LATEST = "latest"  # DeepSpeed's file naming the tag (global_stepN) of the last save in a folder


def zero_tag(folder: str | Path) -> str | None:
    """The tag (`global_stepN`) of the ZeRO checkpoint saved in `folder`, or None if it holds none."""
    latest = Path(folder) / LATEST
    if not latest.is_file():
        return None
    tag = latest.read_text(encoding="utf-8").strip()
    return tag if (Path(folder) / tag).is_dir() else None


def consolidated_state_dict(folder: str | Path, allow_pickle: bool, key: str = "model_name_or_path") -> dict:
    """The float32 weights of the ZeRO checkpoint in `folder`, gathered from every rank's partition."""
    folder = Path(folder)
    tag = zero_tag(folder)
    if tag is None:
        raise ModelError(f"{key}: {folder} holds no DeepSpeed checkpoint (no '{LATEST}' file naming a global_step folder)")
    if (folder / "adapter_config.json").is_file():
        raise ModelError(
            f"{key}: {folder} is a DeepSpeed checkpoint of a LoRA run; export its adapter instead: "
            "adapter_name_or_path=<the run's output folder> with model_name_or_path=<the base model>"
        )
    if not allow_pickle:
        raise ModelError(
            f"{key}: {folder}/{tag} holds DeepSpeed's pickle shards, which can run code when loaded; set "
            "allow_pickle_weights: true if you trust the run that wrote them"
        )
    try:
        # lazy: the deepspeed extra, which may be missing
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError:
        raise ModelError(
            f"{key}: {folder} is a DeepSpeed checkpoint; reading its shards needs deepspeed: pip install 'tunelab[deepspeed]'"
        ) from None
    state_dict = get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=tag)
    logger.info("consolidated %d tensors from the ZeRO shards in %s/%s", len(state_dict), folder, tag)
    return {name: tensor.contiguous() for name, tensor in state_dict.items()}


def load_into(model: torch.nn.Module, state_dict: dict, folder: str | Path) -> None:
    """Put consolidated weights into a model built from the checkpoint's config.json; every parameter must be
    there (a tied output head counts as its embedding)."""
    result = model.load_state_dict(state_dict, strict=False)
    model.tie_weights()
    tied = {name for name, p in model.named_parameters(remove_duplicate=False)} - dict(model.named_parameters()).keys()
    missing = [name for name in result.missing_keys if name not in tied]
    if missing or result.unexpected_keys:
        what = f"lacks {missing[0]}" if missing else f"has {result.unexpected_keys[0]}, which the model does not"
        raise ModelError(
            f"model_name_or_path: the DeepSpeed checkpoint in {folder} {what} "
            f"({len(missing)} missing, {len(result.unexpected_keys)} unexpected); was it saved by another model?"
        )
