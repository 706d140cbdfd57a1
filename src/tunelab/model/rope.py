"""RoPE scaling (`rope_scaling`, `rope_factor`): a model run past the context it was trained on, set as it loads.

transformers 5 keeps a model's rotary settings in its (text) config's `rope_parameters` ({rope_type, rope_theta,
factor, ...}; `rope_scaling` is transformers 4's and LlamaFactory's name). A run with rope_scaling loads the model
from its config with them replaced, which the rotary embedding reads when it is built:

    rope_scaling   rope_parameters (rope_theta kept)                          max_position_embeddings
    linear         factor: positions divided by it                            × factor
    dynamic        factor: NTK, the base grows once a sequence outgrows       kept: transformers measures the
                   max_position_embeddings                                    growth from it
    yarn           factor, original_max_position_embeddings                   × factor
    llama3         factor, original_max_position_embeddings, low / high       × factor
                   frequency factors 1 and 4 (Llama 3.1's)

The factor is rope_factor, else cutoff_len / max_position_embeddings rounded up (LlamaFactory's rule), resolved once
by tunelab/preflight.py (`resolve_rope_scaling`), so tunelab_config.yaml records the factor the run used. A folder
whose config already has these rope_parameters (a full / freeze run's output, an export) loads as it is. A LoRA
adapter's base has not: its run record carries rope_scaling and rope_factor, which eval, export and chat of the
adapter apply to the base (`recorded_rope`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PretrainedConfig

from tunelab.config.args import DataArguments, ModelArguments
from tunelab.errors import ConfigError
from tunelab.model import gguf
from tunelab.model.text_config import text_config
from tunelab.run_folder import read_run_record

logger = logging.getLogger(__name__)

# transformers' names of the configuration values a model keeps from the config it is built with; from_pretrained
# hands its other keyword arguments to the model's constructor once it is given a config.
CONFIG_VALUES = ("num_labels", "pad_token_id")


@dataclass(frozen=True)
class RopeScaling:
    kind: str  # linear | dynamic | yarn | llama3
    factor: float


def _rope_parameters(config: PretrainedConfig) -> dict[str, Any] | None:
    """The text config's rope_parameters; None for a model without rotary embeddings (GPT-2's learned positions,
    BLOOM's ALiBi...)."""
    return getattr(text_config(config), "rope_parameters", None) or None


def _scaled(rope: dict[str, Any], scaling: RopeScaling) -> bool:
    return rope.get("rope_type") == scaling.kind and rope.get("factor") == scaling.factor


def check_rope_scaling(config: PretrainedConfig, kind: str, factor: float | None, cutoff_len: int, where: str) -> float:
    """The factor rope_scaling `kind` scales the model of `config` by: rope_factor, else cutoff_len over its
    max_position_embeddings rounded up. One-line ConfigErrors for a model without RoPE, one whose RoPE differs per
    layer type or is scaled another way already, and a cutoff_len that needs no scaling."""
    rope = _rope_parameters(config)
    if rope is None:
        raise ConfigError(f"rope_scaling: {where} ({config.model_type}) has no rotary position embeddings (RoPE) to "
                          "scale: remove rope_scaling", key="rope_scaling")
    nested = [name for name, value in rope.items() if isinstance(value, dict)]
    if nested:
        raise ConfigError(f"rope_scaling: {where} sets its RoPE per layer type ({', '.join(nested)}); edit "
                          "rope_parameters in its config.json instead of rope_scaling", key="rope_scaling")
    existing = rope.get("rope_type", "default")
    if existing == kind and factor in (None, rope.get("factor")):
        return float(rope["factor"])  # scaled this way already: a folder a run with rope_scaling saved
    if existing != "default":
        raise ConfigError(f"rope_scaling: {where} scales its RoPE already ({existing}, factor {rope.get('factor')}); "
                          "remove rope_scaling, or edit rope_parameters in its config.json", key="rope_scaling")
    if factor is not None:
        return factor
    positions = getattr(text_config(config), "max_position_embeddings", None)
    if not positions:
        raise ConfigError(f"rope_scaling: {where} states no max_position_embeddings to derive the factor from: set "
                          "rope_factor", key="rope_factor")
    factor = float(math.ceil(cutoff_len / positions))
    if factor <= 1:
        raise ConfigError(f"rope_scaling: cutoff_len {cutoff_len} fits in the {positions} positions {where} was "
                          "trained on (max_position_embeddings), so the factor would be 1: raise cutoff_len, set "
                          "rope_factor > 1, or remove rope_scaling", key="rope_scaling")
    return factor


def recorded_rope(folder: str | Path | None) -> RopeScaling | None:
    """The rope_scaling and rope_factor a tunelab run recorded in folder/tunelab_config.yaml, or None."""
    record = read_run_record(Path(folder)) if folder else None
    kind, factor = (record or {}).get("rope_scaling"), (record or {}).get("rope_factor")
    return RopeScaling(kind, float(factor)) if isinstance(kind, str) and isinstance(factor, (int, float)) else None


def resolve_rope_scaling(model: ModelArguments, data: DataArguments) -> ModelArguments:
    """Preflight: rope_scaling checked against the model and cutoff_len; the model options with its factor resolved
    into rope_factor (so the run records it). Without rope_scaling, an adapter trained with one brings it (its
    tunelab_config.yaml)."""
    recorded = recorded_rope(model.adapter_name_or_path)
    if model.rope_scaling is None and recorded is not None:
        model = dataclasses.replace(model, rope_scaling=recorded.kind, rope_factor=recorded.factor)
        logger.info("rope_scaling: %s, factor %g (what the adapter %s trained with)", recorded.kind, recorded.factor,
                    model.adapter_name_or_path)
    if model.rope_scaling is None:
        return model
    base = gguf.load_config(model.model_name_or_path, trust_remote_code=model.trust_remote_code)
    where = f"model_name_or_path {model.model_name_or_path}"
    factor = check_rope_scaling(base, model.rope_scaling, model.rope_factor, data.cutoff_len, where)
    model = dataclasses.replace(model, rope_factor=factor)
    if recorded is not None and (recorded.kind, recorded.factor) != (model.rope_scaling, model.rope_factor):
        logger.warning("rope_scaling: %s, factor %g differs from what the adapter %s trained with (%s, factor %g)",
                       model.rope_scaling, model.rope_factor, model.adapter_name_or_path, recorded.kind,
                       recorded.factor)
    return model


def rope_parameters(rope: dict[str, Any], scaling: RopeScaling, positions: int) -> tuple[dict[str, Any], int]:
    """(rope_parameters, max_position_embeddings) of a model whose RoPE `rope` is scaled as `scaling` says."""
    kept = {name: rope[name] for name in ("rope_theta", "partial_rotary_factor") if name in rope}
    scaled: dict[str, Any] = {**kept, "rope_type": scaling.kind, "factor": scaling.factor}
    if scaling.kind in ("yarn", "llama3"):
        scaled["original_max_position_embeddings"] = positions
    if scaling.kind == "llama3":
        scaled.update(low_freq_factor=1.0, high_freq_factor=4.0)
    return scaled, positions if scaling.kind == "dynamic" else int(positions * scaling.factor)


def scaled_config(path: str, scaling: RopeScaling | None, trust_remote_code: bool) -> PretrainedConfig | None:
    """The config of the model at `path` with its RoPE scaled as `scaling` says (logged); None without scaling or
    when the folder's config is scaled so already."""
    if scaling is None:
        return None
    config = gguf.load_config(path, trust_remote_code=trust_remote_code)
    text, rope = text_config(config), _rope_parameters(config)
    if rope is None or _scaled(rope, scaling):
        return None
    positions = text.max_position_embeddings
    text.rope_parameters, text.max_position_embeddings = rope_parameters(rope, scaling, positions)
    logger.info("rope_scaling: %s, factor %g: max_position_embeddings %d → %d (rope_parameters %s)", scaling.kind,
                scaling.factor, positions, text.max_position_embeddings, text.rope_parameters)
    return config


def with_rope_scaling(path: str, scaling: RopeScaling | None, trust_remote_code: bool, kwargs: dict) -> dict:
    """from_pretrained's keyword arguments for the model at `path` with its RoPE scaled: `kwargs` with the scaled
    config, the config values among them set on it (from_pretrained hands the others to the model's constructor
    once it is given a config); `kwargs` as they are when there is nothing to scale."""
    config = scaled_config(path, scaling, trust_remote_code)
    if config is None:
        return kwargs
    for name in CONFIG_VALUES:
        if name in kwargs:
            setattr(config, name, kwargs[name])
    return {**{k: v for k, v in kwargs.items() if k not in CONFIG_VALUES}, "config": config}


def of(model_args: ModelArguments) -> RopeScaling | None:
    """The RoPE scaling of ModelArguments whose factor tunelab/preflight.py resolved, or None."""
    if model_args.rope_scaling is None:
        return None
    if model_args.rope_factor is None:
        raise ConfigError(f"rope_scaling: {model_args.rope_scaling} without a resolved rope_factor (tunelab/preflight.py "
                          "derives it from cutoff_len): set rope_factor", key="rope_factor")
    return RopeScaling(model_args.rope_scaling, float(model_args.rope_factor))
