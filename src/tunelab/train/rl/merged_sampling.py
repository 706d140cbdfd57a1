"""Rollouts sampled from the LoRA policy with its update merged into a copy of each adapted weight.

Unmerged, every adapted linear layer costs the frozen base matmul plus the adapter's two low-rank matmuls, a scale
and an add, at every decoding step of every token: on a GPU those are kernel launches a one-token step waits on,
on a CPU small matmuls with their own overhead. For the length of one rollout each adapted layer's base weight is
replaced by W + ΔW (ΔW = peft's `get_delta_weight`, summed in float32 and rounded once to W's dtype, as a merged
export is) and its adapter is switched off; afterwards the original weight tensors go back, untouched. peft's
merge_adapter / unmerge_adapter would add ΔW to W in place and subtract it again, which in a bf16 base rounds the
frozen weights at every rollout, so they drift.

The cost is one more copy of the adapted weights while sampling. It applies to plain LoRA on nn.Linear layers — no
DoRA, no LoRA bias, no quantized base, no weight tied to another module — where each process holds whole weights
(one process, DDP); FSDP and DeepSpeed hold shards. Otherwise the rollout samples through the adapter, as it trains,
and the run says why (`plan`).
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter

import torch
from peft.tuners.lora import LoraLayer
from peft.tuners.lora.layer import Linear as LoraLinear

logger = logging.getLogger(__name__)

SHARDED = ("FSDP", "DEEPSPEED", "MEGATRON_LM")  # accelerate's DistributedType names whose processes hold shards


def mergeable_layers(model) -> tuple[list[LoraLinear], str]:
    """The model's LoRA layers when every one can be merged into a copy, else ([], why not)."""
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    if not layers:
        return [], "the policy has no LoRA layers"
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    for layer in layers:
        if type(layer) is not LoraLinear or type(layer.get_base_layer()) is not torch.nn.Linear:
            return [], f"{type(layer.get_base_layer()).__name__} layers (a quantized or non-linear base) are adapted"
        if layer.merged or layer.disable_adapters:
            return [], "an adapter is already merged or disabled"
        active = [name for name in layer.active_adapters if name in layer.lora_A]
        if any(layer.use_dora.get(name) or layer.lora_bias.get(name) for name in active):
            return [], "DoRA or a LoRA bias is not a plain low-rank update"
        if uses[id(layer.get_base_layer().weight)] > 1:
            return [], "an adapted weight is tied to another module"
    return layers, ""


def plan(model, distributed_type, enabled: bool) -> tuple[bool, str]:
    """(merge?, the log line that says what rollouts sample from and why); distributed_type: accelerate's."""
    if not enabled:
        return False, "rollouts sample through the LoRA adapter (rollout_merge_adapter: false)"
    layers, why_not = mergeable_layers(model)
    if not layers:
        return False, f"rollouts sample through the LoRA adapter: {why_not}"
    kind = getattr(distributed_type, "value", distributed_type)
    if kind in SHARDED:
        return False, f"rollouts sample through the LoRA adapter: {kind} shards the weights"
    extra = sum(layer.get_base_layer().weight.numel() for layer in layers)
    return True, (f"rollouts sample from merged LoRA weights: {len(layers)} layers, a copy of {extra:,} weights "
                  "while sampling (rollout_merge_adapter: false samples through the adapter)")


@contextlib.contextmanager
def merged_lora(model):
    """Inside: every LoRA layer of `model` computes with W + ΔW and its adapter off; after: as before, W untouched.
    Call only where `plan` said to merge."""
    layers, why_not = mergeable_layers(model)
    if not layers:
        raise RuntimeError(f"merged_lora: {why_not}")
    swapped = []
    try:
        with torch.no_grad():
            for layer in layers:
                base = layer.get_base_layer()
                original = base.weight
                merged = original.to(torch.float32, copy=True)
                for name in layer.active_adapters:
                    if name in layer.lora_A:
                        merged += layer.get_delta_weight(name).float()
                base.weight = torch.nn.Parameter(merged.to(original.dtype), requires_grad=False)
                swapped.append((layer, base, original))
                layer.enable_adapters(False)
        yield model
    finally:
        for layer, base, original in swapped:
            base.weight = original
            layer.enable_adapters(True)


def sampling_plan(policy, accelerator, finetuning) -> bool:
    """Whether rollouts sample from merged LoRA weights (plan), said once in the log for LoRA (`finetuning`: the
    run's FinetuningArguments)."""
    if finetuning.finetuning_type != "lora":
        return False
    merge, line = plan(policy, accelerator.distributed_type, finetuning.rollout_merge_adapter)
    logger.info(line)
    return merge


def sampling_weights(policy, merge: bool):
    """The context a rollout samples in: the merged LoRA weights, or the policy as it trains."""
    return merged_lora(policy) if merge else contextlib.nullcontext(policy)
