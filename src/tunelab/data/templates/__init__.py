"""Chat templates: Jinja sources that turn a conversation into text, and where its answers are trained.

Public API: ``TEMPLATE_NAMES`` (built-ins, sorted), ``get_template`` (a built-in by name, or the
tokenizer's own ``chat_template``; warns when a named built-in renders unlike the tokenizer's own),
``tokenizer_chat_template`` (read a model folder's template without loading the tokenizer), the
``Template`` value they return, and ``HistoryRewriteError`` (a conversation the template cannot mask in
one render; ``Template.training_examples`` then encodes it per answer).

``TEMPLATE_ALIASES`` are LlamaFactory's names for a built-in, each with the template variables it implies;
``resolve_template_name`` turns one into (built-in, variables) where a name enters from the user (the config
loader, ``--template``); both live with the options (config/template_names.py). ``template_variables`` / ``check_template_kwargs`` (variables.py): what a template's
source reads, and refusing a ``template_kwargs`` key it does not read.
"""

from __future__ import annotations

import difflib
import logging
from functools import lru_cache
from typing import Any

from tunelab.config.template_names import TEMPLATE_ALIASES, resolve_template_name
from tunelab.data.templates.builtin import BUILTIN_NAMES, builtin_source, builtin_stop_words
from tunelab.data.templates.mismatch import mismatch_message
from tunelab.data.templates.model_folder import tokenizer_chat_template
from tunelab.data.templates.spans import HistoryRewriteError
from tunelab.data.templates.template import (
    Template,
    end_of_turn_message,
    special_token,
    split_end_of_turn_markers,
    tokenizer_source,
)
from tunelab.data.templates.variables import check_template_kwargs, template_variables
from tunelab.errors import TemplateError

TEMPLATE_NAMES: tuple[str, ...] = BUILTIN_NAMES

__all__ = [
    "TEMPLATE_ALIASES", "TEMPLATE_NAMES", "HistoryRewriteError", "Template", "check_template_kwargs", "get_template",
    "resolve_template_name", "template_variables", "tokenizer_chat_template",
]

logger = logging.getLogger(__name__)


def get_template(name: str | None, tokenizer: Any = None) -> Template:
    """``None``/``"model"``: the tokenizer's own chat template; otherwise the built-in called ``name``."""
    if name is None or name == "model":
        if tokenizer is None:
            raise TemplateError("template: 'model' reads the tokenizer's chat_template, but no tokenizer was given")
        return _checked(Template.from_tokenizer(tokenizer), tokenizer)
    if name not in TEMPLATE_NAMES:
        close = difflib.get_close_matches(name, TEMPLATE_NAMES, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise TemplateError(f"template: '{name}' does not exist; {hint}built-ins: {', '.join(TEMPLATE_NAMES)}")
    bos, eos = special_token(tokenizer, "bos_token"), special_token(tokenizer, "eos_token")
    template = _builtin(name, bos, eos)
    own = tokenizer_source(tokenizer)
    if own is not None:
        message = mismatch_message(template, own, bos, eos)
        if message:
            logger.warning(message)
    return _checked(template, tokenizer)


def _checked(template: Template, tokenizer: Any) -> Template:
    """The template, once its end-of-turn markers are known to be tokens of this tokenizer (docs/data.md)."""
    if not callable(tokenizer):  # no tokenizer, or only its chat_template / bos / eos: no vocabulary to check
        return template
    for word, count in split_end_of_turn_markers(template, tokenizer):
        message = end_of_turn_message(template, word, count)
        if template.stop_words and word == template.stop_words[0]:  # ends every answer: the run cannot work
            raise TemplateError(message)
        logger.warning("%s (only turns that end with it are affected)", message)
    return template


@lru_cache(maxsize=None)
def _builtin(name: str, bos_token: str, eos_token: str) -> Template:
    # Stop words may depend on the tokenizer's eos (e.g. Llama-2 ends a turn with it), hence the key.
    return Template.from_jinja(name, builtin_source(name), builtin_stop_words(name), bos_token, eos_token)
