"""The variables a chat template reads beyond the conversation, and checking `template_kwargs` against them.

A template's own options (Qwen3's ``enable_thinking``, Llama-3.1's ``date_string``, ``tools_in_user_message``,
``builtin_tools``) are the names its Jinja source may read from the caller (jinja2's
``meta.find_undeclared_variables``), less what every render is given anyway (the messages, tools, the
generation flag, bos/eos) and the engine's globals (``raise_exception``, ``strftime_now``). Jinja counts a
name the template sets only inside branches as possibly read (Gemma-3's ``first_prefix``); such a helper
is an option only when the template also asks whether it is defined (``{% if date_string is not defined
%}{% set date_string = ... %}``, the official Llama-3.1 idiom). A key the template does not read would
change nothing, so it is refused instead of being silently ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jinja2 import meta, nodes

from tunelab.data.templates.engine import check_source
from tunelab.errors import TemplateError

# What Template.render always passes; a user cannot set these through template_kwargs.
RENDER_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "documents"})


def template_variables(name: str, source: str) -> frozenset[str]:
    """Names ``source`` reads that a caller may set: undeclared variables, less the render's own and the globals."""
    environment = check_source(name, source).environment
    tree = environment.parse(source)
    assigned = {node.name for node in tree.find_all(nodes.Name) if node.ctx == "store"}
    tested = {
        test.node.name for test in tree.find_all(nodes.Test)
        if test.name in ("defined", "undefined") and isinstance(test.node, nodes.Name)
    }
    read = {v for v in meta.find_undeclared_variables(tree) if v not in assigned or v in tested}
    return frozenset(read - RENDER_VARIABLES - set(environment.globals))


def check_template_kwargs(name: str, source: str, kwargs: Mapping[str, Any] | None) -> None:
    """Refuse a key the template does not read (or one every render sets), naming the key, the template and
    the variables it reads."""
    if not kwargs:
        return
    reserved = sorted(k for k in kwargs if k in RENDER_VARIABLES)
    if reserved:
        raise TemplateError(
            f"template_kwargs: {', '.join(repr(k) for k in reserved)} is set by tunelab for every render "
            "(from the conversation and the tokenizer); remove it from template_kwargs"
        )
    readable = template_variables(name, source)
    unknown = sorted(k for k in kwargs if k not in readable)
    if unknown:
        reads = f"it reads {', '.join(sorted(readable))}" if readable else "it reads no variables besides the conversation"
        keys = ", ".join(repr(k) for k in unknown)
        raise TemplateError(f"template_kwargs: template '{name}' does not read {keys}; {reads}")
