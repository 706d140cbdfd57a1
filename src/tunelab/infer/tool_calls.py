"""Tool calls in generated text: the syntax a chat template writes them in, and parsing answers back into calls.

A template shows the model its tools (`tools` in the render) and writes an assistant's calls in one syntax;
the model learned that syntax, so its answers are parsed with the same one:

    family        written by (built-ins)          an answer with calls
    hermes        default, qwen2_5, qwen3           [text] <tool_call>{"name": …, "arguments": {…}}</tool_call> …
                                                    or only {"name": …, "arguments": {…}} … untagged, bare or in
                                                    one ```json block (llama.cpp's rule)
    llama3_json   llama3_1                          {"name": …, "parameters": {…}}   (the whole answer)
    mistral       mistral_v0_3, mistral_nemo        [text] [TOOL_CALLS] [{"name": …, "arguments": {…}}, …]

`tool_syntax(template)` renders a probe call through the template itself (any template: a model's own Jinja
too) and keeps the family whose parser reads the probe back exactly; for the built-ins the result is the
table above. The same render gives the text an answer with calls starts with, which is what
tool_choice "required" or a named function pre-fills. `ToolCallStream` splits a streamed answer into the
content to show now and the calls, which are only known once the answer is complete.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tunelab.data.templates import Template
from tunelab.errors import TemplateError

# The built-ins that have a tool-call syntax; the others do not render tools or calls.
BUILTIN_FAMILIES = {
    "default": "hermes", "qwen2_5": "hermes", "qwen3": "hermes",
    "llama3_1": "llama3_json",
    "mistral_v0_3": "mistral", "mistral_nemo": "mistral",
}

Parsed = tuple[str, list[tuple[str, dict[str, Any]]]]  # (content outside the calls, [(name, arguments)])


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        """OpenAI's wire format: arguments as JSON text."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


# ---- parsers: the text of a whole answer → (content, calls), or None when it holds no well-formed calls --------


def _object(text: str) -> tuple[Any, int] | None:
    """The JSON value at the start of `text` (after whitespace) and where it ends, or None."""
    stripped = text.lstrip()
    try:
        value, end = json.JSONDecoder().raw_decode(stripped)
    except ValueError:
        return None
    return value, len(text) - len(stripped) + end


def _call(value: Any, arguments_key: str = "arguments") -> tuple[str, dict[str, Any]] | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get(arguments_key, {})
    if isinstance(arguments, str):  # some models write the arguments as JSON text, as OpenAI's wire format does
        parsed = _object(arguments)
        arguments = parsed[0] if parsed and not arguments[parsed[1]:].strip() else None
    return (value["name"], arguments) if isinstance(arguments, dict) else None


_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> Parsed | None:
    if "<tool_call>" not in text:
        return _bare_calls(text)
    calls, content, last = [], [], 0
    for match in _HERMES_BLOCK.finditer(text):
        body = match.group(1)
        parsed = _object(body)
        call = _call(parsed[0]) if parsed and not body[parsed[1]:].strip() else None
        if call is None:
            return None
        calls.append(call)
        content.append(text[last : match.start()])
        last = match.end()
    content.append(text[last:])
    return "".join(content).strip(), calls


_FENCED = re.compile(r"\s*```(?:json|xml)?\n(.*)```\s*", re.DOTALL)


def _bare_calls(text: str) -> Parsed | None:
    """An answer that is nothing but call objects without their tags (`{"name": …, "arguments": …}`, as
    Qwen2.5-Coder writes them), bare or in one ```json block: calls, as llama.cpp's Hermes parser reads them (its
    opening tag is optional, and so is a code block around the call)."""
    fenced = _FENCED.fullmatch(text)
    calls, rest = [], fenced.group(1) if fenced else text
    while rest.strip():
        parsed = _object(rest)
        # Untagged, an object is a call only with both keys: {"name": "Bob"} alone may be a JSON answer.
        call = _call(parsed[0]) if parsed and isinstance(parsed[0], dict) and "arguments" in parsed[0] else None
        if call is None:
            return None
        calls.append(call)
        rest = rest[parsed[1]:]
    return ("", calls) if calls else None


def parse_llama3_json(text: str) -> Parsed | None:
    body = text.strip().removeprefix("<|python_tag|>")
    parsed = _object(body)
    if parsed is None or body[parsed[1]:].strip():
        return None
    value = parsed[0]
    call = _call(value, "parameters" if isinstance(value, dict) and "parameters" in value else "arguments")
    return ("", [call]) if call else None


def parse_mistral(text: str) -> Parsed | None:
    at = text.find("[TOOL_CALLS]")
    if at < 0:
        return None
    rest = text[at + len("[TOOL_CALLS]") :]
    parsed = _object(rest)
    if parsed is None:
        return None
    values = parsed[0] if isinstance(parsed[0], list) else [parsed[0]]
    calls = [_call(value) for value in values]
    if not calls or None in calls:
        return None
    return (text[:at] + rest[parsed[1] :]).strip(), calls


@dataclass(frozen=True)
class _Family:
    parse: Callable[[str], Parsed | None]
    openings: tuple[str, ...]  # text that begins the calls in an answer
    at_start_only: bool  # the calls are the whole answer (no content before them)
    id_chars: int  # length of the random part of a call id
    start_openings: tuple[str, ...] = ()  # text that begins calls only at the answer's start (hermes: bare objects)


FAMILIES = {
    "hermes": _Family(parse_hermes, ("<tool_call>",), False, 24, ("{", "```json\n", "```xml\n", "```\n{")),
    "llama3_json": _Family(parse_llama3_json, ("{", "<|python_tag|>"), True, 24),
    # Mistral-Nemo's template requires ids of exactly 9 letters and digits (the whole id, no prefix).
    "mistral": _Family(parse_mistral, ("[TOOL_CALLS]",), False, 9),
}


# ---- a template's syntax ---------------------------------------------------------------------------------------

_PROBE_NAME, _PROBE_ARGUMENTS = "probe_function", {"probe_argument": "probe value"}
_PROBE_TOOL = {"type": "function", "function": {
    "name": _PROBE_NAME, "description": "a probe",
    "parameters": {"type": "object", "properties": {"probe_argument": {"type": "string"}}},
}}
_PROBE_CALL = {"type": "function", "id": "probe0001", "function": {"name": _PROBE_NAME, "arguments": _PROBE_ARGUMENTS}}


@dataclass(frozen=True)
class ToolSyntax:
    """How one template writes tool calls, and the text an answer with calls starts with (from its own render)."""

    family: str
    call_opening: str  # the answer up to and including the calls' opening, e.g. "<tool_call>"
    named_opening: tuple[str, str] | None  # the answer up to the arguments: (before the name, after it); None: the
    # template writes the arguments before the name, so a named call cannot be started by a prefix

    @property
    def openings(self) -> tuple[str, ...]:
        return FAMILIES[self.family].openings

    @property
    def at_start_only(self) -> bool:
        return FAMILIES[self.family].at_start_only

    @property
    def start_openings(self) -> tuple[str, ...]:
        return FAMILIES[self.family].start_openings

    def parse(self, text: str) -> tuple[str, list[ToolCall]] | None:
        """(content, calls) of a whole answer; None when it holds no well-formed call (it is all content)."""
        parsed = FAMILIES[self.family].parse(text)
        if parsed is None:
            return None
        content, calls = parsed
        return content, [ToolCall(self.new_id(), name, arguments) for name, arguments in calls]

    def new_id(self) -> str:
        alphabet = string.ascii_letters + string.digits
        random_part = "".join(secrets.choice(alphabet) for _ in range(FAMILIES[self.family].id_chars))
        return random_part if self.family == "mistral" else f"call_{random_part}"

    def prefill(self, function: str | None) -> str | None:
        """The answer's start that makes it a call (of `function` when named); None when that cannot be written."""
        if function is None:
            return self.call_opening
        if self.named_opening is None:
            return None
        before, after = self.named_opening
        return before + function + after


def tool_syntax(template: Template, bos_token: str = "", eos_token: str = "") -> ToolSyntax | None:
    """The template's tool-call syntax, read from a probe render; None when it renders no tools or no known calls."""
    user = [{"role": "user", "content": "PROBE"}]
    try:
        prompt = template.prompt(user, [_PROBE_TOOL], bos_token=bos_token, eos_token=eos_token)
        if prompt == template.prompt(user, None, bos_token=bos_token, eos_token=eos_token):
            return None  # the template does not show the model its tools
        answered = [*user, {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]}]
        full = template.render(answered, [_PROBE_TOOL], bos_token=bos_token, eos_token=eos_token)
    except TemplateError:
        return None
    if not full.startswith(prompt):
        return None
    turn = full[len(prompt) :]
    for word in (*template.stop_words, eos_token):  # the end-of-turn is not part of the answer
        if word and word in turn:
            turn = turn[: turn.index(word)]
    candidates = [BUILTIN_FAMILIES[template.name]] if template.name in BUILTIN_FAMILIES else list(FAMILIES)
    for family in candidates:
        parsed = FAMILIES[family].parse(turn)
        openings = [o for o in FAMILIES[family].openings if o in turn]
        if parsed is None or parsed[1] != [(_PROBE_NAME, _PROBE_ARGUMENTS)] or not openings:
            continue  # (a template writing bare objects is llama3_json's, not hermes's untagged form)
        at, opening = min((turn.find(o), o) for o in openings)
        name_at = turn.find(f'"{_PROBE_NAME}"') + 1
        arguments_at = turn.find(json.dumps(_PROBE_ARGUMENTS, ensure_ascii=False))
        named = None
        if 0 < name_at < arguments_at:  # the name first: a prefix can start a call of a given function
            named = (turn[:name_at], turn[name_at + len(_PROBE_NAME) : arguments_at])
        return ToolSyntax(family, turn[: at + len(opening)], named)
    return None


# ---- streaming ---------------------------------------------------------------------------------------------------


class ToolCallStream:
    """Splits an answer, piece by piece, into content to stream now and the tool calls it ends with.

    Content before the first call opening streams as it comes, except what could still be the start of an
    opening and trailing whitespace (the whitespace before a call is not content). From the opening on,
    the text is held: at the end it is parsed into calls, or given out as content when it holds none
    (e.g. the answer was cut by max_tokens inside a call).
    """

    def __init__(self, syntax: ToolSyntax):
        self.syntax = syntax
        self.pending = ""  # not yet given out
        self.held: str | None = None  # from the opening on
        self.decided = False  # at_start_only: the answer's start ruled the calls out

    def feed(self, piece: str) -> str:
        if self.held is not None:
            self.held += piece
            return ""
        self.pending += piece
        if self.syntax.start_openings and not self.decided:  # a bare call can only be the whole answer
            start = self.pending.lstrip()
            if not start:
                return ""
            if start.startswith(self.syntax.start_openings):
                self.held, self.pending = self.pending, ""
                return ""
            if any(opening.startswith(start) for opening in self.syntax.start_openings):
                return ""  # undecided yet: "``" may become "```json"
            self.decided = True
        if self.syntax.at_start_only:
            if not self.decided:
                start = self.pending.lstrip()
                if any(start.startswith(o) for o in self.syntax.openings):
                    self.held, self.pending = self.pending, ""
                    return ""
                if not start or any(o.startswith(start) for o in self.syntax.openings):
                    return ""  # undecided yet
                self.decided = True
            out, self.pending = self.pending, ""
            return out
        found = [(self.pending.find(o), o) for o in self.syntax.openings if o in self.pending]
        if found:
            at = min(found)[0]
            out, self.held, self.pending = self.pending[:at], self.pending[at:], ""
            return out.rstrip()
        keep = max((_partial(self.pending, o) for o in self.syntax.openings), default=0)
        body = self.pending[: len(self.pending) - keep]
        out = body.rstrip()
        self.pending = self.pending[len(out) :]
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The content still to give out, and the calls (none when the held text is not well-formed calls)."""
        if self.held is None:
            return self.pending, []
        parsed = self.syntax.parse(self.held)
        if parsed is None or not parsed[1]:
            return self.pending + self.held, []
        return parsed[0], parsed[1]


def _partial(text: str, opening: str) -> int:
    """Length of the longest end of `text` that is a proper start of `opening`."""
    for n in range(min(len(opening) - 1, len(text)), 0, -1):
        if text.endswith(opening[:n]):
            return n
    return 0
