"""bitsandbytes quantization: the BitsAndBytesConfig for `quantization_bit`, and keeping 4-bit weights trainable on CPU.

The CPU trap this module owns (read in bitsandbytes 0.50.2, `bnb.nn.Linear4bit.forward`): on a CPU with AVX512-BF16,
the first forward in eval mode with an input that needs no grad (every Trainer evaluation: `model.eval()` +
`torch.no_grad()`) repacks the 4-bit weight in place into an inference-only layout
(`quant_state.packing_format_for_cpu`). From then on `bnb.matmul_4bit` sends that layer to the fused
`gemv_4bit` kernel, which has no autograd formula: backward only warns ("an autograd kernel was not registered
... silently incorrect behavior") and drops the gradient through the frozen weight, so every LoRA gradient
below the last quantized layer is wrong for the rest of training. The layer decides this from its own
instance attribute `support_avx512bf16_for_cpu` (set once in `__init__` from the hardware probe), so for a
model that trains we set that attribute to False: the repack never happens and eval uses the same
dequantize-then-matmul path as training. No bitsandbytes code is replaced; reverting the layout after eval
instead would be lossy (the repack rounds the scales to bf16 and re-quantizes them on the way back).
Inference-only models (`is_trainable=False`) keep the fast packed path.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn
from transformers import BitsAndBytesConfig

from tunelab.config.args import ModelArguments
from tunelab.errors import ModelError

# The Linear4bit attribute bitsandbytes reads to decide whether eval forwards may repack weights for CPU inference.
CPU_PACKING_SWITCH = "support_avx512bf16_for_cpu"


def require_bitsandbytes(bits: int) -> None:
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ModelError(
            f"quantization_bit: {bits} needs bitsandbytes: pip install 'tunelab[qlora]' or remove quantization_bit"
        )


def build_quantization_config(model_args: ModelArguments, compute_dtype: torch.dtype) -> BitsAndBytesConfig | None:
    """The BitsAndBytesConfig for `quantization_bit`, or None when the model loads unquantized."""
    bits = model_args.quantization_bit
    if bits is None:
        return None
    require_bitsandbytes(bits)
    if bits == 8:
        # 8-bit CPU training works in bitsandbytes >= 0.45 (dequantize + matmul); no 4-bit options apply.
        return BitsAndBytesConfig(load_in_8bit=True)
    if bits == 4:
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=model_args.quantization_type,
            bnb_4bit_use_double_quant=model_args.double_quantization,
            bnb_4bit_compute_dtype=compute_dtype,
            bnb_4bit_quant_storage=torch.uint8,
        )
    raise ModelError(f"quantization_bit: must be 4 or 8, got {bits}")


def keep_4bit_trainable_on_cpu(model: nn.Module) -> int:
    """Stop eval forwards from repacking 4-bit weights into the CPU inference layout (see module docstring).

    Returns how many layers were switched; a no-op without bitsandbytes or 4-bit layers.
    """
    if importlib.util.find_spec("bitsandbytes") is None:
        return 0
    import bitsandbytes as bnb  # lazy: the qlora extra, which may be missing

    switched = 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit) and getattr(module, CPU_PACKING_SWITCH, False):
            setattr(module, CPU_PACKING_SWITCH, False)
            switched += 1
    return switched


def is_cpu_packed(model: nn.Module) -> bool:
    """True when some 4-bit weight of `model` sits in bitsandbytes' CPU inference layout (training on it is wrong)."""
    return any(
        getattr(getattr(p, "quant_state", None), "packing_format_for_cpu", False) for p in model.parameters()
    )


def real_numel(param: torch.Tensor) -> int:
    """Element count of the weight a parameter stands for: 4-bit parameters store two values per byte."""
    quant_state = getattr(param, "quant_state", None)
    if quant_state is not None and getattr(quant_state, "shape", None) is not None:
        return int(torch.Size(quant_state.shape).numel())
    return param.numel()
