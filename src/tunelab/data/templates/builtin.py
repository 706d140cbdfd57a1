"""The built-in chat templates: their names, metadata, and loading their ``<name>.jinja`` sources.

Each source is our own Jinja that renders byte-identically to the model family's official Hugging
Face chat template (``default`` is a plain format of our own). Metadata here only overrides what
cannot be derived from a render, such as extra stop words.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources

# name -> stop words that a probe render cannot reveal (None: derive them)
_STOP_WORDS: dict[str, tuple[str, ...] | None] = {
    "chatml": None,
    "deepseek_r1_distill": None,
    "deepseek_v2": None,
    "default": None,
    "gemma2": None,
    "gemma3": None,
    # GLM-4 writes no end-of-turn: the model ends an answer by starting the next role.
    "glm4": ("<|user|>", "<|observation|>"),
    "internlm2": None,
    "llama2": None,
    "llama3": None,
    # Llama-3.1 ends a built-in tool call with <|eom_id|> (ipython mode) instead of <|eot_id|>.
    "llama3_1": ("<|eot_id|>", "<|eom_id|>"),
    "mistral_nemo": None,
    "mistral_v0_3": None,
    "phi3_5": None,
    "qwen2_5": None,
    "qwen3": None,
    "yi": None,
}

BUILTIN_NAMES: tuple[str, ...] = tuple(sorted(_STOP_WORDS))


@lru_cache(maxsize=None)
def builtin_source(name: str) -> str:
    """The Jinja text of a built-in template, read from the package data."""
    return resources.files(__package__).joinpath(f"{name}.jinja").read_text(encoding="utf-8")


def builtin_stop_words(name: str) -> tuple[str, ...] | None:
    return _STOP_WORDS[name]
