"""The language model's part of a model config: a vision-language model nests it, a causal LM is it."""

from __future__ import annotations


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config
