"""Out of memory while training: the allocator's traceback → one line saying what to lower, with the estimate's figure.

A CUDA out-of-memory is torch.OutOfMemoryError; on CPU the allocator raises a RuntimeError ("DefaultCPUAllocator:
not enough memory: you tried to allocate N bytes", or "can't allocate memory") and Python a MemoryError. The CLI
catches them around the run (cli.py) and, once the failed step's tensors are released, asks train/estimate.py
for the memory of a micro-batch of per_device_train_batch_size rows of cutoff_len tokens (the widest the data
allows; nothing is read or loaded: the model is counted on the meta device), then names the three settings that
lower it most.
"""

from __future__ import annotations

import re

import torch

from tunelab.config.args import RunConfig
from tunelab.train.estimate import estimate, format_size

_CPU_ALLOCATOR = ("DefaultCPUAllocator", "can't allocate memory", "not enough memory")


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in _CPU_ALLOCATOR)


def _asked(error: str) -> str:
    """What the failed allocation asked for, from the allocator's message ("" when it does not say)."""

    match = re.search(r"allocate (\d+) bytes", error)  # CPU: "you tried to allocate 100663296 bytes"
    if match:
        return f" (an allocation of {format_size(int(match.group(1)))} failed)"
    match = re.search(r"Tried to allocate ([\d.]+ [KMGT]iB)", error)  # CUDA
    return f" (an allocation of {match.group(1)} failed)" if match else ""


def out_of_memory_message(config: RunConfig, error: str) -> str:
    """One line: where it ran out, the estimate for this config, and what to lower."""

    args, data = config.training, config.data
    device = "GPU" if args.device.type == "cuda" else "CPU"
    try:
        figures = estimate(config, probe_steps=0, read_data=False)
    except Exception:  # noqa: BLE001 - the advice stands without the figure
        figures = None
    if figures is not None:
        memory = figures.memory
        figure = (
            f"`tunelab estimate` puts a step of {args.per_device_train_batch_size} x {data.cutoff_len} tokens at "
            f"{format_size(memory.total)} of tensors (activations {format_size(memory.activations)}, loss workspace "
            f"{format_size(memory.loss_workspace)}, weights + gradients + optimizer "
            f"{format_size(memory.weights + memory.gradients + memory.optimizer_states)}); "
        )
    else:
        figure = ""
    checkpointing = "" if args.gradient_checkpointing else ", set gradient_checkpointing: true"
    return (
        f"out of {device} memory while training{_asked(error)}: {figure}lower per_device_train_batch_size (now "
        f"{args.per_device_train_batch_size}; raise gradient_accumulation_steps to keep the batch) or cutoff_len (now "
        f"{data.cutoff_len}){checkpointing}"
    )
