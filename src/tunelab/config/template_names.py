"""Template names as options spell them: LlamaFactory's names for built-in templates, and the variables they imply.

A config's `template: qwen3_nothink` becomes `template: qwen3` with `template_kwargs: {enable_thinking: false}` while
the config loads (config/loader.py), and `tunelab chat --template` goes through the same table; the templates
themselves are data/templates'.
"""

from __future__ import annotations

from typing import Any

# LlamaFactory template name -> (built-in, template variables it implies, what it is). qwen, gemma and gemma3n
# render exactly like LlamaFactory's templates of those names (compared on conversations with and without a system
# turn, one and two exchanges). qwen3_nothink is Qwen3's own non-thinking mode: the empty think block the
# official template pre-fills when enable_thinking is false; LlamaFactory's template of that name writes no
# think block at all (its format for the Qwen3 Instruct-2507 models, which ship their own chat_template).
TEMPLATE_ALIASES: dict[str, tuple[str, dict[str, Any], str]] = {
    "qwen": ("qwen2_5", {}, "Qwen2 / Qwen2.5 (ChatML with Qwen's default system prompt)"),
    "qwen3_nothink": (
        "qwen3", {"enable_thinking": False}, "Qwen3 with thinking off (an empty think block in the prompt)"
    ),
    "gemma": ("gemma3", {}, "Gemma (a system message is folded into the first user turn, as Gemma-3 does)"),
    "gemma3n": ("gemma3", {}, "Gemma-3n (Gemma-3's format)"),
}


def resolve_template_name(
    name: str | None, template_kwargs: dict[str, Any] | None = None
) -> tuple[str | None, dict[str, Any] | None]:
    """An alias as (built-in, its variables merged under ``template_kwargs``: the caller's values win);
    any other name unchanged."""
    if name not in TEMPLATE_ALIASES:
        return name, template_kwargs
    builtin, implied, _ = TEMPLATE_ALIASES[name]
    merged = {**implied, **(template_kwargs or {})}
    return builtin, merged or template_kwargs


# LlamaFactory template names with no built-in that renders the same (TEMPLATE_ALIASES above are those
# that do): the model's own chat_template is the faithful choice.
LLAMAFACTORY_TEMPLATES = (
    "alpaca", "deepseek", "deepseek3", "deepseekr1", "empty", "glm4_moe", "gpt_oss", "intern2", "llama4",
    "ministral", "mistral", "mistral_small", "phi", "phi4", "phi4_mini", "qwen2_vl", "qwen3_vl", "qwen3_vl_nothink",
    "vicuna", "zephyr",
)
