"""GGUF files (llama.cpp, Ollama, LM Studio) as a model source, read with the gguf package and transformers' GGUF maps.

    model_name_or_path: models/SmolLM2-135M-Instruct.Q4_1.gguf      (or a folder / Hub id plus gguf_file: name.gguf)
      config time: model/folder.py resolves it to the file's path; `check_readable` reads its header: an architecture
                   or tensor type transformers cannot read is one line naming it and what can be read
      load time:   `from_pretrained(auto_class, path, ...)`: the model built from the config transformers rebuilds
                   from the file's metadata, its weights dequantized tensor by tensor into the compute dtype
                   (model/gguf_weights.py: peak RSS about the weights alone); the tokenizer (chat template included)
                   comes from the metadata too
      run record:  `file_record`: the file's SHA-256 and quantization type (run_info.json `gguf`)

After loading, the model is a plain dense model: the GGUF quantization marks transformers would leave on it (the
config's quantization_config, the model's hf_quantizer) are removed or never set, since they would make
save_pretrained refuse and the Trainer treat it as a quantized model that cannot train. Its name_or_path is the
file, so an adapter trained on it names the file as its base (adapter_config.json base_model_name_or_path) and chat
/ export find it again.

Everything else in tunelab passes the path on unchanged: `pretrained_source` and `load_config` are the only places
that split it into transformers' (folder, gguf_file) form. Writing GGUF files is export/gguf_writer.py's.
"""

from __future__ import annotations

import importlib.util
import mmap
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from transformers import AutoConfig, GgufConfig, PretrainedConfig
from transformers.integrations.gguf.reader import GGML_NAME

from tunelab.errors import ConfigError, first_line
from tunelab.model import gguf_weights
from tunelab.run_folder import file_sha256

SUFFIX = ".gguf"
FLOAT_TYPES = ("F32", "F16", "BF16")


def is_gguf(path: str | Path | None) -> bool:
    """True for a path naming a .gguf file (any case), whether or not it exists yet."""
    return path is not None and Path(str(path)).suffix.lower() == SUFFIX


def pretrained_source(path: str | Path) -> tuple[str, dict[str, Any]]:
    """from_pretrained's (name_or_path, extra kwargs) for a model folder or a .gguf file."""
    if not is_gguf(path):
        return str(path), {}
    file = Path(path)
    return str(file.parent), {"gguf_file": file.name}


def load_config(path: str | Path, trust_remote_code: bool = False) -> PretrainedConfig:
    """The model's config: config.json of a folder, or rebuilt from a GGUF file's metadata (no tensors read)."""
    source, kwargs = pretrained_source(path)
    return AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code, **kwargs)


def from_pretrained(auto_class: Any, path: str | Path, **kwargs: Any) -> Any:
    """auto_class.from_pretrained for a folder or a .gguf file. A GGUF loads dense, in `dtype`: its tensors are
    dequantized one by one into a state dict (model/gguf_weights.py) that from_pretrained takes without a copy, so
    the peak is about the weights alone. With a bitsandbytes quantization_config (QLoRA) from_pretrained quantizes
    that state dict as it would a folder's weights."""
    source, extra = pretrained_source(path)
    if not extra:
        return auto_class.from_pretrained(source, **kwargs)
    header = read_header(path)
    architecture = str(header.string("general.architecture"))
    if _converted_by_transformers(architecture):
        return _from_pretrained_by_transformers(auto_class, path, **kwargs)
    trust_remote_code = kwargs.pop("trust_remote_code", False)
    config = kwargs.pop("config", None) or load_config(path, trust_remote_code)  # (a given config: RoPE scaled)
    _drop_quantization_marks(config)
    for key in [k for k in kwargs if k not in _LOADING_OPTIONS and hasattr(config, k)]:  # e.g. a reward head's
        setattr(config, key, kwargs.pop(key))  # num_labels: from_pretrained hands a given config's to the model
    dtype = kwargs.get("dtype")
    dtype = dtype if isinstance(dtype, torch.dtype) else torch.float32  # (the file's blocks dequantize to float32)
    with torch.device("meta"):  # the model's parameter names, no memory
        skeleton = auto_class.from_config(config, trust_remote_code=trust_remote_code)
    state_dict = gguf_weights.dense_state_dict(path, header.tensors, header.data_start, architecture, skeleton, dtype)
    loaded = type(skeleton).from_pretrained(None, config=config, state_dict=state_dict, **{**kwargs, "dtype": dtype})
    model = loaded[0] if isinstance(loaded, tuple) else loaded
    model.name_or_path = str(path)  # what an adapter trained on it names as its base
    return loaded


# from_pretrained's own options that a config also has an attribute of the same name for
_LOADING_OPTIONS = frozenset({"dtype", "attn_implementation", "quantization_config", "use_kernels"})


def _converted_by_transformers(architecture: str) -> bool:
    """An architecture transformers reads through its own GGUF converter pipeline (lfm2, qwen3.5), not the legacy
    loader whose name maps and tensor processors gguf_weights.py uses."""
    # lazy: transformers' GGUF code imports accelerate and sympy (15 s); GGUF files only
    from transformers.integrations.gguf.utils import is_gguf_arch_supported

    return is_gguf_arch_supported(architecture)


def _from_pretrained_by_transformers(auto_class: Any, path: str | Path, **kwargs: Any) -> Any:
    """transformers' own GGUF loading, every weight dequantized (GgufConfig(dequantize=True)) and the quantization
    marks removed; a QLoRA quantization_config then quantizes the dense state dict (both are held for that moment)."""
    source, extra = pretrained_source(path)
    quantization_config = kwargs.pop("quantization_config", None)
    loaded = auto_class.from_pretrained(source, quantization_config=GgufConfig(dequantize=True), **extra, **kwargs)
    model = loaded[0] if isinstance(loaded, tuple) else loaded
    model.hf_quantizer = None
    _drop_quantization_marks(model.config)
    if quantization_config is not None:
        state_dict, config, model_class = model.state_dict(), model.config, type(model)
        del model, loaded
        kwargs.pop("trust_remote_code", None)  # (the class is known now)
        kwargs.pop("config", None)  # (a config given, e.g. with RoPE scaled, is the loaded model's now)
        loaded = model_class.from_pretrained(None, config=config, state_dict=state_dict,
                                             quantization_config=quantization_config, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
    model.name_or_path = str(path)
    return loaded


def _drop_quantization_marks(config: PretrainedConfig) -> None:
    """The GGUF quantization_config a file's config carries would make save_pretrained refuse and the Trainer treat
    the dense model as one that cannot train."""
    for part in {id(c): c for c in (config, config.get_text_config())}.values():
        if hasattr(part, "quantization_config"):
            del part.quantization_config


# ---- what the file holds ------------------------------------------------------------------------------------------


class TensorEntry(NamedTuple):
    """One tensor of the file's tensor table: where its data is and how it is stored."""

    name: str
    shape: tuple[int, ...]  # in torch order (ggml lists the fastest-moving dimension first)
    ggml_type: int
    offset: int  # from the start of the data section


@dataclass(frozen=True)
class Header:
    """What tunelab reads of a GGUF file without its tensor data: the metadata (numbers and strings; an array as its
    length), the tensor table and where the tensor data begins."""

    metadata: dict[str, Any]
    tensors: tuple[TensorEntry, ...]
    data_start: int = 0

    def string(self, key: str) -> str | None:
        value = self.metadata.get(key)
        return value if isinstance(value, str) else None


# GGUF metadata value types: the fixed-width ones (8: string, 9: array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def read_header(path: str | Path, key: str = "model_name_or_path") -> Header:
    """The file's header (GGUF v2 / v3), read directly: the gguf package's reader also parses every vocabulary entry
    into objects, which takes seconds per read on a 262k-token vocabulary; this walks past them. ConfigError when
    the file is not a readable GGUF."""
    try:
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as blob:
            return _parse_header(blob)
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as exc:
        raise ConfigError(f"{key}: {path} is not a readable GGUF file ({first_line(exc) or type(exc).__name__})") from None


def _parse_header(blob: mmap.mmap) -> Header:
    if blob[:4] != b"GGUF":
        raise ValueError("it does not start with the GGUF magic bytes")
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", blob, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version}; tunelab reads versions 2 and 3")
    pos = 24

    def string(pos: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", blob, pos)
        return blob[pos + 8:pos + 8 + length].decode("utf-8"), pos + 8 + length

    def value(kind: int, pos: int) -> tuple[Any, int]:
        if kind in _SCALARS:
            return struct.unpack_from(_SCALARS[kind], blob, pos)[0], pos + struct.calcsize(_SCALARS[kind])
        if kind == 8:
            return string(pos)
        if kind != 9:
            raise ValueError(f"a metadata value of unknown type {kind}")
        item, count = struct.unpack_from("<IQ", blob, pos)
        pos += 12
        if item in _SCALARS:
            return count, pos + count * struct.calcsize(_SCALARS[item])
        for _ in range(count):  # strings (a vocabulary) or nested arrays: walked past, not kept
            if item == 8:
                pos += 8 + struct.unpack_from("<Q", blob, pos)[0]
            else:
                pos = value(item, pos)[1]
        return count, pos

    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        name, pos = string(pos)
        (kind,) = struct.unpack_from("<I", blob, pos)
        metadata[name], pos = value(kind, pos + 4)
    tensors = []
    for _ in range(tensor_count):
        name, pos = string(pos)
        (dims,) = struct.unpack_from("<I", blob, pos)
        shape = struct.unpack_from(f"<{dims}Q", blob, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * dims)
        tensors.append(TensorEntry(name, tuple(reversed(shape)), ggml_type, offset))
        pos += 4 + 8 * dims + 12
    alignment = metadata.get("general.alignment", 32)  # the data section starts at the next multiple of it
    return Header(metadata, tuple(tensors), (pos + alignment - 1) // alignment * alignment)


def vocab_size(path: str | Path) -> int | None:
    """The vocabulary size transformers' config of the file will have: `<architecture>.vocab_size`, else the number
    of tokens in the file's vocabulary; read from the header alone."""
    header = read_header(path)
    size = header.metadata.get(f"{header.string('general.architecture')}.vocab_size",
                               header.metadata.get("tokenizer.ggml.tokens"))
    return int(size) if isinstance(size, int) else None


def _type_name(ggml_type: int) -> str:
    from gguf import GGMLQuantizationType  # lazy: the gguf extra, which may be missing

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def _require_gguf_package(path: str | Path) -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(f"model_name_or_path: {path} is a GGUF file; reading it needs the gguf package: "
                          "pip install 'tunelab[gguf]'")


def tensor_types(header: Header) -> Counter[str]:
    """How many of the file's tensors are stored in each ggml type (F32, Q4_K, ...)."""
    return Counter(_type_name(entry.ggml_type) for entry in header.tensors)


def quantization_type(header: Header) -> str:
    """The file's quantization type as llama.cpp names it (general.file_type: Q4_K_M, Q8_0, F16, ...), else the type
    most of its matrices are stored in."""
    from gguf import LlamaFileType  # lazy: the gguf extra, which may be missing

    file_type = header.metadata.get("general.file_type")
    if isinstance(file_type, int):
        try:
            return LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            pass
    matrices = Counter(_type_name(entry.ggml_type) for entry in header.tensors if len(entry.shape) >= 2)
    return (matrices or tensor_types(header)).most_common(1)[0][0]


def readable_architectures() -> list[str]:
    """The GGUF architectures (general.architecture) transformers can build a model for."""
    # lazy: transformers' GGUF code imports accelerate and sympy (15 s); GGUF files only
    from transformers.integrations.gguf.gguf_conversion_mapping import GGUF_ARCHS
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    # as llama.cpp spells them in a file (transformers maps qwen2moe to its qwen2_moe, ...)
    spelled = {name.replace("_moe", "moe").replace("gpt_oss", "gpt-oss").replace("minimax_m2", "minimax-m2")
               for name in GGUF_SUPPORTED_ARCHITECTURES}
    return sorted((spelled | set(GGUF_ARCHS)) - {"general", "tokenizer"})


def readable_types(architecture: str) -> list[str]:
    """The ggml tensor types transformers dequantizes for a file of this architecture."""
    # lazy: transformers' GGUF code imports accelerate and sympy (15 s); GGUF files only
    from transformers.integrations.gguf.utils import is_gguf_arch_supported

    if is_gguf_arch_supported(architecture):  # transformers' own block reader
        return [*FLOAT_TYPES, *GGML_NAME.values()]
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize  # lazy: the gguf extra, which may be missing

    def dequantizes(qtype: GGMLQuantizationType) -> bool:
        try:
            dequantize(np.zeros(GGML_QUANT_SIZES[qtype][1], np.uint8), qtype)
        except NotImplementedError:
            return False
        return True

    # the legacy loader dequantizes with the gguf package: ask it, one block of each type
    return [qtype.name for qtype in GGMLQuantizationType if qtype in GGML_QUANT_SIZES and dequantizes(qtype)]


def check_readable(path: str | Path, key: str = "model_name_or_path") -> None:
    """A GGUF file transformers can load: a known architecture and tensor types it dequantizes; else one line naming
    what is not readable and listing what is."""
    _require_gguf_package(path)
    header = read_header(path, key)
    architecture = header.string("general.architecture")
    known = readable_architectures()
    if architecture not in known and not str(architecture).startswith("t5"):  # (t5encoder reads as t5)
        raise ConfigError(f"{key}: {Path(path).name} holds a GGUF of architecture '{architecture}', which transformers "
                          f"cannot read; it reads {', '.join(known)}")
    readable = readable_types(architecture)
    unreadable = sorted(set(tensor_types(header)) - set(readable))
    if unreadable:
        raise ConfigError(f"{key}: {Path(path).name} stores tensors as {', '.join(unreadable)}, which transformers "
                          f"cannot dequantize; it reads {', '.join(readable)}: use a file of another quantization")


def file_record(path: str | Path) -> dict[str, Any]:
    """What a run records about the GGUF it trained from: the file, its SHA-256, quantization type, architecture and
    how many tensors each ggml type holds. (Hashes the whole file: once per run.)"""
    header = read_header(path)
    return {
        "file": str(path),
        "sha256": file_sha256(path),
        "quantization": quantization_type(header),
        "architecture": header.string("general.architecture"),
        "tensor_types": dict(sorted(tensor_types(header).items())),
    }
