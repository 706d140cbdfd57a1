"""Which parameters train: full, freeze (the last or first N decoder layers), or a peft adapter: LoRA / QLoRA, OFT,
VeRA.

LoRA's starts (init_lora_weights, docs/training.md#lora-initialisations): default and gaussian begin with B = 0, the
base model itself. pissa and olora move the principal part of each targeted weight into B·A and leave the base
holding the rest; loftq (on a 4-bit base) starts B·A at the low-rank part of the quantization error. Such an adapter
is only right on the base it trained with, so the final save (`save_as_change_from_start`, called by
train/outputs.py) writes it as its change from the start, B·A - B0·A0 = [B | -B0]·[A ; A0]: a plain LoRA of rank
2r on the original base, which every loader (tunelab chat / eval / export, peft, vLLM) applies as trained. peft's
`save_pretrained(path_initial_model_for_weight_conversion=...)` does the arithmetic; the start is kept in memory
from the moment the adapter is made (re-made identically on resume: same seed, same decomposition).

Also the one config check that needs the loaded model: `lora_target` / `additional_target` / freeze names must
match modules of that model.

Precision: under mixed precision (bf16 / fp16 flags) trainable half-precision parameters are upcast to float32
master weights (autocast runs the matmuls in half precision, the optimizer updates float32 weights), whatever the
method: AdamW on bf16 weights drops updates below bf16's resolution (docs/training.md#mixed-precision has the
measurement). `pure_bf16: true` keeps bf16 trainable weights instead (less memory); float16 weights are always
upcast, since torch's GradScaler cannot unscale them. LoRA adapters are float32 in any case (peft's default).
Quantized bases go through `peft.prepare_model_for_kbit_training`, which upcasts every non-quantized weight to
float32.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch
from peft import (
    LoraConfig,
    OFTConfig,
    PeftConfig,
    PeftModel,
    TaskType,
    VeraConfig,
    get_peft_model,
    get_peft_model_state_dict,
    prepare_model_for_kbit_training,
    replace_lora_weights_loftq,
)
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.pytorch_utils import Conv1D

from tunelab.config.args import (
    ADAPTER_TYPES,
    NONZERO_LORA_INITS,
    FinetuningArguments,
    ModelArguments,
)
from tunelab.config.training_args import TrainingArguments
from tunelab.errors import ConfigError, ModelError, first_line
from tunelab.model import skeleton, vision
from tunelab.model.text_config import text_config

# Layer types LoRA targets (bitsandbytes' Linear4bit / Linear8bitLt subclass nn.Linear; GPT-2 style models use Conv1D).
LORA_LAYER_TYPES = (nn.Linear, Conv1D)
HALF_DTYPES = (torch.float16, torch.bfloat16)
ADAPTER_KINDS = ADAPTER_TYPES.values  # the finetuning_type values that train a peft adapter
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft's file name
# The PeftModel attribute holding the adapter's starting weights when they are not zero (module docstring).
START_ATTRIBUTE = "tunelab_adapter_start"

logger = logging.getLogger(__name__)


def setup_finetuning(
    model: nn.Module,
    finetuning_args: FinetuningArguments,
    training_args: TrainingArguments,
    adapter_name_or_path: str | None = None,
    new_token_ids: list[int] | None = None,
    model_path: str | None = None,
) -> nn.Module:
    """Mark the parameters that train; returns the model to train (a PeftModel for LoRA, OFT, VeRA).

    ``new_token_ids``: rows of tokens added to the tokenizer (add_special_tokens); they must train whatever the
    method: full trains them anyway, LoRA as peft trainable tokens, freeze by training the embedding layers.
    ``model_path``: the model folder, whose safetensors files LoftQ reads the unquantized weights from.
    """
    kind = finetuning_args.finetuning_type
    if adapter_name_or_path and kind not in ADAPTER_KINDS:
        raise ConfigError(
            f"adapter_name_or_path: continuing training of an adapter needs finetuning_type: "
            f"{' / '.join(ADAPTER_KINDS)} (the adapter's), got '{kind}'"
        )
    # No enable_input_require_grads here: transformers' activation_checkpointing_enable (called by Trainer) and
    # peft already make the embeddings' output require grad, which frozen-embedding checkpointing needs.
    parts = vision.vision_parts(model)
    vision.check_options(finetuning_args, parts is not None)
    frozen = vision.frozen_parts(finetuning_args) if parts is not None else set()
    if kind == "full":
        model.requires_grad_(True)
        if parts is not None:
            vision.apply_freeze(model, parts, frozen)
        _upcast_for_mixed_precision(model, finetuning_args, training_args)
        return model
    if kind == "freeze":
        trainable = set(freeze_trainable_parameters(model, finetuning_args))
        if is_reward_model(model):  # the new reward head always trains
            trainable |= {name for name, _ in model.named_parameters() if name.startswith(("score.", "classifier."))}
        if new_token_ids:
            embeddings = {id(p) for layer in _embedding_layers(model).values() for p in layer.parameters()}
            trainable |= {name for name, p in model.named_parameters() if id(p) in embeddings}
        if parts is not None:  # an unfrozen tower / projector trains whole beside the chosen decoder layers
            trainable |= {name for name, _ in model.named_parameters()
                          if parts.part_of(name) in {"tower", "projector"} - frozen}
        for name, param in model.named_parameters():
            param.requires_grad_(name in trainable)
    elif kind in ADAPTER_KINDS:
        model = _setup_lora(model, finetuning_args, training_args, adapter_name_or_path, new_token_ids, model_path)
    else:
        raise ConfigError(f"finetuning_type: '{kind}' is not one of {', '.join(ADAPTER_KINDS)}, freeze, full")
    _upcast_for_mixed_precision(model, finetuning_args, training_args)
    return model


def _upcast_for_mixed_precision(model: nn.Module, finetuning_args: FinetuningArguments, training_args) -> None:
    """float32 master copies of the trainable half-precision weights (module docstring); pure_bf16 keeps bf16 ones."""
    if training_args.fp16:
        _upcast_trainable(model)
    elif training_args.bf16:
        _upcast_trainable(model, only=torch.float16 if finetuning_args.pure_bf16 else None)


def is_reward_model(model: nn.Module) -> bool:
    """A sequence-classification model (stage rm's reward model: backbone + scalar head)."""
    return type(model).__name__.endswith("ForSequenceClassification")


def is_quantized(model: nn.Module) -> bool:
    return bool(getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False))


# ---- freeze -------------------------------------------------------------------------------------------------


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The decoder layer stack: the first ModuleList holding config.num_hidden_layers modules."""
    config = text_config(model.config)
    count = getattr(config, "num_hidden_layers", None)
    parts = vision.vision_parts(model)
    for name, module in model.named_modules():
        if parts is not None and parts.part_of(name) != "language":
            continue  # a vision tower's layer stack is not the decoder's
        if isinstance(module, nn.ModuleList) and len(module) == count:
            return name, module
    raise ModelError(
        f"finetuning_type: freeze cannot find the decoder layers of {type(model).__name__} "
        f"(no ModuleList of num_hidden_layers={count} modules); use finetuning_type: lora or full"
    )


def freeze_trainable_parameters(model: nn.Module, finetuning_args: FinetuningArguments) -> list[str]:
    """Names of the parameters a freeze run trains, in model order; ConfigError for names that match nothing."""
    layers_name, layers = decoder_layers(model)
    n = finetuning_args.freeze_trainable_layers
    if n == 0 or abs(n) > len(layers):
        raise ConfigError(
            f"freeze_trainable_layers: {n} does not fit the {len(layers)} decoder layers of {type(model).__name__}; "
            f"use 1..{len(layers)} (last N) or -1..-{len(layers)} (first N)"
        )
    chosen = range(len(layers) - n, len(layers)) if n > 0 else range(-n)
    prefixes = tuple(f"{layers_name}.{i}." for i in chosen)
    names = [name for name, _ in model.named_parameters()]
    in_layers = [name for name in names if name.startswith(prefixes)]

    modules = finetuning_args.freeze_trainable_modules
    if "all" in modules:
        trainable = set(in_layers)
    else:
        trainable = set()
        for module in modules:
            hits = {name for name in in_layers if _names_module(name, module)}
            if not hits:
                first = prefixes[0]
                inside = _segment_names(p.removeprefix(first) for p in in_layers if p.startswith(first))
                raise ConfigError(
                    f"freeze_trainable_modules: '{module}' matches nothing in the decoder layers of "
                    f"{type(model).__name__}; names there: {', '.join(inside)}"
                )
            trainable |= hits
    for module in finetuning_args.freeze_extra_modules or []:
        hits = {name for name in names if _names_module(name, module)}
        if not hits:
            outside = _segment_names(n for n in names if not n.startswith(f"{layers_name}."))
            raise ConfigError(
                f"freeze_extra_modules: '{module}' matches no module of {type(model).__name__}; "
                f"modules outside the decoder layers: {', '.join(outside)}"
            )
        trainable |= hits
    return [name for name in names if name in trainable]


def _names_module(path: str, name: str) -> bool:
    """True when dotted `name` ('mlp', 'q_proj', 'self_attn.q_proj') is a run of whole segments of `path`."""
    return f".{name}." in f".{path}."


def _ends_with_module(module_name: str, name: str) -> bool:
    """peft's target rule: the module's dotted name is `name` or ends with '.' + `name`."""
    return module_name == name or module_name.endswith(f".{name}")


def _segment_names(param_names: Iterable[str]) -> list[str]:
    """Module segment names of parameter paths, first appearance first, without indices and 'model'."""
    seen: dict[str, None] = {}
    for param_name in param_names:
        for segment in param_name.split(".")[:-1]:
            if not segment.isdigit() and segment != "model":
                seen.setdefault(segment)
    return list(seen)


# ---- LoRA ---------------------------------------------------------------------------------------------------


# lora_target words that name a group of layers whatever a family calls them: the linear layers inside modules
# whose name contains one of these (self_attn, attention, attn / mlp, feed_forward, ffn).
LORA_TARGET_GROUPS = {"attention": ("attn", "attention"), "mlp": ("mlp", "feed_forward", "ffn")}


def lora_target_modules(
    model: nn.Module, lora_target: list[str], frozen_parts: tuple[vision.VisionParts, set[str]] | None = None,
    key: str = "lora_target",
) -> list[str]:
    """peft target_modules for `lora_target`: 'all' = every linear layer's name but the output head's
    (a reward model's `score` head trains in full instead, see build_lora_config); 'attention' / 'mlp' = the
    linear layers of the attention / MLP blocks of this model's family (Llama: q_proj, k_proj, v_proj, o_proj /
    gate_proj, up_proj, down_proj; GPT-2: attn.c_attn, attn.c_proj / mlp.c_fc, mlp.c_proj), beside layer names.
    Each word's expansion is logged; `key` is the option named in messages (oft_target, vera_target alike)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if is_reward_model(model):
        head = getattr(model, "score", None) or getattr(model, "classifier", None)
    linears = [(name, module) for name, module in model.named_modules() if isinstance(module, LORA_LAYER_TYPES)]
    if frozen_parts is not None:  # a vision-language model: only the parts that train are candidates
        parts, frozen = frozen_parts
        linears = [(name, module) for name, module in linears if parts.part_of(name) not in frozen]
    family = type(model).__name__
    if "all" in lora_target:
        if len(lora_target) > 1:
            raise ConfigError(f"{key}: 'all' cannot be combined with other names, got {','.join(lora_target)}")
        names = sorted({name.rsplit(".", 1)[-1] for name, module in linears if module is not head})
        logger.info("%s: all → %s (%s, every linear layer but the output head)", key, ", ".join(names), family)
        return names
    targets: list[str] = []
    for target in lora_target:
        if any(_ends_with_module(name, target) for name, _ in linears):
            targets.append(target)
        elif target in LORA_TARGET_GROUPS:
            expansion = _group_layers([name for name, module in linears if module is not head], LORA_TARGET_GROUPS[target])
            if not expansion:
                raise ConfigError(
                    f"{key}: '{target}' finds no linear layer inside a module named like "
                    f"{' / '.join(LORA_TARGET_GROUPS[target])} in {family}; name the layers instead: "
                    f"{', '.join(dict.fromkeys(name.rsplit('.', 1)[-1] for name, _ in linears))}"
                )
            logger.info("%s: %s → %s (%s)", key, target, ", ".join(expansion), family)
            targets.extend(expansion)
        else:
            available = list(dict.fromkeys(name.rsplit(".", 1)[-1] for name, _ in linears))
            raise ConfigError(
                f"{key}: '{target}' matches no module of {family}; modules: {', '.join(available)}; "
                f"groups: all, {', '.join(LORA_TARGET_GROUPS)}"
            )
    return list(dict.fromkeys(targets))


def _group_layers(linear_names: list[str], keywords: tuple[str, ...]) -> list[str]:
    """Names (peft suffixes) of the linear layers under a module whose name contains a keyword. A layer name that
    also occurs outside the group (GPT-2's c_proj in attn and mlp) is qualified by its parent (attn.c_proj)."""
    def in_group(name: str) -> bool:
        return any(word in segment.lower() for segment in name.split(".")[:-1] for word in keywords)

    inside = [name for name in linear_names if in_group(name)]
    outside_leaves = {name.rsplit(".", 1)[-1] for name in linear_names if not in_group(name)}
    out: dict[str, None] = {}
    for name in inside:
        parts = name.split(".")
        out.setdefault(parts[-1] if parts[-1] not in outside_leaves else ".".join(parts[-2:]))
    return list(out)


def build_lora_config(model: nn.Module, finetuning_args: FinetuningArguments) -> LoraConfig:
    ft = finetuning_args
    init = ft.lora_init()
    # peft's LoftQ sets B·A to the quantization error without the LoRA scale: it needs alpha = r (checks.py).
    default_alpha = ft.lora_rank if init == "loftq" else 2 * ft.lora_rank
    return LoraConfig(
        r=ft.lora_rank,
        lora_alpha=ft.lora_alpha if ft.lora_alpha is not None else default_alpha,
        lora_dropout=ft.lora_dropout,
        use_dora=ft.use_dora,
        use_rslora=ft.use_rslora,
        init_lora_weights=peft_lora_init(ft),
        **_adapter_placement(model, ft, ft.lora_target, "lora_target"),
    )


def build_adapter_config(model: nn.Module, finetuning_args: FinetuningArguments) -> PeftConfig:
    """The peft config of the run's finetuning_type: lora, oft or vera."""
    ft = finetuning_args
    if ft.finetuning_type == "oft":
        placement = _adapter_placement(model, ft, ft.oft_target, "oft_target")
        return OFTConfig(r=ft.oft_rank, oft_block_size=ft.oft_block_size, module_dropout=ft.module_dropout, **placement)
    if ft.finetuning_type == "vera":
        placement = _adapter_placement(model, ft, ft.vera_target, "vera_target")
        if placement.pop("exclude_modules"):
            raise ConfigError("finetuning_type: vera cannot keep out of a vision-language model's frozen vision parts "
                              "(peft's VeRA has no exclude_modules): use finetuning_type: lora or oft")
        return VeraConfig(r=ft.vera_rank, **placement)
    return build_lora_config(model, ft)


def peft_lora_init(finetuning_args: FinetuningArguments) -> bool | str:
    """peft's init_lora_weights. loftq starts as the default here: its matrices are set on the quantized model."""
    ft = finetuning_args
    init = ft.lora_init()
    if init == "pissa":  # LlamaFactory's pissa_iter: -1 is the full SVD, N the fast SVD with N iterations
        return "pissa" if ft.pissa_iter == -1 else f"pissa_niter_{ft.pissa_iter}"
    return True if init in ("default", "loftq") else init


def _adapter_placement(model: nn.Module, finetuning_args: FinetuningArguments, target: list[str], key: str) -> dict:
    """Where an adapter goes, whatever its kind: target_modules, exclude_modules, modules_to_save, task_type."""
    ft = finetuning_args
    module_names = [name for name, _ in model.named_modules() if name]
    for extra in ft.additional_target or []:
        if not any(_ends_with_module(name, extra) for name in module_names):
            tops = _segment_names(name for name, _ in model.named_parameters())
            raise ConfigError(
                f"additional_target: '{extra}' matches no module of {type(model).__name__}; modules: {', '.join(tops)}"
            )
    # A vision-language model: the adapter stays out of the frozen parts (the vision tower by default).
    parts = vision.vision_parts(model)
    frozen = (parts, vision.frozen_parts(ft)) if parts is not None else None
    exclude = vision.lora_excluded_modules(model, *frozen) if frozen is not None else None
    # SEQ_CLS: peft trains and saves the reward head (`score`) in full with the adapter (modules_to_save).
    return {
        "exclude_modules": exclude or None,
        "task_type": TaskType.SEQ_CLS if is_reward_model(model) else TaskType.CAUSAL_LM,
        "target_modules": lora_target_modules(model, target, frozen, key),
        "modules_to_save": ft.additional_target,
    }


def _setup_lora(
    model: nn.Module,
    finetuning_args: FinetuningArguments,
    training_args: TrainingArguments,
    adapter_name_or_path: str | None,
    new_token_ids: list[int] | None = None,
    model_path: str | None = None,
) -> nn.Module:
    """The peft adapter of finetuning_type lora, oft or vera on `model` (new, or continued from a saved one)."""
    ft = finetuning_args
    init = ft.lora_init() if ft.finetuning_type == "lora" else "default"
    if init == "loftq":
        _check_loftq_device()
    # Build (and so check) the config before prepare_model_for_kbit_training spends time upcasting weights.
    config = build_adapter_config(model, ft)
    if new_token_ids:  # the added tokens' rows train as peft trainable tokens, saved with the adapter (LoRA only)
        config.trainable_token_indices = {name: list(new_token_ids) for name in _embedding_layers(model)}
    if is_quantized(model):
        checkpointing, checkpoint_kwargs = checkpointing_settings(training_args)
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=checkpointing, gradient_checkpointing_kwargs=checkpoint_kwargs
        )
    if adapter_name_or_path:
        # Continue training an existing adapter: its own adapter_config.json decides kind, rank and targets.
        _check_continued_adapter(adapter_name_or_path, ft, init)
        return load_adapter(model, adapter_name_or_path, is_trainable=True)
    model = get_peft_model(model, config)
    if init == "loftq":
        # peft's one-pass LoftQ on the bitsandbytes base: B·A = the rank-r SVD of W - Q(W), W read from the files.
        replace_lora_weights_loftq(model, model_path=model_path)
        logger.info("init_lora_weights: loftq: LoRA starts as the rank-%d part of the 4-bit quantization error",
                    ft.lora_rank)
    if init in NONZERO_LORA_INITS and not (init == "pissa" and not ft.pissa_convert):
        record_start(model)
    return model


def _check_loftq_device() -> None:
    """peft computes LoftQ on a CUDA (or XPU) device only (peft/utils/loftq_utils.py picks the device by name)."""
    xpu = getattr(torch, "xpu", None)
    if not (torch.cuda.is_available() or (xpu is not None and xpu.is_available())):
        raise ConfigError("init_lora_weights: loftq: peft computes LoftQ on a CUDA (or XPU) GPU and this machine has "
                          "none; remove init_lora_weights (QLoRA starting from zero) or train on a GPU",
                          key="init_lora_weights")


def _check_continued_adapter(path: str, finetuning_args: FinetuningArguments, init: str) -> None:
    """A continued adapter keeps its own kind and start: the configured ones must not say otherwise."""
    ft = finetuning_args
    if init != "default":
        key = "pissa_init" if ft.pissa_init else "init_lora_weights"
        raise ConfigError(f"{key}: adapter_name_or_path continues an adapter that has already started; remove {key}",
                          key=key)
    kind = str(_adapter_config(path).get("peft_type", "")).lower()
    if kind and kind != ft.finetuning_type:
        raise ConfigError(f"adapter_name_or_path: {path} holds a {kind} adapter, but finetuning_type is "
                          f"{ft.finetuning_type}: set finetuning_type: {kind}", key="finetuning_type")


def record_start(model: PeftModel) -> None:
    """Keep the adapter's starting weights (CPU copies, the adapter's size) for `save_as_change_from_start`."""
    start = {name: tensor.detach().to("cpu", copy=True) for name, tensor in get_peft_model_state_dict(model).items()}
    setattr(model, START_ATTRIBUTE, start)


def save_as_change_from_start(model: nn.Module, out: str | Path) -> bool:
    """Rewrite the adapter saved in `out` as its change from its recorded start: a plain LoRA of the original base
    (rank 2r, init_lora_weights true). False, touching nothing, when the adapter started at zero.

    peft's conversion writes the LoRA matrices only: the modules trained in full (additional_target, a reward head)
    and trainable tokens are put back with their trained values, which do not depend on the base."""
    start = getattr(model, START_ATTRIBUTE, None)
    if start is None:
        return False
    trained = get_peft_model_state_dict(model)
    with tempfile.TemporaryDirectory() as scratch:
        initial = Path(scratch) / "start"  # peft loads it as an adapter named after the folder, then deletes it
        initial.mkdir()
        save_file(start, initial / ADAPTER_WEIGHTS)
        model.save_pretrained(str(out), path_initial_model_for_weight_conversion=str(initial))
    weights = Path(out) / ADAPTER_WEIGHTS
    converted = load_file(weights)
    kept = {name: tensor.contiguous() for name, tensor in trained.items() if name not in converted}
    if kept:
        save_file(converted | kept, weights, metadata={"format": "pt"})
    logger.info("adapter saved as a plain LoRA of the original base (its change from the start, rank %d)",
                2 * model.peft_config["default"].r)
    return True


def _embedding_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The input embedding and output layers by their module's own name (embed_tokens, lm_head)."""
    layers = [model.get_input_embeddings(), model.get_output_embeddings()]
    return {name.rsplit(".", 1)[-1]: module for name, module in model.named_modules() if any(module is l for l in layers)}


def load_adapter(model: nn.Module, path: str, is_trainable: bool) -> PeftModel:
    _grow_for_trainable_tokens(model, path)
    try:
        return PeftModel.from_pretrained(model, path, is_trainable=is_trainable)
    except Exception as exc:  # noqa: BLE001  (missing or corrupt adapter files, targets absent from the model)
        raise ModelError(f"adapter_name_or_path: cannot load {path}: {first_line(exc)}") from exc


def _adapter_config(path: str) -> dict:
    """The adapter folder's adapter_config.json; {} when unreadable (PeftModel.from_pretrained reports that)."""
    try:
        return json.loads((Path(path) / "adapter_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _grow_for_trainable_tokens(model: nn.Module, path: str) -> None:
    """An adapter trained with added tokens (add_special_tokens) holds their rows: the base must have them."""
    indices = _adapter_config(path).get("trainable_token_indices") or []
    ids = [i for value in (indices.values() if isinstance(indices, dict) else [indices]) for i in value]
    rows = model.get_input_embeddings().weight.shape[0]
    if ids and max(ids) >= rows:
        model.resize_token_embeddings(max(ids) + 1, mean_resizing=False)  # the adapter overwrites these rows


def checkpointing_settings(training_args: TrainingArguments) -> tuple[bool, dict]:
    """(on, checkpoint kwargs); transformers 5.x renamed gradient_checkpointing* to activation_checkpointing*."""
    if hasattr(training_args, "activation_checkpointing"):
        on, kwargs = training_args.activation_checkpointing, training_args.activation_checkpointing_kwargs
    else:
        on, kwargs = training_args.gradient_checkpointing, training_args.gradient_checkpointing_kwargs
    # Trainer pops these two layer-selection keys before torch sees the rest; do the same.
    kwargs = {k: v for k, v in (kwargs or {}).items() if k not in ("every_n_layers", "offload")}
    return bool(on), kwargs


def _upcast_trainable(model: nn.Module, only: torch.dtype | None = None) -> None:
    for param in model.parameters():
        if param.requires_grad and param.dtype in HALF_DTYPES and (only is None or param.dtype == only):
            param.data = param.data.to(torch.float32)


def trained_skeleton(model: ModelArguments, finetuning: FinetuningArguments,
                     training: TrainingArguments) -> torch.nn.Module:
    """model/skeleton.py's skeleton set up as training sets it up (adapters, upcasts): what trains and in which
    dtype. An existing adapter's own rank decides in training; the skeleton uses the configured LoRA options, started
    as the default (a decomposition needs real weights; the shapes are the same)."""
    started = dataclasses.replace(finetuning, init_lora_weights="default", pissa_init=False)
    meta = skeleton.skeleton(model, finetuning, training)
    return setup_finetuning(meta, started, training, adapter_name_or_path=None)
