"""Quantization-aware training (QAT) and quantized export, built on torchao.

One scheme name stands for one torchao post-training quantization (PTQ) config, used twice:

    training (qat: <scheme>)          every quantized layer becomes torchao's FakeQuantizedLinear: the forward
                                      rounds its weights (and, for int8-int4, its input activations) to the
                                      scheme's grid and back, the backward passes gradients straight through,
                                      the weights themselves stay in full precision and are saved as usual
    export (export_quantization: ...)  transformers' TorchAoConfig with the same PTQ config quantizes the merged
                                      full-precision weights; the folder loads with plain from_pretrained

    scheme       torchao PTQ config                                         activations           weights
    int8-int4    Int8DynamicActivationIntxWeightConfig(int4, PerGroup(g))  int8 per token, asym  int4 per group, sym
    int4-weight  IntxWeightOnlyConfig(int4, PerGroup(g))                   full precision        int4 per group, sym
    int8-weight  IntxWeightOnlyConfig(int8, PerGroup(g))                   full precision        int8 per group, sym

Prepare and convert cover the same layers: every nn.Linear but the output head (its weight is usually the tied
input embedding, which stays in full precision too); `quantized_layers` decides, and export passes the rest to
TorchAoConfig as modules_to_not_convert. The three configs store weights as torchao's IntxUnpackedToInt8Tensor
(one int8 per value, int4 values included, plus one scale per group): it runs on CPU and is what torchao's
safetensors support round-trips in transformers 5. With LoRA the fake quantizers sit in the base layers, under
the adapters (as torchtune's QAT + LoRA does): the base path sees quantized inputs and weights, the low-rank
path full-precision ones.

This module does not own bitsandbytes (quantization.py) nor the export folder (export/merge.py); the scheme names
are option values (config/qat_schemes.py).
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, TorchAoConfig

from tunelab.config.args import ExportArguments, FinetuningArguments, ModelArguments
from tunelab.config.qat_schemes import DEFAULT_GROUP_SIZE, SCHEMES, check_scheme
from tunelab.errors import ConfigError
from tunelab.model import gguf
from tunelab.model.folder import is_sequence_classification
from tunelab.run_folder import read_run_record

logger = logging.getLogger(__name__)


def require_torchao(key: str) -> None:
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(f"{key} needs torchao: pip install 'tunelab[qat]'")


def ptq_config(scheme: str, group_size: int):
    """The torchao PTQ config (an AOBaseConfig) of `scheme`; QAT derives its fake quantizers from it."""
    from torchao.quantization import (  # lazy: the qat extra (torchao), which may be missing
        Int8DynamicActivationIntxWeightConfig,
        IntxWeightOnlyConfig,
        PerGroup,
    )

    if scheme == "int8-int4":
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(group_size))
    if scheme in ("int4-weight", "int8-weight"):
        dtype = torch.int4 if scheme == "int4-weight" else torch.int8
        return IntxWeightOnlyConfig(weight_dtype=dtype, granularity=PerGroup(group_size))
    check_scheme("qat", scheme)
    raise AssertionError(scheme)


def quantized_layers(model: nn.Module) -> dict[str, nn.Linear]:
    """The layers a scheme quantizes, by name: every nn.Linear but the output head."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {
        name: module for name, module in model.named_modules() if isinstance(module, nn.Linear) and module is not head
    }


def kept_layers(model: nn.Module) -> list[str]:
    """Names of the nn.Linear layers left in full precision (TorchAoConfig's modules_to_not_convert)."""
    quantized = quantized_layers(model)
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear) and name not in quantized]


def check_group_size(key: str, group_size: int, widths: dict[str, int]) -> None:
    """Every quantized layer's input width (name -> in_features) splits into whole groups of `group_size`."""
    if group_size < 1:
        raise ConfigError(f"{key}: the group size must be at least 1, got {group_size}")
    for name, width in widths.items():
        if width % group_size:
            divisors = [d for d in (16, 32, 64, 128, 256) if all(w % d == 0 for w in widths.values())]
            fix = f"; use one that divides every layer's input width: {', '.join(map(str, divisors))}" if divisors else ""
            raise ConfigError(
                f"{key}: {group_size} does not divide the input width {width} of layer {name}{fix}"
            )


def layer_widths(model_folder: str, trust_remote_code: bool = False) -> dict[str, int]:
    """name -> in_features of the quantized layers of the model in `model_folder`, read from config.json alone
    (the model is built on the meta device: no weights are read or allocated)."""
    config = gguf.load_config(model_folder, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return {name: layer.in_features for name, layer in quantized_layers(model).items()}


def prepare_qat(model: nn.Module, scheme: str, group_size: int, enabled: bool = True) -> int:
    """Swap every quantized layer for torchao's FakeQuantizedLinear (same weight Parameter, same state_dict
    keys); returns how many. `enabled`: fake quantisation on from the first forward (see train/callbacks.py QATStartCallback)."""
    # lazy: the qat extra (torchao), which may be missing
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    layers = quantized_layers(model)
    check_group_size("qat_group_size", group_size, {name: layer.in_features for name, layer in layers.items()})
    chosen = {id(layer) for layer in layers.values()}
    # Each new FakeQuantizedLinear initialises a weight of its own (then replaced by the layer's): keep the random
    # state as it was, so LoRA starts from the same weights as without qat (the model is still on the CPU here).
    with torch.random.fork_rng(devices=[]):
        quantize_(model, QATConfig(ptq_config(scheme, group_size), step="prepare"),
                  filter_fn=lambda module, _name: id(module) in chosen)
    set_fake_quant(model, enabled)
    logger.info("qat: %s (%s), group size %d, on %d linear layers%s", scheme, SCHEMES[scheme], group_size,
                len(layers), "" if enabled else " (switched on later)")
    return len(layers)


def fake_quantized_layers(model: nn.Module) -> list[nn.Module]:
    from torchao.quantization.qat import FakeQuantizedLinear  # lazy: the qat extra (torchao), which may be missing

    return [module for module in model.modules() if isinstance(module, FakeQuantizedLinear)]


def set_fake_quant(model: nn.Module, enabled: bool) -> None:
    """Switch the fake quantizers of every FakeQuantizedLinear on or off (off: a plain full-precision linear)."""
    # lazy: the qat extra (torchao), which may be missing
    from torchao.quantization.qat.linear import enable_linear_fake_quant

    for module in fake_quantized_layers(model):
        enable_linear_fake_quant(module, enabled)


def torchao_config(scheme: str, group_size: int, model: nn.Module):
    """transformers' TorchAoConfig quantizing exactly `quantized_layers(model)` with the scheme's PTQ config."""
    return TorchAoConfig(ptq_config(scheme, group_size), modules_to_not_convert=kept_layers(model))


def trained_scheme(folder: str | Path | None) -> tuple[str | None, int | None]:
    """(qat, qat_group_size) a tunelab run recorded in folder/tunelab_config.yaml, (None, None) otherwise."""
    options = read_run_record(folder) if folder else None
    if options is None:
        return None, None
    return options.get("qat"), options.get("qat_group_size")


def is_torchao_quantized(model_folder: str | Path) -> bool:
    """True when model_folder's config.json holds a torchao quantization_config (a quantized export)."""
    try:
        config = json.loads((Path(model_folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    quantization = config.get("quantization_config") if isinstance(config, dict) else None
    return isinstance(quantization, dict) and quantization.get("quant_method") == "torchao"


def check_quantization_sources(model: ModelArguments, finetuning: FinetuningArguments,
                               export: ExportArguments) -> None:
    """qat and export_quantization need torchao; export_quantization merges an adapter into its base first, so the
    base must be given. (The scheme names are checked with the options: config/qat_schemes.py.)"""
    for key, name in (("qat", finetuning.qat), ("export_quantization", export.export_quantization)):
        if name:
            require_torchao(key)
    folder = Path(model.model_name_or_path)
    adapter_only = not (folder / "config.json").is_file() and (folder / "adapter_config.json").is_file()
    if export.export_quantization and adapter_only:
        raise ConfigError(
            f"export_quantization: model_name_or_path {model.model_name_or_path} is a LoRA adapter without its "
            "base; set model_name_or_path to the base model and adapter_name_or_path to the adapter (they are merged, "
            "then quantized)"
        )


def check_quantized_layers(model: ModelArguments, finetuning: FinetuningArguments,
                           export: ExportArguments) -> int | None:
    """The group size fits every quantized layer (read from config.json); no QAT on already-quantized weights. Returns
    the group size the run quantizes with (qat without one: DEFAULT_GROUP_SIZE; an export without one: the one the
    model trained with), or None."""
    ft, export_scheme = finetuning, export.export_quantization
    if is_torchao_quantized(model.model_name_or_path):  # (tunelab eval / chat / api load it: not checked there)
        raise ConfigError(
            f"model_name_or_path: {model.model_name_or_path} holds torchao-quantized weights (a quantized export) "
            "that cannot train or export again; use the full-precision model it was exported from"
        )
    if not (ft.qat or export_scheme):
        return ft.qat_group_size
    if export_scheme and is_sequence_classification(model):
        raise ConfigError("export_quantization: reward models (sequence classification) export in full precision; remove it")
    group_size = ft.qat_group_size
    if group_size is None and ft.qat:
        group_size = DEFAULT_GROUP_SIZE  # the resolved config records the group size trained with
    if group_size is None:  # an export alone: the group size the model trained with
        trained, trained_group = trained_scheme(model.adapter_name_or_path or model.model_name_or_path)
        group_size = trained_group if trained and trained_group else DEFAULT_GROUP_SIZE
    check_group_size("qat_group_size", group_size, layer_widths(model.model_name_or_path, model.trust_remote_code))
    return group_size
