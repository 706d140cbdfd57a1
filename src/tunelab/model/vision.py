"""Vision-language models: recognising one, loading its processor, and which of its parts train.

A model folder is a vision-language model when its config is one transformers' image-text-to-text auto class
loads (LLaVA, Gemma 3, Qwen2-VL, Idefics3 / SmolVLM, ...); it is then loaded with AutoModelForImageTextToText and
AutoProcessor (model/load.py), and the processor does everything image-specific (resizing, normalising, the image
tokens' expansion; data/vision.py).

Its parts, by module name (transformers 5.x names): the vision tower (`vision_tower`, `visual`, `vision_model`),
the multi-modal projector (`multi_modal_projector`, `visual.merger`, `connector`) and the language model (the
rest). LlamaFactory's options decide which train:
  - freeze_vision_tower (default true): the tower is frozen (full / freeze) and never gets LoRA;
  - freeze_multi_modal_projector (default true): the same for the projector;
  - train_mm_proj_only: only the projector trains (finetuning_type full).
LoRA's `lora_target: all` is every linear layer of the language model (plus the tower / projector when they are
not frozen); named targets are matched in those parts only.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from torch import nn
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

from tunelab.errors import ConfigError

logger = logging.getLogger(__name__)

TOWER_NAMES = ("vision_tower", "visual", "vision_model")
PROJECTOR_NAMES = ("multi_modal_projector", "merger", "connector", "mm_projector")


def is_vision_model_folder(path: str | Path) -> bool:
    """True when the folder's config.json is a model type transformers' image-text-to-text auto class loads."""
    try:
        config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES \
        and "vision_config" in config


@dataclass(frozen=True)
class VisionParts:
    """Module-name prefixes (with the trailing dot) of a vision-language model's tower and projector."""

    tower: tuple[str, ...]
    projector: tuple[str, ...]

    def part_of(self, name: str) -> str:
        """'projector', 'tower' or 'language' for a parameter or module name (the projector may sit in the tower)."""
        dotted = name + "."
        if dotted.startswith(self.projector):
            return "projector"
        if dotted.startswith(self.tower):
            return "tower"
        return "language"


def vision_parts(model: nn.Module) -> VisionParts | None:
    """The tower and projector of a vision-language model (PEFT-wrapped or not), None for a text-only model."""
    tower: list[str] = []
    projector: list[str] = []
    for name, _ in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in TOWER_NAMES and not any(name.startswith(p) for p in tower):
            tower.append(name + ".")
        elif leaf in PROJECTOR_NAMES and not any(name.startswith(p) for p in projector):
            projector.append(name + ".")
    if not tower:
        return None
    return VisionParts(tuple(tower), tuple(projector))


def frozen_parts(finetuning_args) -> set[str]:
    """The parts that must not train: 'tower', 'projector', 'language'."""
    if finetuning_args.train_mm_proj_only:
        return {"tower", "language"}
    frozen = set()
    if finetuning_args.freeze_vision_tower:
        frozen.add("tower")
    if finetuning_args.freeze_multi_modal_projector:
        frozen.add("projector")
    return frozen


def check_options(finetuning_args, is_vision: bool) -> None:
    """The vision options make sense for this model and method (one line each)."""
    ft = finetuning_args
    if not is_vision:
        changed = [k for k, default in (("freeze_vision_tower", True), ("freeze_multi_modal_projector", True),
                                        ("train_mm_proj_only", False)) if getattr(ft, k) != default]
        if changed:
            raise ConfigError(f"{changed[0]}: model_name_or_path is a text-only model (no vision tower): remove it")
        return
    if ft.train_mm_proj_only and ft.finetuning_type != "full":
        raise ConfigError(
            f"train_mm_proj_only: trains the projector's weights themselves, so it needs finetuning_type: full "
            f"(got {ft.finetuning_type})"
        )


def apply_freeze(model: nn.Module, parts: VisionParts, frozen: set[str]) -> int:
    """Turn off requires_grad for the frozen parts; returns how many parameters were frozen."""
    count = 0
    for name, param in model.named_parameters():
        if param.requires_grad and parts.part_of(name) in frozen:
            param.requires_grad_(False)
            count += param.numel()
    return count


def lora_excluded_modules(model: nn.Module, parts: VisionParts, frozen: set[str]) -> list[str]:
    """Full names of the modules LoRA must leave alone (peft's exclude_modules): everything in a frozen part."""
    return [name for name, _ in model.named_modules() if name and parts.part_of(name) in frozen]


def log_parts(model: nn.Module, parts: VisionParts) -> None:
    counts: dict[str, list[int]] = {"tower": [0, 0], "projector": [0, 0], "language": [0, 0]}
    for name, param in model.named_parameters():
        entry = counts[parts.part_of(name)]
        entry[1] += param.numel()
        if param.requires_grad:
            entry[0] += param.numel()
    logger.info("trainable parameters by part: %s", ", ".join(
        f"{part} {trainable:,} of {total:,}" for part, (trainable, total) in counts.items()
    ))
