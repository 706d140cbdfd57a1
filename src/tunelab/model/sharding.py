"""FSDP on CPU: the model is fully sharded while it loads (transformers' `DistributedConfig(fsdp_size=...)`,
PyTorch's FSDP2 `fully_shard` over gloo), and the Trainer trains it as it is.

accelerate 1.15 turns `fsdp` on only for GPU-like devices (AcceleratorState keeps DistributedType.MULTI_CPU, and
its prepare_model wraps the model in DDP), so on CPU the `fsdp` option alone would train plain DDP. transformers
5.24 has its own FSDP2 route instead: a model loaded with `distributed_config` is sharded layer by layer as it
loads (each rank keeps its half of every weight as a DTensor), and the Trainer, seeing
`model.is_distributed_loading_by_transformers`, neither wraps it in DDP nor shards it again; parameters added after
the sharding (LoRA adapters) stay replicated, are broadcast from rank 0 and have their gradients averaged.

The same `fsdp: full_shard` option (TrainingArguments' name) selects it, so a GPU config runs unchanged on CPU.
What this route cannot do on CPU is refused at config time (config/checks.py): checkpoints with the optimizer
(transformers 5.24 refuses them for a model sharded at load time: `save_only_model: true` or `save_strategy: no`),
other sharding strategies and offloading. The final save gathers the shards into one plain model.safetensors.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file
from transformers.distributed import DistributedConfig

from tunelab.config.stages import names_where, stage_row
from tunelab.errors import ConfigError

if TYPE_CHECKING:  # annotations only: the config checks call check_cpu_fsdp without importing peft
    from tunelab.config.training_args import TrainingArguments

logger = logging.getLogger(__name__)


def shards_at_load(args: TrainingArguments) -> bool:
    """FSDP asked for on CPU: the model is sharded by transformers while it loads, not by accelerate."""
    return bool(args.fsdp) and bool(args.use_cpu)


# fsdp_config entries the load-time sharding honours on CPU, with the values it honours (None: any value).
# transformers fills min_num_params and the xla switches itself; every layer is its own FSDP unit (the model's
# fsdp plan), which is what transformer_layer_cls_to_wrap asks for on GPUs.
CPU_FSDP_CONFIG = {
    "version": {2, "2"}, "reshard_after_forward": {True, "true"}, "state_dict_type": {"FULL_STATE_DICT"},
    "transformer_layer_cls_to_wrap": None, "min_num_params": {0}, "xla": {False}, "xla_fsdp_v2": {False},
    "xla_fsdp_grad_ckpt": {False},
}


# The stages whose Trainer runs a model sharded at load, the table's cpu_fsdp (verified: sft, tests/train/test_fsdp.py;
# pt trains with the same Trainer). The preference stages hold a second, unsharded reference model, and grpo / ppo
# run their own loop on accelerate, which would wrap the sharded model in DDP.
CPU_FSDP_STAGES = names_where(lambda row: row.cpu_fsdp)


def check_cpu_fsdp(args: TrainingArguments, processes: int, stage: str) -> None:
    """What FSDP on CPU cannot do, as one line; `processes` is the run's process count (nproc_per_node × nnodes)."""

    if not stage_row(stage).cpu_fsdp:
        raise ConfigError(
            f"fsdp on CPU runs stages {' and '.join(CPU_FSDP_STAGES)} only; stage {stage} with fsdp needs GPUs "
            "(accelerate's FSDP), or drop fsdp (nproc_per_node alone trains data-parallel on CPU)"
        )

    for key, value in (args.fsdp_config or {}).items():
        allowed = CPU_FSDP_CONFIG.get(key, set())
        if allowed is not None and value not in allowed:
            what = "offloading" if "offload" in key else f"fsdp_config.{key}: {value!r}"
            raise ConfigError(
                f"fsdp on CPU: {what} needs GPUs (accelerate's FSDP); on CPU tunelab shards every layer with FSDP2 "
                "full_shard (fsdp: true or full_shard, reshard_after_forward: true, state_dict_type: FULL_STATE_DICT)"
            )
    if processes < 2:
        raise ConfigError("fsdp: one process has nothing to shard with; set nproc_per_node: 2 or more")
    if args.save_strategy != "no" and not args.save_only_model:
        # transformers 5.24's Trainer refuses it for a model sharded at load time (no optimizer checkpointing).
        raise ConfigError(
            "fsdp on CPU cannot checkpoint the optimizer of its sharded model: set save_only_model: true "
            "(checkpoints hold the gathered model; resume them with resume_weights_only: true) or save_strategy: no; "
            "sharded optimizer checkpoints need GPUs (accelerate's FSDP)"
        )


def world_size() -> int:
    """The processes of the run as its workers see them (torchrun's WORLD_SIZE); 1 outside a launcher."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def load_kwargs(args: TrainingArguments) -> dict:
    """from_pretrained's extra arguments: the load-time sharding over every process of the run, or nothing."""
    if not shards_at_load(args) or world_size() < 2:
        return {}

    return {"distributed_config": DistributedConfig(fsdp_size=world_size())}


def load_gathered_weights(model: torch.nn.Module, checkpoint: str | Path) -> bool:
    """Put a checkpoint's gathered model.safetensors into a model sharded at load, each rank taking its shards
    (torch.distributed.checkpoint's set_model_state_dict with a full state dict). False, touching nothing, for a
    model that is not sharded or a checkpoint without model.safetensors (a LoRA run's adapter loads as usual)."""
    weights = Path(checkpoint) / "model.safetensors"
    if not getattr(model, "is_distributed_loading_by_transformers", False) or not weights.is_file():
        return False
    # lazy: torch.distributed.checkpoint (1.1 s); preflight imports this module for `tunelab data`
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
    )

    set_model_state_dict(model, load_file(weights), options=StateDictOptions(full_state_dict=True, strict=True))
    logger.info("fsdp: resumed the sharded model from %s", weights)
    return True
