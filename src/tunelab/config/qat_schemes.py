"""The quantization schemes `qat` and `export_quantization` name, and the group size they default to.

Values the options take, checked while the config loads; model/qat.py maps each to its torchao config.
"""

from __future__ import annotations

import difflib

from tunelab.errors import ConfigError

# Scheme name -> what it does (help text, docs/quantization.md).
SCHEMES = {
    "int8-int4": "int8 dynamic per-token activations + int4 weights per group",
    "int4-weight": "int4 weights per group, full-precision activations",
    "int8-weight": "int8 weights per group, full-precision activations",
}
DEFAULT_GROUP_SIZE = 32
# Names peers use for the same schemes (torchtune / torchao / LlamaFactory), for the did-you-mean.
PEER_NAMES = {
    "8da4w": "int8-int4", "int8_dynamic_activation_int4_weight": "int8-int4", "int8da_int4w": "int8-int4",
    "4w": "int4-weight", "int4_weight_only": "int4-weight", "int4": "int4-weight",
    "int8_weight_only": "int8-weight", "int8": "int8-weight",
}


def check_scheme(key: str, name: str) -> None:
    """ConfigError naming `key` when `name` is not a scheme, with the closest one."""
    if name in SCHEMES:
        return
    close = PEER_NAMES.get(name.lower()) or next(iter(difflib.get_close_matches(name, SCHEMES, n=1)), None)
    hint = f"did you mean '{close}'? " if close else ""
    raise ConfigError(f"{key}: '{name}' is not a quantization scheme; {hint}schemes: {', '.join(SCHEMES)}")
