"""A GGUF file's tensors dequantized one at a time into the state dict of a dense model (model/gguf.py loads it).

transformers' GGUF path for most architectures (its "legacy" loader) parses the whole file with gguf-py's GGUFReader,
which turns every vocabulary entry into objects, then dequantizes each tensor to a float32 numpy array, copies it
into torch, casts it, and keeps all of them until the model takes them. On Qwen2.5-Coder-0.5B (Q4_K_M) that peaked
at 2.5x the bf16 weights (bench/gguf_load_rss.py). Here:

    for each tensor of the header's table (model/gguf.py read_header: names, shapes, offsets; no vocabulary objects)
      read its bytes with a plain read            no memory map: mapped file pages would stay resident until the end
      dequantize (gguf-py `dequantize`)           a vocabulary-sized matrix in chunks of rows, straight into a tensor
                                                  of the final dtype: its whole float32 form never exists
      rename and reorder                          transformers' tensor processor for the architecture and its
                                                  GGUF -> model name map, as its own loader does
      keep it in the final dtype                  from_pretrained assigns such tensors without copying them

so the peak is the weights plus one tensor's (or chunk's) float32 intermediates. Architectures transformers reads
through its own converter pipeline (GGUF_ARCHS: lfm2, qwen3.5) do not come here.
"""

from __future__ import annotations

from math import prod
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from torch import nn

# Values per dequantized chunk of a large matrix: 16 MB as float32 (gguf-py's intermediates are a few times that).
CHUNK_VALUES = 1 << 22


def dense_state_dict(path: str | Path, tensors: tuple, data_start: int, architecture: str, skeleton: nn.Module,
                     dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """{model parameter name: tensor in `dtype`} for every tensor of the file the model has (module docstring).
    `tensors`: the header's TensorEntry table; `skeleton`: the model built on the meta device, for its names."""
    # lazy: the gguf extra, which may be missing; GGUF files only
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map,
    )

    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=skeleton.config.to_dict())
    names = get_gguf_hf_weights_map(skeleton, processor)
    assembled: dict[str, Any] = {"tensors": {}}  # what a processor builds itself from several tensors (MoE experts)
    state_dict: dict[str, torch.Tensor] = {}
    with open(path, "rb") as handle:
        for entry in tensors:
            qtype = GGMLQuantizationType(entry.ggml_type)
            block_values, block_bytes = GGML_QUANT_SIZES[qtype]
            columns = entry.shape[-1]
            row_bytes = columns // block_values * block_bytes
            rows = prod(entry.shape[:-1])

            def rows_of(first: int, count: int, entry=entry, row_bytes=row_bytes, qtype=qtype) -> np.ndarray:
                raw = _read(handle, data_start + entry.offset + first * row_bytes, count * row_bytes)
                return dequantize(raw.reshape(count, row_bytes), qtype)

            chunk_rows = max(1, CHUNK_VALUES // columns)
            if len(entry.shape) == 2 and rows > chunk_rows and _passes_through(processor, names, entry.name,
                                                                                rows_of(0, 1)):
                tensor = torch.empty(entry.shape, dtype=dtype)
                for first in range(0, rows, chunk_rows):
                    count = min(chunk_rows, rows - first)
                    tensor[first:first + count] = torch.from_numpy(rows_of(first, count))
                name = entry.name
            else:
                result = processor.process(weights=rows_of(0, rows).reshape(entry.shape), name=entry.name,
                                           tensor_key_mapping=names, parsed_parameters=assembled)
                name, tensor = result.name, torch.from_numpy(np.ascontiguousarray(result.weights)).to(dtype)
            if name in names:
                state_dict[names[name]] = tensor
    for name, tensor in assembled["tensors"].items():
        state_dict[name] = tensor.to(dtype)
    return state_dict


def _read(handle: BinaryIO, offset: int, size: int) -> np.ndarray:
    handle.seek(offset)
    data = np.fromfile(handle, dtype=np.uint8, count=size)
    if data.size != size:
        raise ValueError(f"the file ends inside a tensor (at byte {offset + data.size}, {size} bytes wanted)")
    return data


def _passes_through(processor: Any, names: dict[str, str], name: str, sample: np.ndarray) -> bool:
    """Whether the architecture's processor leaves this tensor as it is (name and values): only then may it be
    dequantized in chunks of rows. Asked with its first row, into a throwaway dict."""
    try:
        result = processor.process(weights=sample, name=name, tensor_key_mapping=names,
                                   parsed_parameters={"tensors": {}})
    except Exception:  # noqa: BLE001 - a processor that reshapes by heads cannot take one row: not a pass-through
        return False
    return result.name == name and result.weights is sample
