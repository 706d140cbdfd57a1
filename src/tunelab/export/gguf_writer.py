"""One GGUF file (llama.cpp, Ollama, LM Studio) from a loaded, merged Hugging Face causal LM.

    write_gguf(model, tokenizer, chat_template, template_vars, out_path, tensor_type="q8_0")

Owns what llama.cpp's own converter (convert_hf_to_gguf.py) decides for the families tunelab trains, written
with gguf-py's GGUFWriter: the architecture name and hyperparameter keys, llama.cpp's tensor names
(gguf.TensorNameMap), the value transforms (Llama-style q/k rows permuted for llama.cpp's interleaved rotary;
Gemma norms stored as 1 + w), which tensors stay float32 and which get `tensor_type`, the tokenizer metadata
(tokens, types, merges or scores, special ids, add_bos/add_eos, the pre-tokenizer kind) and the chat template,
with the run's template variables baked in so every runtime renders it as training did. Tool calls need no
rewrite of the template: llama.cpp gives it a call's JSON-text arguments as sent and parses them only for a
template that needs objects, the rule training renders calls by (data/formats.py template_call_turn).

It does not merge LoRA adapters (model/export.py hands it a plain model), read the file back (parity.py) or
write the Ollama Modelfile (modelfile.py). Tensors are written one at a time, so memory stays near one tensor
above the model itself; the file appears under its name only once complete.

Supported: Llama (and SmolLM, Mistral), Qwen2/2.5, Qwen3, Gemma 2, Gemma 3 (text); tensor types f32, f16, bf16,
q8_0, q5_1, q5_0, q4_1, q4_0 (gguf-py quantizes them) and the k-quant mixes q6_k, q5_k_m, q4_k_m (export/kquants.py
writes their blocks). Other k-quants and i-quants need llama.cpp's llama-quantize: write f16 and run it on the file.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from tunelab.data.templates import Template
from tunelab.errors import ExportError
from tunelab.export import kquants
from tunelab.model import gguf as model_gguf

logger = logging.getLogger(__name__)

Q = gguf.GGMLQuantizationType

# tensor_type → (the type quantizable weights get, the file type llama.cpp records). Every other ggml type needs
# llama-quantize: gguf-py can only read them.
TENSOR_TYPES: dict[str, tuple[gguf.GGMLQuantizationType, gguf.LlamaFileType]] = {
    "f32": (Q.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (Q.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (Q.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (Q.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "q5_1": (Q.Q5_1, gguf.LlamaFileType.MOSTLY_Q5_1),
    "q5_0": (Q.Q5_0, gguf.LlamaFileType.MOSTLY_Q5_0),
    "q4_1": (Q.Q4_1, gguf.LlamaFileType.MOSTLY_Q4_1),
    "q4_0": (Q.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
    # k-quants, written by export/kquants.py, mixed per tensor as llama-quantize mixes them (_tensor_qtype)
    "q6_k": (Q.Q6_K, gguf.LlamaFileType.MOSTLY_Q6_K),
    "q5_k_m": (Q.Q5_K, gguf.LlamaFileType.MOSTLY_Q5_K_M),
    "q4_k_m": (Q.Q4_K, gguf.LlamaFileType.MOSTLY_Q4_K_M),
}
# A k-quant's row must hold whole super-blocks of 256; llama-quantize's fallback for a row that does not
K_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}

@dataclass(frozen=True)
class Family:
    """How one Hugging Face model_type maps onto a llama.cpp architecture."""

    arch: gguf.MODEL_ARCH
    permute_qk: bool  # llama.cpp's LLM_ARCH_LLAMA rotates interleaved pairs; HF Llama rotates halves
    norm_shift: float  # Gemma's RMSNorm multiplies by (1 + w); llama.cpp stores 1 + w and multiplies by it


FAMILIES: dict[str, Family] = {
    "llama": Family(gguf.MODEL_ARCH.LLAMA, True, 0.0),
    "mistral": Family(gguf.MODEL_ARCH.LLAMA, True, 0.0),  # llama.cpp's converter writes Mistral as llama too
    "qwen2": Family(gguf.MODEL_ARCH.QWEN2, False, 0.0),
    "qwen3": Family(gguf.MODEL_ARCH.QWEN3, False, 0.0),
    "gemma2": Family(gguf.MODEL_ARCH.GEMMA2, False, 1.0),
    "gemma3_text": Family(gguf.MODEL_ARCH.GEMMA3, False, 1.0),
}

# The pre-tokenizer split regexes of tokenizer.json files, by the name llama.cpp gives their pre-tokenizer
# (llama-vocab.cpp quotes each as its "original regex from tokenizer.json").
_SPLIT_REGEXES: dict[str, str] = {
    "llama-bpe": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+"
    ),
    "qwen2": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+"
    ),
    "qwen35": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
    "tekken": (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
    "gpt-4o": (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
        r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
}

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


@dataclass(frozen=True)
class Provenance:
    """What a GGUF carries over from the model the run started from (source_provenance): its general.* name,
    organization and licence, and, from a GGUF source, the pre-tokenizer name llama.cpp's converter gave it."""

    name: str | None = None
    organization: str | None = None
    license: str | None = None
    pre_tokenizer: str | None = None  # tokenizer.ggml.pre of a GGUF source


def source_provenance(model_name_or_path: str | Path) -> Provenance:
    """Provenance of a base model: a GGUF file's general.name / organization / license and tokenizer.ggml.pre; a
    Hugging Face folder's licence (its README's front matter) and, for a Hub id `org/name`, its organization and
    name. Whatever is not there stays None."""
    path = Path(model_name_or_path)
    if path.suffix.lower() == ".gguf" and path.is_file():
        header = model_gguf.read_header(path)
        return Provenance(*(header.string(key) or None for key in (
            "general.name", "general.organization", "general.license", "tokenizer.ggml.pre")))
    licence = None
    readme = path / "README.md"
    if readme.is_file():  # the model card's YAML front matter: "---\nlicense: apache-2.0\n...\n---"
        lines = readme.read_text(encoding="utf-8", errors="replace").splitlines()
        if lines and lines[0].strip() == "---":
            for line in lines[1:]:
                if line.strip() == "---":
                    break
                if line.startswith("license:"):
                    licence = line.partition(":")[2].strip().strip("'\"") or None
    parts = str(model_name_or_path).split("/")
    hub_id = not path.exists() and len(parts) == 2 and all(parts)
    return Provenance(parts[1] if hub_id else path.name or None, parts[0] if hub_id else None, licence)


def write_gguf(
    model: torch.nn.Module,
    tokenizer: Any,
    chat_template: str | None,
    template_vars: Mapping[str, Any] | None,
    out_path: str | Path,
    tensor_type: str = "q8_0",
    name: str | None = None,
    source: Provenance | None = None,
) -> Path:
    """Write `model` (a merged *ForCausalLM), its fast `tokenizer` and the final chat template to `out_path`.

    `chat_template` is the Jinja source the run trained with (None: a pt model, no template); `template_vars`
    (e.g. {"enable_thinking": False}) are baked into the embedded template (embedded_chat_template), since a
    GGUF runtime renders it with its own variables. `name`: the trained run's name (general.name), with `source`
    (source_provenance) as its general.base_model.0; without a name the file is the source itself, under its
    name and organization. `source`'s licence is kept either way, and a GGUF source's pre-tokenizer name replaces
    a generic `gpt-2` (transformers rebuilds a GGUF's tokenizer without its pre-tokenizer). Returns the path.
    """
    tensor_type = tensor_type.lower()
    if tensor_type not in TENSOR_TYPES:
        raise ExportError(
            f"export_gguf_type: cannot write {tensor_type!r}; tunelab writes {', '.join(TENSOR_TYPES)} (other "
            "k-quants and i-quants need llama.cpp's llama-quantize: export f16 and run it on the file)"
        )
    config = model.config
    family = model_family(config)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    qtype, file_type = TENSOR_TYPES[tensor_type]
    n_layers = config.num_hidden_layers
    arch_name = gguf.MODEL_ARCH_NAMES[family.arch]

    plan = _tensor_plan(model, family)
    head = "output.weight" if any(item.name == "output.weight" for item in plan) else "token_embd.weight"
    types = [_tensor_qtype(item.name, item.shape, qtype, head, n_layers) for item in plan]

    partial = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(partial, arch_name)
    try:
        writer.add_type(gguf.GGUFType.MODEL)
        _write_provenance(writer, name, source or Provenance(), config)
        writer.add_file_type(file_type)
        if qtype not in (Q.F32, Q.F16, Q.BF16):
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        _write_hyperparameters(writer, config, family, n_layers)
        _write_vocabulary(writer, tokenizer, _vocab_rows(model), chat_template, template_vars,
                          (source or Provenance()).pre_tokenizer)
        for item, ttype in zip(plan, types):
            shape, dtype, nbytes = _stored_layout(item.shape, ttype)
            writer.add_tensor_info(item.name, shape, dtype, nbytes, raw_dtype=ttype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for item, ttype in zip(plan, types):  # one tensor in memory at a time
            writer.write_tensor_data(_encode(item.values(), ttype))
        writer.close()
        os.replace(partial, out)
    finally:
        writer.close()
        partial.unlink(missing_ok=True)
    counts: dict[str, int] = {}
    for ttype in types:
        counts[ttype.name] = counts.get(ttype.name, 0) + 1
    logger.info("wrote %s (%s, %s tensors: %s, %.1f MB)", out, arch_name, len(plan),
                ", ".join(f"{n} {t}" for t, n in sorted(counts.items())), out.stat().st_size / 1e6)
    return out


def rounded_as_stored(model: torch.nn.Module, tensor_type: str) -> torch.nn.Module:
    """A float32 copy of `model` whose every weight is rounded exactly as write_gguf stores it (quantized, then
    dequantized by gguf-py): what a correct reader of the file computes, up to its own arithmetic. Row permutations
    and norm offsets are left out: they move values without rounding them (quantization blocks run along rows)."""
    family = model_family(model.config)
    qtype, _ = TENSOR_TYPES[tensor_type.lower()]
    plan = _tensor_plan(model, family)
    head = "output.weight" if any(item.name == "output.weight" for item in plan) else "token_embd.weight"
    n_layers = model.config.num_hidden_layers
    rounded = torch.nn.Module.float(copy.deepcopy(model)).eval()  # Module's own: a GGUF-loaded model refuses .float()
    state = rounded.state_dict()
    with torch.no_grad():
        for item in plan:
            ttype = _tensor_qtype(item.name, item.shape, qtype, head, n_layers)
            if item.hf_name is None or ttype == Q.F32:
                continue
            values = state[item.hf_name].numpy()
            restored = gguf.quants.dequantize(_encode(values, ttype), ttype).reshape(values.shape)
            state[item.hf_name].copy_(torch.from_numpy(np.ascontiguousarray(restored, dtype=np.float32)))
    return rounded


def model_family(config: Any) -> Family:
    """The llama.cpp architecture for a Hugging Face config; ExportError naming the supported ones otherwise."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        hint = " (a vision-language model: export its language model)" if model_type == "gemma3" else ""
        raise ExportError(
            f"export_format gguf: cannot write model_type {model_type!r}{hint}; tunelab writes GGUF for "
            f"{', '.join(FAMILIES)}"
        )
    return FAMILIES[model_type]


def embedded_chat_template(chat_template: str | None, template_vars: Mapping[str, Any] | None) -> str | None:
    """The template a GGUF carries: the run's Jinja with its variables set at the top, so a runtime that renders
    it without them (llama.cpp, Ollama, LM Studio) renders what training rendered. A runtime's own value for such
    a variable is overridden: the model was trained with this one."""
    if chat_template is None or not template_vars:
        return chat_template
    lines = [f"{{%- set {key} = {_jinja_literal(key, value)} -%}}" for key, value in sorted(template_vars.items())]
    return "\n".join(lines) + "\n" + chat_template


def _jinja_literal(key: str, value: Any) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        raise ExportError(f"template_kwargs: {key!r} is not a template variable name")
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_jinja_literal(key, item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {_jinja_literal(key, v)}" for k, v in value.items()) + "}"
    raise ExportError(f"template_kwargs: {key}={value!r} cannot be written into the GGUF's chat template")


# ---------------------------------------------------------------------------------------------------- tensors


@dataclass
class _Planned:
    """One tensor of the file: its llama.cpp name, shape, and how to compute its float32 values when written."""

    name: str
    source: torch.Tensor | np.ndarray
    rotary_heads: int = 0  # > 0: permute rows for llama.cpp's rotary layout, in this many heads
    shift: float = 0.0
    hf_name: str | None = None  # the state-dict entry it comes from (None: computed, like rope_freqs)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.source.shape)

    def values(self) -> np.ndarray:
        if isinstance(self.source, np.ndarray):
            return self.source
        data = self.source.detach().to(device="cpu", dtype=torch.float32)
        if self.rotary_heads:
            data = _permute_rotary(data, self.rotary_heads)
        if self.shift:
            data = data + self.shift
        return data.numpy()


def _tensor_plan(model: torch.nn.Module, family: Family) -> list[_Planned]:
    """Every weight under its llama.cpp name, with the transform llama.cpp expects (nothing copied yet)."""
    config = model.config
    if hasattr(model, "peft_config"):
        raise ExportError("export_format gguf: the model still holds a LoRA adapter; merge it first (merge_and_unload)")
    name_map = gguf.get_tensor_name_map(family.arch, config.num_hidden_layers)
    allowed = set(gguf.MODEL_TENSORS[family.arch])
    arch_name = gguf.MODEL_ARCH_NAMES[family.arch]
    tied = _tied_head(model)
    plan = []
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue  # llama.cpp reads the output head from token_embd when there is no output tensor
        base, _, suffix = hf_name.rpartition(".")
        found = name_map.get_type_and_name(base)
        if found is None or found[0] not in allowed:
            raise ExportError(
                f"export_format gguf: {hf_name} has no place in llama.cpp's {arch_name} architecture; "
                "this model's layout is not one llama.cpp runs"
            )
        heads = 0
        if family.permute_qk and base.endswith("self_attn.q_proj"):
            heads = config.num_attention_heads
        elif family.permute_qk and base.endswith("self_attn.k_proj"):
            heads = config.num_key_value_heads
        shift = family.norm_shift if hf_name.endswith("norm.weight") else 0.0
        plan.append(_Planned(f"{found[1]}.{suffix}", tensor, heads, shift, hf_name))
    rope_factors = _llama3_rope_factors(config)
    if rope_factors is not None:
        plan.append(_Planned(f"{gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS]}.weight", rope_factors))
    return plan


def _tied_head(model: torch.nn.Module) -> bool:
    """Whether the output head is the embedding matrix (then only token_embd is written)."""
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None:
        return True
    same = head.weight.data_ptr() == embeddings.weight.data_ptr()
    return same or (head.weight.shape == embeddings.weight.shape and torch.equal(head.weight, embeddings.weight))


def _permute_rotary(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Reorder each head's rows from HF's rotate-half layout (rotary pairs (i, i + d/2)) to llama.cpp's interleaved
    one (pairs (2i, 2i + 1)), as llama.cpp's converter does. Weights (rows, in) and biases (rows,) alike."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, half, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _llama3_rope_factors(config: Any) -> np.ndarray | None:
    """Llama 3.1's rope scaling as llama.cpp reads it: one divisor per rotary frequency (rope_freqs.weight)."""
    rope = _rope_parameters(config)
    if str(rope.get("rope_type", "")).lower() != "llama3":
        return None
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    base = rope.get("rope_theta", 10000.0)
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context = rope.get("original_max_position_embeddings", 8192)
    factors = []
    for i in range(0, dim, 2):
        wavelength = 2 * math.pi * base ** (i / dim)
        if wavelength < old_context / high:
            factors.append(1.0)
        elif wavelength > old_context / low:
            factors.append(factor)
        else:  # between the two: a smooth blend of scaled and unscaled
            smooth = (old_context / wavelength - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def _tensor_qtype(gguf_name: str, shape: tuple[int, ...], requested: gguf.GGMLQuantizationType,
                  head: str, n_layers: int) -> gguf.GGMLQuantizationType:
    """llama.cpp's rule: 1-D tensors, norms and biases stay float32; 2-D weights get the requested type. In 4/5-bit
    files the logit head gets q8_0 (llama-quantize gives it q6_k; tunelab does so in k-quant files). q4_k_m and
    q5_k_m give attn_v and ffn_down q6_k in the layers llama-quantize's use_more_bits picks (the first and last
    eighth, every third between); a k-quant row that is not whole super-blocks of 256 falls back as llama-quantize
    does (K_FALLBACK). A row length that is not a multiple of the block size falls back to f16, as in llama.cpp's
    converter."""
    if len(shape) <= 1 or gguf_name.endswith("_norm.weight") or not gguf_name.endswith(".weight"):
        return Q.F32
    if requested in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1) and gguf_name == head:
        requested = Q.Q8_0
    if requested in K_FALLBACK:
        layer = int(gguf_name.split(".")[1]) if gguf_name.startswith("blk.") else -1
        if gguf_name == head or (gguf_name.endswith((".attn_v.weight", ".ffn_down.weight"))
                                 and _more_bits(layer, n_layers)):
            requested = Q.Q6_K
        if shape[-1] % kquants.QK_K:
            logger.info("%s: rows of %d are not whole super-blocks of %d; stored as %s, as llama-quantize does",
                        gguf_name, shape[-1], kquants.QK_K, K_FALLBACK[requested].name)
            requested = K_FALLBACK[requested]
    block, _ = gguf.GGML_QUANT_SIZES[requested]
    if shape[-1] % block:
        logger.info("%s: rows of %d are not a multiple of %s's block of %d; stored as f16",
                    gguf_name, shape[-1], requested.name, block)
        return Q.F16
    return requested


def _more_bits(layer: int, n_layers: int) -> bool:
    """llama-quantize's use_more_bits: the layers whose attn_v / ffn_down get q6_k in a q4_k_m or q5_k_m file."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def _stored_layout(shape: tuple[int, ...], ttype: gguf.GGMLQuantizationType) -> tuple[tuple[int, ...], Any, int]:
    """(shape as GGUFWriter.add_tensor_info takes it, numpy dtype, bytes) of a tensor stored as `ttype`."""
    if ttype == Q.F32:
        return shape, np.float32, 4 * math.prod(shape)
    if ttype == Q.F16:
        return shape, np.float16, 2 * math.prod(shape)
    byte_shape = gguf.quant_shape_to_byte_shape(shape, ttype)
    return byte_shape, np.uint8, math.prod(byte_shape)


def _encode(array: np.ndarray, ttype: gguf.GGMLQuantizationType) -> np.ndarray:
    if ttype == Q.F32:
        return np.ascontiguousarray(array, dtype=np.float32)
    if ttype == Q.F16:
        return np.ascontiguousarray(array, dtype=np.float16)
    if ttype in kquants.TYPES:
        return kquants.quantize(array, ttype)
    return gguf.quants.quantize(np.ascontiguousarray(array, dtype=np.float32), ttype)


# -------------------------------------------------------------------------------------------- hyperparameters


def _rope_parameters(config: Any, layer_type: str = "full_attention") -> dict[str, Any]:
    """The rope settings of full-attention layers (transformers 5 nests them per layer type for Gemma 3)."""
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if layer_type in rope and isinstance(rope[layer_type], dict):
        rope = dict(rope[layer_type])
    if "rope_theta" not in rope and getattr(config, "rope_theta", None) is not None:
        rope["rope_theta"] = config.rope_theta
    return rope


def _write_hyperparameters(writer: gguf.GGUFWriter, config: Any, family: Family, n_layers: int) -> None:
    arch = family.arch
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    _check_activation(config, arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if arch == gguf.MODEL_ARCH.LLAMA:
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(head_dim)
    _write_rope(writer, config)
    layer_types = list(getattr(config, "layer_types", None) or [])
    if arch in (gguf.MODEL_ARCH.GEMMA2, gguf.MODEL_ARCH.GEMMA3):
        _write_gemma(writer, config, arch, layer_types, head_dim)
    elif "sliding_attention" in layer_types:
        raise ExportError(
            f"export_format gguf: this {config.model_type} model uses sliding-window attention, which llama.cpp's "
            f"{gguf.MODEL_ARCH_NAMES[arch]} architecture does not run; it would answer differently past "
            f"{config.sliding_window} tokens"
        )
    elif getattr(config, "sliding_window", None) and config.sliding_window < config.max_position_embeddings:
        # llama.cpp's converter writes Mistral v0.1's 4096-token window nowhere either: the same beyond it.
        logger.warning("%s: llama.cpp ignores sliding_window=%s; prompts longer than it attend differently",
                       config.model_type, config.sliding_window)


def _check_activation(config: Any, arch: gguf.MODEL_ARCH) -> None:
    gemma = arch in (gguf.MODEL_ARCH.GEMMA2, gguf.MODEL_ARCH.GEMMA3)
    activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    expected = ("gelu_pytorch_tanh", "gelu_tanh") if gemma else ("silu", "swish")
    if activation not in expected:
        raise ExportError(
            f"export_format gguf: llama.cpp's {gguf.MODEL_ARCH_NAMES[arch]} uses {expected[0]}, this model "
            f"{activation!r}; it cannot run there unchanged"
        )
    if getattr(config, "mlp_bias", False):
        raise ExportError(f"export_format gguf: llama.cpp's {gguf.MODEL_ARCH_NAMES[arch]} has no MLP biases")


def _write_rope(writer: gguf.GGUFWriter, config: Any) -> None:
    rope = _rope_parameters(config)
    if rope.get("rope_theta") is not None:
        writer.add_rope_freq_base(rope["rope_theta"])
    if isinstance(rope.get("partial_rotary_factor"), float) and rope["partial_rotary_factor"] != 1.0:
        raise ExportError("export_format gguf: partial rotary embeddings are not written for these architectures")
    kind = str(rope.get("rope_type") or rope.get("type") or "default").lower()
    if kind in ("default", "llama3"):  # llama3: the rope_freqs tensor carries it
        return
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key, add in (("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", writer.add_rope_scaling_yarn_beta_slow),
                         ("attention_factor", writer.add_rope_scaling_yarn_attn_factor)):
            if rope.get(key) is not None:
                add(rope[key])
    else:
        raise ExportError(
            f"export_format gguf: rope_type {kind!r} is not written; tunelab writes default, linear, yarn and llama3"
        )


def _write_gemma(writer: gguf.GGUFWriter, config: Any, arch: gguf.MODEL_ARCH, layer_types: list[str],
                 head_dim: int) -> None:
    # llama.cpp fixes the query scale from the layer count (1/sqrt(head_dim), or 1/sqrt(hidden/heads) for 27B):
    # a model trained with another query_pre_attn_scalar would attend differently there.
    big = config.num_hidden_layers == (46 if arch == gguf.MODEL_ARCH.GEMMA2 else 62)
    scalar = config.hidden_size // config.num_attention_heads if big else head_dim
    if getattr(config, "query_pre_attn_scalar", scalar) != scalar:
        raise ExportError(
            f"export_format gguf: query_pre_attn_scalar={config.query_pre_attn_scalar}, but llama.cpp scales "
            f"queries by 1/sqrt({scalar}) for this {gguf.MODEL_ARCH_NAMES[arch]} model"
        )
    if arch == gguf.MODEL_ARCH.GEMMA2:
        if config.attn_logit_softcapping is None:
            raise ExportError("export_format gguf: llama.cpp's gemma2 always soft-caps attention logits; "
                              "this model has attn_logit_softcapping: null")
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    elif getattr(config, "attn_logit_softcapping", None) is not None:
        raise ExportError("export_format gguf: llama.cpp's gemma3 has no attention soft-capping")
    if getattr(config, "final_logit_softcapping", None) is not None:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    local = _rope_parameters(config, "sliding_attention")
    if "sliding_attention" in layer_types:
        writer.add_sliding_window(config.sliding_window)
        writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in layer_types])
        if local.get("rope_theta") is not None:
            writer.add_rope_freq_base_swa(local["rope_theta"])
    elif arch == gguf.MODEL_ARCH.GEMMA2:
        raise ExportError("export_format gguf: llama.cpp's gemma2 alternates sliding and global layers; this model "
                          "has no sliding layers")


# -------------------------------------------------------------------------------------------------- tokenizer


def _vocab_rows(model: torch.nn.Module) -> int:
    return model.get_input_embeddings().weight.shape[0]


def _write_provenance(writer: gguf.GGUFWriter, name: str | None, source: Provenance, config: Any) -> None:
    """general.name (the run's, else the source's, else the folder's), general.base_model.0.* for a trained run."""
    fallback = Path(str(getattr(config, "_name_or_path", "") or "model")).name or "model"
    if name is None:
        writer.add_name(source.name or fallback)
        if source.organization:
            writer.add_organization(source.organization)
    else:
        writer.add_name(name)
        writer.add_base_model_count(1)
        writer.add_base_model_name(0, source.name or fallback)
        if source.organization:
            writer.add_base_model_organization(0, source.organization)
    if source.license:
        writer.add_license(source.license)


def _write_vocabulary(writer: gguf.GGUFWriter, tokenizer: Any, n_rows: int, chat_template: str | None,
                      template_vars: Mapping[str, Any] | None, source_pre: str | None = None) -> None:
    """tokenizer.ggml.*: one token per embedding row (ids the tokenizer lacks become unused [PADn] tokens)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ExportError("export_format gguf: needs a fast tokenizer (tokenizer.json); this one is a slow "
                          f"{type(tokenizer).__name__}")
    spec = json.loads(backend.to_str())
    model_spec = spec["model"]
    if model_spec.get("type") != "BPE":
        raise ExportError(
            f"export_format gguf: a {model_spec.get('type')} tokenizer cannot be written; llama.cpp reads byte-level "
            "BPE (GPT-2, Llama 3, Qwen, SmolLM) and SentencePiece-style BPE with byte fallback "
            "(Llama 2, Mistral, Gemma)"
        )
    vocab = backend.get_vocab(with_added_tokens=True)
    if max(vocab.values()) >= n_rows:
        raise ExportError(
            f"export_format gguf: the tokenizer has ids up to {max(vocab.values())} but the model only "
            f"{n_rows} embedding rows; resize the embeddings (add_special_tokens does) before exporting"
        )
    added = {token["id"]: token for token in spec.get("added_tokens", [])}
    byte_level = any(step.get("type") == "ByteLevel" for step in _steps(spec.get("pre_tokenizer")))
    if not byte_level and not model_spec.get("byte_fallback"):
        raise ExportError(
            "export_format gguf: a BPE tokenizer that is neither byte-level nor byte-fallback cannot be written; "
            "llama.cpp could not encode characters outside its vocabulary"
        )
    by_id = {index: token for token, index in vocab.items()}
    unk_id = tokenizer.unk_token_id
    tokens, types = [], []
    for index in range(n_rows):
        token = by_id.get(index)
        if token is None:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
        elif not byte_level and _BYTE_TOKEN.fullmatch(token):  # byte fallback needs them typed BYTE, added or not
            tokens.append(token)
            types.append(gguf.TokenType.BYTE)
        elif index in added:
            special = added[index].get("special") or _looks_special(token)
            if not special and not byte_level:
                token = token.replace("\u2581", " ")  # llama.cpp matches user-defined tokens in raw text
            tokens.append(token)
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        elif not byte_level and index == unk_id:
            tokens.append(token)
            types.append(gguf.TokenType.UNKNOWN)
        else:
            tokens.append(token)
            types.append(gguf.TokenType.NORMAL)
    merges = _merges(model_spec)

    if byte_level:
        writer.add_tokenizer_model("gpt2")
        pre = _pre_tokenizer_kind(spec)
        # A GGUF source's tokenizer comes back from transformers as plain GPT-2 byte-level; its own name (smollm,
        # ...) is what llama.cpp's converter chose from the original tokenizer.json.
        writer.add_tokenizer_pre(source_pre if source_pre and pre == "gpt-2" else pre)
    else:
        # SentencePiece-style: llama.cpp merges by token score, so a token's score is minus the rank of the merge
        # that makes it: the order tokenizers applies the merges in.
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_scores(_scores_from_merges(merges, tokens, types))
        writer.add_add_space_prefix(_adds_space_prefix(tokenizer))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)

    for attr, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                      ("unk_token_id", writer.add_unk_token_id), ("pad_token_id", writer.add_pad_token_id)):
        token_id = getattr(tokenizer, attr, None)
        if isinstance(token_id, int):
            add(token_id)
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    writer.add_add_bos_token(len(full) > len(plain) and full[0] == tokenizer.bos_token_id)
    writer.add_add_eos_token(len(full) > len(plain) and full[-1] == tokenizer.eos_token_id)
    if chat_template is not None:
        bos, eos = tokenizer.bos_token or "", tokenizer.eos_token or ""
        template = Template.from_jinja("export", chat_template, bos_token=bos, eos_token=eos)
        end_of_turn = [tokenizer.convert_tokens_to_ids(word) for word in template.stop_words if word in vocab]
        if end_of_turn and end_of_turn[0] != tokenizer.eos_token_id:
            writer.add_eot_token_id(end_of_turn[0])  # llama.cpp ends a turn on it, like on eos
        writer.add_chat_template(embedded_chat_template(chat_template, template_vars))


def _steps(node: dict | None) -> list[dict]:
    """A pre-tokenizer as its list of steps (a Sequence flattened)."""
    if not node:
        return []
    if node.get("type") == "Sequence":
        return [step for child in node.get("pretokenizers", []) for step in _steps(child)]
    return [node]


def _pre_tokenizer_kind(spec: dict) -> str:
    """The name llama.cpp gives this byte-level tokenizer's pre-tokenizer (tokenizer.ggml.pre)."""
    steps = _steps(spec.get("pre_tokenizer"))
    kinds = [step.get("type") for step in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True) and not steps[0].get("add_prefix_space"):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        regex = (steps[0].get("pattern") or {}).get("Regex")
        for name, known in _SPLIT_REGEXES.items():
            if regex == known and steps[0].get("behavior") == "Isolated" and not steps[0].get("invert"):
                return name
    raise ExportError(
        "export_format gguf: llama.cpp has no pre-tokenizer matching this tokenizer's "
        f"({json.dumps(spec.get('pre_tokenizer'))[:160]}); recognised: gpt-2, smollm, {', '.join(_SPLIT_REGEXES)}"
    )


def _merges(model_spec: dict) -> list[str]:
    """Merges as 'left right' lines; a space inside a part is written as U+0120, as llama.cpp's converter does."""
    merges = model_spec.get("merges") or []
    if merges and not isinstance(merges[0], str):
        return [" ".join(part.replace(" ", "\u0120") for part in pair) for pair in merges]
    return list(merges)


def _scores_from_merges(merges: list[str], tokens: list[str], types: list[int]) -> list[float]:
    rank = {}
    for index, merge in enumerate(merges):
        rank.setdefault(merge.replace(" ", "", 1), index)
    scores = []
    for token, kind in zip(tokens, types):
        if kind in (gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED, gguf.TokenType.UNUSED):
            scores.append(-1000.0)
        else:
            scores.append(-float(rank.get(token, 0)))  # base characters and bytes: never a merge result
    return scores


def _adds_space_prefix(tokenizer: Any) -> bool:
    """Whether the tokenizer puts a '▁' before the first word (SentencePiece's add_dummy_prefix)."""
    pieces = tokenizer.convert_ids_to_tokens(tokenizer("a", add_special_tokens=False)["input_ids"])
    return bool(pieces) and pieces[0].startswith("\u2581")


def _looks_special(token: str) -> bool:
    # llama.cpp's converter also treats <|...|> tokens as control even where tokenizer.json does not mark them
    return token.startswith("<|") and token.endswith("|>")
