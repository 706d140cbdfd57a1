"""The Jinja engine that renders chat templates exactly as transformers' ``apply_chat_template`` does.

Owns the sandboxed environment (same options, ``tojson`` filter and globals as transformers), the
compile cache, and turning Jinja failures into one-line ``TemplateError`` messages.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tunelab.errors import TemplateError


class _RaisedByTemplate(Exception):
    """What ``raise_exception`` throws; carries the template's own message up to ``render``."""


def _raise_exception(message: str) -> None:
    raise _RaisedByTemplate(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes; templates expect plain json.dumps (transformers overrides it the same way).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _make_environment()
_GLOBALS = dict(_ENV.globals)


@lru_cache(maxsize=64)
def compile_template(source: str) -> jinja2.Template:
    """Compile a template source once; later calls with the same text reuse it."""
    return _ENV.from_string(source)


def check_source(name: str, source: str) -> jinja2.Template:
    """Compile ``source`` (cached); a syntax error becomes a ``TemplateError`` naming the template."""
    try:
        return compile_template(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(
            f"chat template '{name}' is not valid Jinja (line {exc.lineno}: {exc.message}); fix the template text"
        ) from None


def render_source(name: str, source: str, context: dict[str, Any]) -> str:
    """Render ``source`` with ``context``; every failure becomes a ``TemplateError`` naming the template."""
    compiled = check_source(name, source)
    try:
        # What Template.render does, less its per-call merge of the globals into the context (a ChainMap walk that
        # costs twice the render of a short conversation, and training renders every example three times): the
        # globals are merged here into a fresh dict that the context takes as is (Jinja's `shared`).
        return _ENV.concat(compiled.root_render_func(compiled.new_context({**_GLOBALS, **context}, shared=True)))
    except _RaisedByTemplate as exc:
        raise TemplateError(
            f"chat template '{name}' refused the conversation: {_one_line(exc)}; "
            "change the messages or pick another template"
        ) from None
    except Exception as exc:  # noqa: BLE001 - any Jinja/Python failure inside a template is the template's problem
        detail = _one_line(exc) or type(exc).__name__
        raise TemplateError(
            f"chat template '{name}' failed to render ({type(exc).__name__}: {detail}); "
            "check that every message has the fields this template reads"
        ) from None


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())
