"""The optimizer of a run, built in one place for every stage: TunelabTrainer.create_optimizer (pt, sft, rm, dpo,
kto) and the RL loop (grpo, ppo) both call `build_optimizer`.

Without an optimizer option the Trainer keeps transformers' own (`optim` and its kwargs, biases and norms without
weight decay); `default_optimizer` is the same for the RL loop. The options (config/args.py, LlamaFactory's names;
checked in config/checks.py) choose one of:

    use_galore         GaLore (galore-torch): the targeted matrices' gradients projected to galore_rank
    use_apollo         APOLLO (apollo-torch): AdamW states in a rank-apollo_rank projection, scaling the raw gradient
    use_badam          BAdam (badam): one decoder layer trains at a time, switched every badam_switch_interval steps
    use_adam_mini      Adam-mini (adam-mini): one second moment per head / neuron / block
    use_muon           torch.optim.Muon on the 2-D hidden weights, AdamW on the rest
    loraplus_lr_ratio  LoRA+ (peft): lora_B at learning_rate x ratio

Every one of them checkpoints and resumes exactly (tests/train/test_optimizers.py); the layer-wise variants of
GaLore and APOLLO, which step inside the backward pass, are refused where that cannot hold (config/checks.py).
"""

from __future__ import annotations

import importlib.util
import logging
import warnings

import torch
import transformers
from torch import nn
from transformers.trainer_pt_utils import LayerWiseDummyOptimizer, get_parameter_names

from tunelab.config.args import FinetuningArguments
from tunelab.config.checks import chosen_optimizers
from tunelab.errors import ConfigError
from tunelab.model.text_config import text_config

logger = logging.getLogger(__name__)

# The names transformers.Trainer keeps out of weight decay (Trainer.get_decay_parameter_names).
NO_DECAY_PATTERNS = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]
# Modules that map hidden states to outputs: Muon leaves them, like the embeddings, to AdamW.
HEAD_NAMES = ("lm_head", "score", "classifier", "value_head")
# The package each option needs: (module, pip extra).
PACKAGES = {"use_galore": ("galore_torch", "galore"), "use_apollo": ("apollo_torch", "apollo"),
            "use_badam": ("badam", "badam"), "use_adam_mini": ("adam_mini", "adam-mini")}


def check_optimizer_package(finetuning: FinetuningArguments) -> None:
    """The package the chosen optimizer comes from is installed (tunelab/preflight.py asks before any weights load)."""
    for key in chosen_optimizers(finetuning)[:1]:
        module, extra = PACKAGES.get(key, (None, None))
        if module is not None and importlib.util.find_spec(module) is None:
            raise ConfigError(f"{key} needs the {module} package: pip install 'tunelab[{extra}]'", key=key)


def build_optimizer(model: nn.Module, args, finetuning: FinetuningArguments | None) -> torch.optim.Optimizer | None:
    """The optimizer the run's options ask for, or None when they ask for none (the Trainer then builds
    transformers' own; the RL loop calls default_optimizer)."""
    chosen = chosen_optimizers(finetuning) if finetuning is not None else []
    if not chosen:
        return None
    key = chosen[0]
    check_optimizer_package(finetuning)
    builder = {"use_galore": _galore, "use_apollo": _apollo, "use_badam": _badam, "use_adam_mini": _adam_mini,
               "use_muon": _muon, "loraplus_lr_ratio": _loraplus}[key]
    optimizer = builder(model, args, finetuning)
    logger.info("optimizer: %s.%s (%s)", type(optimizer).__module__, type(optimizer).__name__, key)
    return optimizer


def default_optimizer(model: nn.Module, args) -> torch.optim.Optimizer:
    """What transformers.Trainer builds: `optim` and its kwargs, no decay on biases and norms."""
    optimizer_cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args, model)
    return optimizer_cls(decay_groups(model, args.weight_decay), **kwargs)


def decay_groups(model: nn.Module, weight_decay: float, leave_out: set[int] = frozenset()) -> list[dict]:
    """The trainable parameters (but those whose id is in `leave_out`) as transformers groups them: with
    `weight_decay`, and biases and norms without; empty groups dropped."""
    decay = set(get_parameter_names(model, [nn.LayerNorm], NO_DECAY_PATTERNS))
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) not in leave_out]
    groups = [
        {"params": [p for n, p in trainable if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in trainable if n not in decay], "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


# ---- GaLore and APOLLO: low-rank projections of the targeted matrices -------------------------------------------


def projected_weights(model: nn.Module, targets: list[str], key: str) -> dict[str, nn.Parameter]:
    """The trainable weights of the linear layers `targets` names ('all': every one but the output head's), by name.
    A target matches a module whose dotted name holds it as whole segments (q_proj, mlp, self_attn.o_proj)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linears = {name: module for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and module.weight.requires_grad and module is not head
               and name.rsplit(".", 1)[-1] not in HEAD_NAMES}
    if targets == ["all"]:
        chosen = linears
    else:
        chosen = {name: m for name, m in linears.items() if any(f".{t}." in f".{name}." for t in targets)}
        missing = [t for t in targets if not any(f".{t}." in f".{name}." for name in linears)]
        if missing:
            names = ", ".join(dict.fromkeys(name.rsplit(".", 1)[-1] for name in linears))
            raise ConfigError(f"{key}: '{missing[0]}' matches no trainable linear layer of {type(model).__name__}; "
                              f"layers: {names}", key=key)
    return {f"{name}.weight": module.weight for name, module in chosen.items()}


def _low_rank_groups(model, args, targets: list[str], key: str, projection: dict) -> list[dict]:
    """transformers' decay groups for the other parameters, and one group of the projected matrices (with weight
    decay, as LlamaFactory) carrying the projection's options."""
    projected = projected_weights(model, targets, key)
    rest = decay_groups(model, args.weight_decay, leave_out={id(p) for p in projected.values()})
    return [*rest, {"params": list(projected.values()), "weight_decay": args.weight_decay, **projection}]


def _low_rank_optimizer(model, args, optimizer_cls, kwargs: dict, groups: list[dict], layerwise: bool):
    """One optimizer over the groups, or with `layerwise` one per parameter stepped by a hook as soon as its
    gradient is complete (transformers' LayerWiseDummyOptimizer: get_scheduler then schedules each)."""
    if not layerwise:
        return optimizer_cls(groups, **kwargs)
    if args.world_size > 1:
        raise ConfigError("layer-wise GaLore / APOLLO steps each weight during backward, before DDP averages its "
                          "gradient: train on one process or remove galore_layerwise / apollo_layerwise")
    logger.warning("layer-wise optimizer steps happen during backward: max_grad_norm does not clip them and "
                   "grad_norm logs 0")
    per_parameter = {p: optimizer_cls([{**group, "params": [p]}], **kwargs) for group in groups for p in group["params"]}

    def step(parameter: torch.Tensor) -> None:
        if parameter.grad is not None:
            per_parameter[parameter].step()
            per_parameter[parameter].zero_grad()

    for parameter in per_parameter:
        parameter.register_post_accumulate_grad_hook(step)
    return LayerWiseDummyOptimizer(optimizer_dict=per_parameter, lr=args.learning_rate)


def _allow_in_checkpoints(*classes: type) -> None:
    """The projectors are objects inside the optimizer state; the Trainer reads optimizer.pt with
    torch.load(weights_only=True), which unpickles only allowlisted classes."""
    torch.serialization.add_safe_globals(list(classes))


def _base_kwargs(args) -> dict:
    """transformers' kwargs for `optim` (lr, betas, eps; bitsandbytes' optim_bits), less torch's `fused`, which the
    projecting optimizers do not take."""
    _, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args)
    kwargs.pop("fused", None)
    return kwargs


def _galore(model, args, ft: FinetuningArguments):
    # lazy: the galore extra, which may be missing
    from galore_torch import GaLoreAdafactor, GaLoreAdamW, GaLoreAdamW8bit
    from galore_torch.galore_projector import GaLoreProjector

    _allow_in_checkpoints(GaLoreProjector)
    optim = str(getattr(args.optim, "value", args.optim))
    optimizer_cls = GaLoreAdafactor if optim == "adafactor" else GaLoreAdamW8bit if "8bit" in optim else GaLoreAdamW
    kwargs = _base_kwargs(args)
    if optimizer_cls is GaLoreAdamW:
        kwargs["no_deprecation_warning"] = True
    projection = {"rank": ft.galore_rank, "update_proj_gap": ft.galore_update_interval, "scale": ft.galore_scale,
                  "proj_type": ft.galore_proj_type}
    groups = _low_rank_groups(model, args, ft.galore_target, "galore_target", projection)
    return _low_rank_optimizer(model, args, optimizer_cls, kwargs, groups, ft.galore_layerwise)


def _apollo(model, args, ft: FinetuningArguments):
    # lazy: the apollo extra, which may be missing
    from apollo_torch import APOLLOAdamW
    from apollo_torch.random_projector import GradientProjector
    from apollo_torch.svd_projector import GaLoreProjector

    _allow_in_checkpoints(GradientProjector, GaLoreProjector)
    projection = {"rank": ft.apollo_rank, "proj": ft.apollo_proj, "proj_type": ft.apollo_proj_type,
                  "update_proj_gap": ft.apollo_update_interval, "scale": ft.apollo_scale,
                  "scale_type": ft.apollo_scale_type}
    kwargs = {**_base_kwargs(args), "scale_front": ft.apollo_scale_front}
    groups = _low_rank_groups(model, args, ft.apollo_target, "apollo_target", projection)
    return _low_rank_optimizer(model, args, APOLLOAdamW, kwargs, groups, ft.apollo_layerwise)


# ---- BAdam: block coordinate descent over the decoder layers ----------------------------------------------------


def _badam(model, args, ft: FinetuningArguments):
    from badam import BlockOptimizer  # lazy: the badam extra, which may be missing

    class ResumableBlockOptimizer(BlockOptimizer):
        """badam's BlockOptimizer, whose checkpoint also holds which block trains, the step count and the learning
        rate the scheduler set: its own state_dict is the base optimizer's alone, so a resume would restart at the
        first block, at the first step's learning rate."""

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            del self.state_dict  # the instance attribute BlockOptimizer sets hides the method below

        def switch_trainable_params(self, verbose=None) -> None:
            self.active_block = self.current_block_idx  # the switch advances current_block_idx to the next one
            super().switch_trainable_params(verbose=0)  # (its own verbosity prints every switch)
            logger.info("use_badam: step %d, block %d of %d trains (%s)", self.global_step, self.active_block,
                        self.block_num, ", ".join(self.active_param_prefixs))

        def state_dict(self):
            return {"base": self.base_optimizer.state_dict(), "global_step": self.global_step,
                    "active_block": self.active_block, "next_block": self.current_block_idx,
                    "block_order": list(getattr(self, "block_order", [])),
                    "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]}

        def load_state_dict(self, state_dict) -> None:
            # Activate the saved block again (fresh float32 copies of its weights, which the checkpoint loaded);
            # the switch then advances to the saved next block: for random order it pops the saved one back.
            self.global_step = state_dict["global_step"]
            for group, saved in zip(self.param_groups, state_dict["param_groups"]):
                group.update(saved)
            self.current_block_idx = state_dict["active_block"]
            if self.switch_mode == "random":
                self.block_order = [*state_dict["block_order"], state_dict["next_block"]]
            self.switch_trainable_params()
            self.base_optimizer.load_state_dict(state_dict["base"])

    if ft.badam_start_block is not None:
        # BAdam's own blocks (one per decoder layer), counted before it would fail on a missing one
        count = len(BlockOptimizer.infer_param_groups(None, [n for n, _ in model.named_parameters()], False, False))
        if ft.badam_start_block >= count:
            raise ConfigError(f"badam_start_block: {ft.badam_start_block} is past the {count} decoder layers of "
                              f"{type(model).__name__}; use 0..{count - 1}", key="badam_start_block")
    base = default_optimizer(model, args)
    if any(p.dtype == torch.float32 for p in model.parameters()):
        logger.info("use_badam: the weights are float32, so BAdam's float32 copy of the training block doubles that "
                    "block's memory (pure_bf16: true keeps bf16 weights)")
    with warnings.catch_warnings():  # badam says the same, naming every parameter
        warnings.filterwarnings("ignore", message="BAdam expect", category=UserWarning)
        return ResumableBlockOptimizer(
            base_optimizer=base, named_parameters_list=list(model.named_parameters()),
            switch_block_every=ft.badam_switch_interval, start_block=ft.badam_start_block,
            switch_mode=ft.badam_switch_mode, verbose=0,
        )


# ---- Adam-mini, Muon, LoRA+ ---------------------------------------------------------------------------------------


def _text_config(model: nn.Module):
    """The language model's config (inside a PEFT or value-head wrapper, or a vision-language model)."""
    return text_config(next(m.config for m in model.modules() if hasattr(m, "config")))


def _adam_mini(model, args, ft: FinetuningArguments):
    from adam_mini import Adam_mini  # lazy: the adam-mini extra, which may be missing

    config = _text_config(model)
    # Adam-mini groups its blocks by parameter name (q_proj / k_proj per head, embeddings per token, ...) and
    # leaves norms and biases out of weight decay itself.
    return Adam_mini(
        named_parameters=model.named_parameters(), lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon, weight_decay=args.weight_decay, dim=config.hidden_size,
        n_heads=config.num_attention_heads, n_kv_heads=getattr(config, "num_key_value_heads", None), verbose=False,
    )


def muon_weights(model: nn.Module) -> list[nn.Parameter]:
    """The 2-D hidden weights Muon orthogonalises: trainable matrices that are neither an embedding nor a head
    (output embeddings, a reward or value head), as Moonlight and LlamaFactory split them."""
    left_out = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    left_out |= {id(p) for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in HEAD_NAMES
                 for p in m.parameters()}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        left_out.add(id(head.weight))
    return [p for p in model.parameters() if p.requires_grad and p.ndim == 2 and id(p) not in left_out]


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on the hidden matrices and AdamW on every other parameter, stepped, scheduled and checkpointed as one
    optimizer: its param_groups are the two optimizers' own group dicts, so the scheduler's learning rate reaches
    both; its state_dict holds both."""

    def __init__(self, muon: torch.optim.Muon, adamw: torch.optim.AdamW):
        self.muon, self.adamw = muon, adamw
        super().__init__([p for g in (*muon.param_groups, *adamw.param_groups) for p in g["params"]], {})
        self._link_groups()

    def _link_groups(self) -> None:
        self.param_groups = [*self.muon.param_groups, *self.adamw.param_groups]

    @property
    def state(self) -> dict:
        return {**self.muon.state, **self.adamw.state}

    @state.setter
    def state(self, value) -> None:
        if value:  # Optimizer.__init__ assigns an empty state; the real one lives in the two optimizers
            raise AttributeError("MuonWithAdamW's state is its two optimizers' state")

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.muon.step(closure)
        self.adamw.step()
        return loss

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])
        self._link_groups()  # load_state_dict replaces the group dicts


def _muon(model, args, ft: FinetuningArguments):
    hidden = muon_weights(model)
    if not hidden:
        raise ConfigError(f"use_muon: {type(model).__name__} has no trainable 2-D hidden weight for Muon; remove "
                          "use_muon", key="use_muon")
    # match_rms_adamw scales each matrix's update to AdamW's typical size, so one learning_rate serves both.
    muon = torch.optim.Muon(hidden, lr=args.learning_rate, weight_decay=args.weight_decay,
                            adjust_lr_fn="match_rms_adamw")
    rest = decay_groups(model, args.weight_decay, leave_out={id(p) for p in hidden})
    adamw = torch.optim.AdamW(rest or [{"params": []}], lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                              eps=args.adam_epsilon)
    logger.info("use_muon: Muon on %d hidden matrices, AdamW on %d other parameters", len(hidden),
                sum(len(g["params"]) for g in rest))
    return MuonWithAdamW(muon, adamw)


def _loraplus(model, args, ft: FinetuningArguments):
    # lazy: peft (7.8 s): preflight imports this module for `tunelab data`
    from peft.optimizers import create_loraplus_optimizer

    optimizer_cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args, model)
    kwargs.pop("lr")
    return create_loraplus_optimizer(
        model, optimizer_cls, lr=args.learning_rate, loraplus_lr_ratio=ft.loraplus_lr_ratio,
        loraplus_lr_embedding=ft.loraplus_lr_embedding, loraplus_weight_decay=args.weight_decay, **kwargs,
    )
