"""The values `tunelab export`'s export_format and export_gguf_type take, checked while the config loads.

export/gguf_writer.py maps each GGUF type to gguf-py's (a test holds the two lists equal); this module only names
them, so the config stays free of the gguf package.
"""

from __future__ import annotations

import difflib

from tunelab.errors import ConfigError

# GGUF tensor type -> what it stores (help text; docs/deploy.md has the measured gaps and sizes).
GGUF_TYPES = {
    "f32": "float32, exact",
    "f16": "float16",
    "bf16": "bfloat16",
    "q8_0": "8-bit blocks of 32 with one scale",
    "q5_1": "5-bit blocks with scale and minimum",
    "q5_0": "5-bit blocks with one scale",
    "q4_1": "4-bit blocks with scale and minimum",
    "q4_0": "4-bit blocks with one scale",
    "q6_k": "6-bit k-quant super-blocks",
    "q5_k_m": "5-bit k-quants, attn_v and ffn_down of some layers 6-bit",
    "q4_k_m": "4-bit k-quants, attn_v and ffn_down of some layers 6-bit",
}
DEFAULT_GGUF_TYPE = "q8_0"


def check_gguf_type(name: str) -> None:
    """ConfigError naming export_gguf_type when `name` is not a type tunelab writes (k-quants say where they come
    from)."""
    if name in GGUF_TYPES:
        return
    lowered = name.lower()
    if lowered in GGUF_TYPES:
        hint = f"did you mean '{lowered}'? "
    elif lowered.startswith(("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq")):
        hint = ("other k-quants and i-quants need llama.cpp's llama-quantize: export f16 and quantize that file "
                "(docs/deploy.md); ")
    else:
        close = lowered if lowered in GGUF_TYPES else next(iter(difflib.get_close_matches(lowered, GGUF_TYPES, n=1)),
                                                           None)
        hint = f"did you mean '{close}'? " if close else ""
    raise ConfigError(f"export_gguf_type: '{name}' is not a type tunelab writes; {hint}types: {', '.join(GGUF_TYPES)}")
