"""Checking a built-in template against the tokenizer's own ``chat_template`` before training with it.

A model learned its own chat format; naming a built-in that renders differently trains (and later
serves) it on another format. That is sometimes intended, so it is a warning, not an error: the first
character where the two renders of a probe conversation part, with a short excerpt of each side. The
generation prompt is compared too: DeepSeek-R1-Distill renders DeepSeek-V3's finished conversations
byte for byte, but opens every answer with a think block V3's prompt does not have.
"""

from __future__ import annotations

from typing import Any

from tunelab.data.templates.template import Template
from tunelab.errors import TemplateError

_EXCERPT = 24  # characters of each side shown from the first difference

_EXCHANGES = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "2+2 equals 4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "3+3 equals 6."},
]
# With a system turn first, and without one: both must agree (Qwen2.5 writes a default system prompt that ChatML
# does not, so they differ only without one; Gemma-2 refuses system turns).
_PROBES = ([{"role": "system", "content": "You are a helpful assistant."}, *_EXCHANGES], _EXCHANGES)


def mismatch_message(builtin: Template, tokenizer_jinja: str, bos_token: str, eos_token: str) -> str | None:
    """The warning to log when ``builtin`` renders the probe unlike the tokenizer's template, else None."""
    own = Template(name="tokenizer", jinja=tokenizer_jinja)
    tokens: dict[str, Any] = {"bos_token": bos_token, "eos_token": eos_token}
    # The finished conversations first, then the prompts that ask for their last answer.
    for probe, generation in [*((probe, False) for probe in _PROBES), *((probe[:-1], True) for probe in _PROBES)]:
        try:
            ours = builtin.render(probe, add_generation_prompt=generation, **tokens)
            theirs = own.render(probe, add_generation_prompt=generation, **tokens)
        except TemplateError:
            continue  # one side refuses this probe (or cannot render at all): try the next, else say nothing
        if ours == theirs:
            continue  # templates can agree with a system turn and differ without (ChatML vs Qwen2.5's default)
        at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        what = "the generation prompt " if generation else ""
        return (
            f"template '{builtin.name}' renders {what}differently from the tokenizer's own chat_template from "
            f"character {at}: built-in {ours[at : at + _EXCERPT]!r}, tokenizer {theirs[at : at + _EXCERPT]!r}; the "
            "model learned its own format, so set template: model unless you mean to switch formats"
        )
    return None
