"""Dataset formats (alpaca, sharegpt, openai) → one canonical conversation row.

Canonical row (what templates and encoders read):
    messages: [{"role", "content", "tool_calls", "tool_call_id", "reasoning"}, ...]
              role is "user", "assistant" or "tool" (and "system" for one case, below). Prompt turns (a user
              turn, or the results of one call turn) alternate with assistant answers, ending with an
              assistant turn for supervised data (ranking data ends with the prompt; its answers are in
              chosen/rejected).
              content: str, or None for an assistant turn that only calls tools and whose source wrote no
              content (openai `content: null`, every sharegpt function_call turn): DeepSeek-R1's template
              writes the calls only for None. An empty answer ("") is kept: it trains the end-of-turn.
              tool_calls: "" or a JSON list of {"type": "function", "function": {"name", "arguments"}, ["id"]}
              (a string column: Arrow cannot type arbitrary JSON); arguments: an object without null-valued keys,
              or the JSON text the dataset wrote, as written (``_arguments``); tool_call_id: "" or the id a tool
              result answers; reasoning: "" or the answer's reasoning (reasoning_content / reasoning fields,
              an alpaca `reasoning` column), rendered where the template has a place for it.
              An explicitly empty system turn stays in messages as {"role": "system", "content": ""} (first):
              templates render it unlike no system turn (Qwen2.5 writes its default prompt only without one).
    system:   str, the system prompt ("" when none; an alpaca/column value "" means none)
    tools:    str ("" when none; a JSON list of tool schemas)
    chosen / rejected: str ("" unless the dataset is a ranking set; then either may be "": an empty answer)
    kto_tag:  bool, only for datasets that map a kto_tag column (stage kto: is the last answer desirable?)
    images:   only in vision runs: the row's images as {"bytes", "path"} dicts (an `images` column, or openai
              image / image_url content parts, which become <image> placeholders in the text), each opened once
              here to check it; one <image> per image in the prompt turns (data/vision.py encodes them)

sharegpt function_call turns become assistant turns with tool_calls, observation turns become tool
turns; openai rows keep their assistant tool_calls and tool messages. ``template_messages`` turns a
canonical row back into the message dicts a chat template reads, in the shapes that template handles
(``message_conventions``: None content and JSON-text arguments for DeepSeek, objects for Llama-3.1);
``template_shapes`` gives chat messages (tunelab api and chat) the same shapes.

This module owns the column and role mapping; it knows nothing of tokens. Text fields must hold text: a
list, object or boolean there is a structural fault (it would train as its JSON); a number is taken as its
text and counted (`numbers_as_text`); a null user/tool/system turn is a fault (a null answer always was).
Rows that are structurally wrong raise a RowError naming the dataset, row, file and line, and why; with skip_bad_rows they are left out instead,
counted per reason (``ConversionStats``). Ranking rows whose two answers are identical teach nothing
(every pair loss is constant) and are always dropped and counted.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets
import pyarrow as pa
import pyarrow.compute as pc

from tunelab.data.dataset_files import RowLocator, describe_files, resolve_files
from tunelab.data.images import ImageSource, as_storage, part_image
from tunelab.data.registry import IMAGE_COLUMN, UNSUPPORTED_MEDIA_COLUMNS, DatasetSpec
from tunelab.errors import DataError, TemplateError

if TYPE_CHECKING:
    from tunelab.data.templates import Template

CANONICAL_COLUMNS = ("messages", "system", "tools", "chosen", "rejected")

_STRING = datasets.Value("string")
# A fixed schema, so canonical sets from any format (with or without tools) concatenate and interleave.
CANONICAL_FEATURES = datasets.Features({
    "messages": [{
        "role": _STRING, "content": _STRING, "tool_calls": _STRING, "tool_call_id": _STRING, "reasoning": _STRING,
    }],
    "system": _STRING, "tools": _STRING, "chosen": _STRING, "rejected": _STRING,
})
# Vision runs: the canonical rows carry their images (data/vision.py), in the storage form of datasets' Image
# feature: bytes (data URIs, PIL images, bytes given) or an absolute path (files, read when encoding).
IMAGE_FEATURE = {"bytes": datasets.Value("binary"), "path": _STRING}
IMAGES_FEATURE = [IMAGE_FEATURE]
IMAGE_PLACEHOLDER = "<image>"  # LlamaFactory's: one per image, in order, in the prompt turns
# Per converted row while converting: why it was left out ("" when kept), the one-line message, how many of
# its text values were numbers (taken as their text, counted) and how many null argument keys it lost (_arguments).
_DROP_COLUMNS = {"drop_reason": _STRING, "drop_message": _STRING, "numbers_as_text": datasets.Value("int32"),
                 "null_arguments": datasets.Value("int32")}

ALPACA_COLUMNS = {
    "prompt": "instruction", "query": "input", "response": "output", "history": None, "system": None,
    "tools": None, "chosen": "chosen", "rejected": "rejected", "reasoning": None,
}
SHAREGPT_COLUMNS = {
    "messages": "conversations", "system": None, "tools": "tools", "chosen": "chosen", "rejected": "rejected",
}
SHAREGPT_TAGS = {
    "role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
    "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system",
}
OPENAI_COLUMNS = {**SHAREGPT_COLUMNS, "messages": "messages"}
OPENAI_TAGS = {
    "role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant",
    "observation_tag": "tool", "function_tag": "function_call", "system_tag": "system",
}
# Turn fields that hold an answer's reasoning (OpenAI-compatible APIs, DeepSeek, vLLM), first one set wins.
REASONING_KEYS = ("reasoning_content", "reasoning")
IDENTICAL_PAIR = "identical_pair"  # drop reason of ranking rows whose chosen and rejected answers are the same


class RowError(DataError):
    """A structurally wrong row. ``reason`` is a short name for the kind of fault: skip_bad_rows counts
    skipped rows per reason."""

    def __init__(self, message: str, reason: str = "bad_row"):
        super().__init__(message)
        self.reason = reason


@dataclass
class ConversionStats:
    """What converting one dataset did, for data_report.json and the log."""

    rows: int = 0  # rows converted (read)
    dropped: dict[str, int] = field(default_factory=dict)  # rows left out, per reason
    first: dict[str, str] = field(default_factory=dict)  # the first left-out row's message, per reason
    empty_answers: int = 0  # kept rows with an empty answer (they train the end-of-turn only)
    with_reasoning: int = 0  # kept rows where some assistant turn carries reasoning
    numbers_as_text: int = 0  # values of text fields that were numbers, trained as their text (kept rows)
    null_arguments: int = 0  # null-valued keys dropped from call arguments given as objects (kept rows; _arguments)

    @property
    def total_dropped(self) -> int:
        return sum(self.dropped.values())


def _text(value: Any) -> str:
    """JSON fields kept as text (tools): a list or object becomes its JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


_KINDS = {list: "a list", dict: "a JSON object", bool: "a boolean"}


class _Where:
    """Where a row is, for messages: "dataset 'name' row i (file:line)", the file part looked up only when a
    message is written (formats the first time an error names a row, never for rows that convert)."""

    def __init__(self, converter: RowConverter, index: int, suffix: str = ""):
        self.converter, self.index, self.suffix = converter, index, suffix

    def turn(self, number: int) -> _Where:
        return _Where(self.converter, self.index, f"{self.suffix} turn {number}")

    def part(self, name: str) -> _Where:
        return _Where(self.converter, self.index, f"{self.suffix} {name}")

    def __str__(self) -> str:
        location = self.converter.locate(self.index)
        place = f" ({location})" if location else ""
        return f"dataset '{self.converter.spec.name}' row {self.index}{place}{self.suffix}"

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


def _message(
    role: str, content: str | None, tool_calls: str = "", tool_call_id: str = "", reasoning: str = ""
) -> dict[str, str | None]:
    return {"role": role, "content": content, "tool_calls": tool_calls, "tool_call_id": tool_call_id,
            "reasoning": reasoning}


def _tool_calls(value: Any, where: str) -> tuple[str, int]:
    """Calls as sharegpt ({"name", "arguments"} or a list, maybe JSON text) or openai writes them → canonical JSON,
    and how many null-valued argument keys were dropped (``_arguments``)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise RowError(f"{where}: the function call is not valid JSON ({exc.msg}); write it as "
                           '{"name": ..., "arguments": {...}} or a list of those', "bad_tool_call") from None
    calls, dropped = [], 0
    for call in value if isinstance(value, list) else [value]:
        function = call.get("function", call) if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise RowError(f"{where}: a function call needs a name; write it as "
                           '{"name": ..., "arguments": {...}}', "bad_tool_call")
        arguments, nulls = _arguments(function.get("arguments"), name, where)
        dropped += nulls
        canonical: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
        if isinstance(call, dict) and call.get("id"):
            canonical["id"] = str(call["id"])
        calls.append(canonical)
    return (json.dumps(calls, ensure_ascii=False) if calls else ""), dropped


def _arguments(value: Any, name: str, where: str) -> tuple[dict[str, Any] | str, int]:
    """One call's arguments as the dataset gives them, and how many null-valued keys were dropped.

    JSON text (how the OpenAI API and most tool datasets write them) stays the text as written, checked to hold
    an object: a template that writes text arguments as given trains exactly that text (``template_calls``).
    An object loses its null-valued keys, at any depth: a parquet or arrow file types the column as one struct
    with the keys of every call, so each call read from it holds every other call's keys as null (the file cannot
    tell those from a null the dataset wrote). JSON-lines objects lose them too, so both files of the same rows
    train the same ids; a dataset that means a null writes those arguments as JSON text.
    """
    if value is None or value == "":
        return {}, 0
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            raise RowError(f"{where}: the arguments of function call '{name}' must be a JSON object", "bad_tool_call")
        return value, 0
    if not isinstance(value, dict):
        raise RowError(f"{where}: the arguments of function call '{name}' must be a JSON object", "bad_tool_call")
    return _without_nulls(value)


def _without_nulls(value: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """`value` less its null-valued keys, in nested objects too (lists keep their nulls: Arrow adds none there)."""
    kept, dropped = {}, 0
    for key, item in value.items():
        if item is None:
            dropped += 1
            continue
        kept[key], nested = _nested_without_nulls(item)
        dropped += nested
    return kept, dropped


def _nested_without_nulls(value: Any) -> tuple[Any, int]:
    if isinstance(value, dict):
        return _without_nulls(value)
    if isinstance(value, list):
        items = [_nested_without_nulls(item) for item in value]
        return [item for item, _ in items], sum(count for _, count in items)
    return value, 0


# --- canonical row → the messages a chat template reads ---------------------------------------


@dataclass(frozen=True)
class MessageConventions:
    """Message shapes a template needs that differ from the usual ones (content "" and arguments as given).

    null_content: a call turn without text must have content None (DeepSeek's templates write the calls only then,
    so "" beside calls becomes None too; a template without tool calls writes None as the text "None", as
    Llama-3's does, so it gets "").
    string_arguments: call arguments must be JSON text (DeepSeek's templates concatenate them as strings).
    object_arguments: call arguments must be objects (Llama-3.1, Qwen2.5, Mistral and the Hermes default write
    JSON-text arguments encoded once more, as a JSON string): text given is parsed, as llama.cpp does for such
    templates. With neither, arguments reach the template as the dataset gave them (Qwen3 writes text as given).
    """

    null_content: bool = False
    string_arguments: bool = False
    object_arguments: bool = False


_PROBE_NAME = "tunelab_probe_call"
_PROBE_CALL = {"type": "function", "function": {"name": _PROBE_NAME, "arguments": {"x": 1}}, "id": "call00001"}
_PROBE_TEXT = '{"x":1}'  # JSON text of the probe's arguments that no template's tojson writes (no space)


@lru_cache(maxsize=32)
def message_conventions(template: Template) -> MessageConventions:
    """Probe how `template` renders a call-only turn: JSON-text arguments only where the template renders
    nothing else, None content only where None is what makes it write the call ("" does not), objects only where
    it does not write JSON-text arguments as given."""

    def render(content: str | None, arguments: Any) -> str | None:
        call = {**_PROBE_CALL, "function": {**_PROBE_CALL["function"], "arguments": arguments}}
        messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": content, "tool_calls": [call]}]
        try:
            return template.render(messages)
        except TemplateError:
            return None

    for string_arguments, arguments in ((False, _PROBE_CALL["function"]["arguments"]), (True, _PROBE_TEXT)):
        with_none = render(None, arguments)
        if with_none is not None:
            null_content = _PROBE_NAME in with_none and _PROBE_NAME not in (render("", arguments) or "")
            as_given = render(None if null_content else "", _PROBE_TEXT) or ""
            return MessageConventions(null_content, string_arguments, _PROBE_TEXT not in as_given)
    text_only = render("", _PROBE_CALL["function"]["arguments"]) is None and render("", _PROBE_TEXT) is not None
    return MessageConventions(False, text_only, not text_only and _PROBE_TEXT not in (render("", _PROBE_TEXT) or ""))


_PROBE_REASONING = "\ue003"  # private-use: no template writes it on its own


@lru_cache(maxsize=32)
def renders_reasoning(template: Template) -> bool:
    """Whether `template` writes an answer's ``reasoning_content`` when that answer ends the conversation."""
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": "a", "reasoning_content": _PROBE_REASONING}]
    try:
        return _PROBE_REASONING in template.render(messages)
    except TemplateError:
        return False


@lru_cache(maxsize=32)
def renders_tool_turns(template: Template) -> bool:
    """Whether `template` renders a call turn followed by its result and an answer without refusing them."""
    content, calls = template_call_turn(None, [_PROBE_CALL], message_conventions(template))
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": content, "tool_calls": calls},
                {"role": "tool", "content": "r", "tool_call_id": _PROBE_CALL["id"]},
                {"role": "assistant", "content": "a"}]
    try:
        template.render(messages)
    except TemplateError:
        return False
    return True


def template_call_turn(
    content: str | None, calls: list[dict[str, Any]] | None, conventions: MessageConventions
) -> tuple[str | None, list[dict[str, Any]] | None]:
    """An assistant turn's (content, calls) in the shapes a template with `conventions` renders as meant: the one
    rule training (``template_messages``), ``tunelab api`` and ``tunelab chat`` (``template_shapes``) share.

    content: None, or "" beside calls, is None for a template that writes calls only then (an empty text beside
    calls is no text, as OpenAI's API and llama.cpp read it), else "". arguments: as given (JSON text stays the
    text), except text parsed for a template that needs objects and objects written as JSON text for one that
    needs text (``MessageConventions``).
    """
    if calls and conventions.null_content and not content:
        content = None
    elif content is None:
        content = ""
    if not calls:
        return content, calls

    def shaped(arguments: Any) -> Any:
        if isinstance(arguments, str) and conventions.object_arguments:
            return json.loads(arguments) if arguments.strip() else {}
        if not isinstance(arguments, str) and conventions.string_arguments:
            return json.dumps(arguments, ensure_ascii=False)
        return arguments

    return content, [{**call, "function": {**call["function"], "arguments": shaped(call["function"]["arguments"])}}
                     for call in calls]


def template_shapes(messages: list[dict[str, Any]], template: Template) -> list[dict[str, Any]]:
    """Chat messages (OpenAI's shape: arguments as JSON text, content maybe None) with their assistant turns in
    the shapes `template` renders as training rendered them (``template_call_turn``)."""
    conventions = message_conventions(template)
    out = []
    for message in messages:
        if message.get("role") == "assistant" and (message.get("tool_calls") or message.get("content") is None):
            content, calls = template_call_turn(message.get("content"), message.get("tool_calls"), conventions)
            message = {**message, "content": content, **({"tool_calls": calls} if calls else {})}
        out.append(message)
    return out


def template_messages(row: dict, template: Template | None = None) -> list[dict[str, Any]]:
    """A canonical row as the messages a chat template reads: system first, tool calls decoded, reasoning as
    ``reasoning_content`` (the field Qwen3's template reads). With `template`, call turns take the shapes it
    handles (``template_call_turn``); without, content None becomes "" (what every template accepts).

    Keys a template tests for presence (Llama-3.1 checks ``'tool_calls' in message``) are set only when used.
    """
    conventions = message_conventions(template) if template is not None else MessageConventions()
    messages: list[dict[str, Any]] = [{"role": "system", "content": row["system"]}] if row.get("system") else []
    for m in row["messages"]:
        content, calls = template_call_turn(m["content"], json.loads(m["tool_calls"]) if m.get("tool_calls") else None,
                                            conventions)
        message: dict[str, Any] = {"role": m["role"], "content": content}
        if calls:
            message["tool_calls"] = calls
        if m.get("tool_call_id"):
            message["tool_call_id"] = m["tool_call_id"]
        if m.get("reasoning"):
            message["reasoning_content"] = m["reasoning"]
        messages.append(message)
    return messages


def is_ranking_row(row: dict) -> bool:
    """A ranking row holds two answers; identical ones (both empty included) never survive conversion."""
    return bool(row.get("chosen") or row.get("rejected"))


def prompt_and_reference(row: dict, template: Template | None = None) -> tuple[list[dict[str, Any]], str]:
    """A canonical row as the template messages of its prompt and its reference answer: a ranking row's chosen
    answer, else its last assistant turn ("" when the row ends with another role)."""
    messages = template_messages(row, template)
    if is_ranking_row(row):
        return messages, row["chosen"]
    if messages and messages[-1]["role"] == "assistant":
        return messages[:-1], messages[-1]["content"] or ""
    return messages, ""


# --- source rows → canonical rows --------------------------------------------------------------


def _reasoning(turn: dict, where: str) -> str:
    for key in REASONING_KEYS:
        value = turn.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise RowError(f"{where}: {key} must be text, got {type(value).__name__}", "bad_reasoning")
            return value
    return ""


class RowConverter:
    """Row converter for one dataset spec (a class so datasets.map can pickle it).

    `skip_bad_rows`: a structurally wrong row is left out (its reason and message in the drop columns)
    instead of raising. `files`: where the rows come from, for messages that name a row's file and line
    (a stream of some of the spec's files). `row_check`: a further check of each converted row (picklable), returning None or
    (reason, why) for a row to treat as structurally wrong (the pipeline checks that reasoning is trained).
    """

    def __init__(
        self, spec: DatasetSpec, column_names: list[str], skip_bad_rows: bool = False,
        row_check: Callable[[dict], tuple[str, str] | None] | None = None, files: list[Path] | None = None,
        images: bool = False,
    ):
        self.spec = spec
        self.images = images
        self.image_column = spec.columns.get(IMAGE_COLUMN, IMAGE_COLUMN)
        if IMAGE_COLUMN in spec.columns and not images:
            raise DataError(text_only_refusal(spec, f" maps columns.{IMAGE_COLUMN}", "remove columns.images"))
        self.files = files  # the files the rows come from, in order (default: all of the spec's)
        self.skip_bad_rows = skip_bad_rows
        self.row_check = row_check
        defaults = ALPACA_COLUMNS if spec.formatting == "alpaca" else (
            SHAREGPT_COLUMNS if spec.formatting == "sharegpt" else OPENAI_COLUMNS
        )
        self.columns = {**defaults, **spec.columns}
        tag_defaults = OPENAI_TAGS if spec.formatting == "openai" else SHAREGPT_TAGS
        self.tags = {**tag_defaults, **spec.tags}
        required = ["chosen", "rejected"] if spec.ranking else []
        required += ["prompt"] if spec.formatting == "alpaca" else ["messages"]
        if spec.formatting == "alpaca" and not spec.ranking:
            required.append("response")
        if "kto_tag" in spec.columns:
            required.append("kto_tag")
        if "reasoning" in spec.columns:
            if spec.formatting != "alpaca" or spec.ranking:
                raise DataError(
                    f"dataset '{spec.name}': columns.reasoning applies to alpaca supervised rows (the reasoning of "
                    "the answer); sharegpt/openai turns carry it as reasoning_content or reasoning: remove it"
                )
            required.append("reasoning")
        for key in required:
            column = self.columns.get(key)
            if column not in column_names:
                files = describe_files(spec)
                raise DataError(
                    f"dataset '{spec.name}'{f' ({files})' if files else ''}: column '{column}' (mapped as {key}) is "
                    f"missing; the file has {', '.join(column_names)} — set columns.{key} in dataset_info.json"
                )
        # Optional columns that are mapped by default but absent simply stay empty.
        self.present = {k: v for k, v in self.columns.items() if v in column_names}
        self.output_columns = [*CANONICAL_COLUMNS, *(["kto_tag"] if "kto_tag" in self.present else []),
                               *([IMAGE_COLUMN] if images else [])]
        self._part_images: list[Any] = []  # images of the row's openai content parts, in order
        self._locator: RowLocator | None = None
        self._numbers = 0  # values of the row being converted that were numbers taken as text
        self._nulls = 0  # null-valued argument keys the row's calls lost (_arguments)

    def locate(self, index: int) -> str | None:
        """Where row `index` is in its file(s) ("file:line"), or None for generated rows."""
        if not (self.files or self.spec.file_name or self.spec.hf_hub_url):  # generated (or in-memory) rows
            return None
        if self._locator is None:
            self._locator = RowLocator(self.files or resolve_files(self.spec))
        return self._locator(index)

    def _as_text(self, value: Any, where: _Where | str, what: str) -> str:
        """A text field's value: text as it is, null as "", a number as its text (counted); a list, object or
        boolean is refused (it would train as its JSON)."""
        if value is None:
            return ""
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            self._numbers += 1
            return json.dumps(value)
        shown = json.dumps(value, ensure_ascii=False, default=str)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        kind = _KINDS.get(type(value), f"a {type(value).__name__}")
        raise RowError(f"{where}: {what} holds {kind}, not text ({shown}); write the text itself", "not_text")

    def _calls(self, value: Any, where: _Where) -> str:
        calls, nulls = _tool_calls(value, where)
        self._nulls += nulls
        return calls

    def _get(self, row: dict, key: str) -> Any:
        column = self.present.get(key)
        return row.get(column) if column else None

    def __call__(self, row: dict, index: int) -> dict:
        """One row converted (raises RowError when it is structurally wrong)."""
        where = _Where(self, index)
        self._numbers = self._nulls = 0
        self._part_images = []
        if self.spec.formatting == "alpaca":
            messages = self._alpaca_messages(row, where)
            system = self._as_text(self._get(row, "system"), where, f"column '{self.columns['system']}'")
        else:
            messages, system = self._sharegpt_messages(row, where)
        out = {"messages": messages, "system": system, "tools": _text(self._get(row, "tools")),
               "chosen": "", "rejected": ""}
        if "kto_tag" in self.present:
            out["kto_tag"] = bool(self._get(row, "kto_tag"))
        if self.images:
            out[IMAGE_COLUMN] = self._row_images(row, out, where)
        if self.spec.ranking:
            out["chosen"], out["rejected"] = self._pair(row, where)
            if messages and messages[-1]["role"] == "assistant":
                raise RowError(f"{where}: a ranking row must end with the prompt, not an assistant turn",
                               "ranking_ends_with_answer")
        problem = self.row_check(out) if self.row_check is not None else None
        if problem is not None:
            raise RowError(f"{where}: {problem[1]}", problem[0])
        return out

    def _row_images(self, row: dict, out: dict, where: _Where) -> list[dict]:
        """The row's images (column, or openai content parts) opened once to check them, as storage dicts; one
        <image> placeholder per image, in the prompt turns (the processor puts each image's tokens there)."""
        given = row.get(self.image_column)
        if given is not None and not isinstance(given, (list, tuple)):
            given = [given]
        if given and self._part_images:
            raise RowError(f"{where}: images come both from the '{self.image_column}' column and from content parts; "
                           "give them one way", "images_twice")
        refs = list(given or self._part_images)
        texts = [out["system"], *(m["content"] or "" for m in out["messages"] if m["role"] != "assistant")]
        placeholders = sum(text.count(IMAGE_PLACEHOLDER) for text in texts)
        answers = sum((m["content"] or "").count(IMAGE_PLACEHOLDER) for m in out["messages"] if m["role"] == "assistant")
        answers += out["chosen"].count(IMAGE_PLACEHOLDER) + out["rejected"].count(IMAGE_PLACEHOLDER)
        if answers:
            raise RowError(f"{where}: an answer holds {IMAGE_PLACEHOLDER}; images go in the prompt (user or system "
                           "turns): move the placeholder", "image_in_answer")
        if placeholders != len(refs):
            raise RowError(
                f"{where}: {placeholders} {IMAGE_PLACEHOLDER} placeholders for {len(refs)} images; write one "
                f"{IMAGE_PLACEHOLDER} per image, in the order of the images", "placeholders_images_mismatch",
            )
        source = ImageSource(str(where))
        try:
            return [as_storage(ref, self.spec.root or None, source) for ref in refs]
        except DataError as exc:  # a missing / unreadable image: a bad row (skip_bad_rows skips and counts it)
            raise RowError(str(exc), "bad_image") from None

    def _content(self, content: Any, where: _Where) -> Any:
        """openai content parts ([{"type": "text", ...}, {"type": "image" | "image_url", ...}]) → text with an
        <image> placeholder per image (the images kept in order); anything else as it is."""
        if not (isinstance(content, list) and all(isinstance(p, dict) and "type" in p for p in content)):
            return content
        if not self.images and all(p["type"] == "text" for p in content):
            return content  # text-only runs keep refusing lists as text (as before images were supported)
        texts = []
        for part in content:
            kind = part["type"]
            if kind == "text":
                texts.append(self._as_text(part.get("text"), where, "a text part"))
            elif kind in ("image", "image_url"):
                if not self.images:
                    raise DataError(text_only_refusal(self.spec, " has image content parts", "remove them"))
                self._part_images.append(part_image(part))
                texts.append(IMAGE_PLACEHOLDER)
            else:
                raise RowError(f"{where}: content part type '{kind}' is not text, image or image_url; remove it",
                               "unsupported_content_part")
        return "".join(texts)

    def _converted(self, row: dict, index: int) -> dict:
        """The row converted, with its drop columns: why it is left out ("" when kept) and the message."""
        try:
            out = self(row, index)
        except RowError as exc:
            if not self.skip_bad_rows:
                raise DataError(f"{exc}; or set skip_bad_rows: true to skip such rows (counted per reason)") from None
            return {**_EMPTY_ROW, **({"kto_tag": False} if "kto_tag" in self.present else {}),
                    **({IMAGE_COLUMN: []} if self.images else {}),
                    "drop_reason": exc.reason, "drop_message": str(exc), "numbers_as_text": 0, "null_arguments": 0}
        numbers = {"numbers_as_text": self._numbers, "null_arguments": self._nulls}
        if self.spec.ranking and out["chosen"] == out["rejected"]:
            message = f"{_Where(self, index)}: chosen and rejected are the same answer"
            return {**out, "drop_reason": IDENTICAL_PAIR, "drop_message": message, **numbers}
        return {**out, "drop_reason": "", "drop_message": "", **numbers}

    def convert_batch(self, batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        """Batched datasets.map function: the converted rows with their drop columns. One pass over plain
        dicts, instead of datasets' lazy per-row views."""
        columns = list(batch)  # datasets' lazy batch: read each column once, not once per row
        values = zip(*(batch[c] for c in columns))
        rows = [self._converted(dict(zip(columns, row)), index) for row, index in zip(values, indices)]
        return {key: [row[key] for row in rows] for key in [*self.output_columns, *_DROP_COLUMNS]}

    def _answer(self, value: Any, where: _Where, what: str) -> str:
        if value is None:
            raise RowError(f"{where}: the answer is missing (null); write \"\" for an empty answer", "missing_answer")
        return self._as_text(value, where, what)

    def _alpaca_messages(self, row: dict, where: _Where) -> list[dict]:
        messages = []
        history = self.columns["history"]
        for number, turn in enumerate(self._get(row, "history") or []):
            if not (isinstance(turn, (list, tuple)) and len(turn) == 2):
                raise RowError(f"{where}: history must be a list of [query, response] pairs", "bad_history")
            messages += [_message("user", self._as_text(turn[0], where, f"column '{history}' pair {number} query")),
                         _message("assistant", self._as_text(turn[1], where, f"column '{history}' pair {number} response"))]
        prompt = self._as_text(self._get(row, "prompt"), where, f"column '{self.columns['prompt']}'")
        query = self._as_text(self._get(row, "query"), where, f"column '{self.columns['query']}'")
        content = f"{prompt}\n{query}" if prompt and query else (prompt or query)
        if not content:
            raise RowError(
                f"{where}: empty prompt (columns {self.columns['prompt']}/{self.columns['query']})", "empty_prompt"
            )
        messages.append(_message("user", content))
        if not self.spec.ranking:
            reasoning = self._get(row, "reasoning")
            if reasoning is not None and not isinstance(reasoning, str):
                raise RowError(f"{where}: the reasoning column holds {type(reasoning).__name__}, not text",
                               "bad_reasoning")
            messages.append(_message("assistant", self._answer(self._get(row, "response"), where,
                                                               f"column '{self.columns['response']}'"),
                                     reasoning=reasoning or ""))
        return messages

    def _sharegpt_messages(self, row: dict, where: _Where) -> tuple[list[dict], str]:
        tags = self.tags
        role_map = {
            tags["user_tag"]: "user", tags["assistant_tag"]: "assistant", tags["observation_tag"]: "tool",
            tags["function_tag"]: "function", tags["system_tag"]: "system",
        }
        raw = self._get(row, "messages")
        if not isinstance(raw, list) or not raw:
            raise RowError(f"{where}: '{self.columns['messages']}' must be a non-empty list of turns", "no_turns")
        system = self._as_text(self._get(row, "system"), where, f"column '{self.columns['system']}'")
        messages: list[dict] = []
        content_tag = tags["content_tag"]
        for turn_index, turn in enumerate(raw):
            role = role_map.get(turn.get(tags["role_tag"])) if isinstance(turn, dict) else None
            if role is None:
                raise RowError(
                    f"{where} turn {turn_index}: role {turn.get(tags['role_tag']) if isinstance(turn, dict) else turn!r} "
                    f"is not one of {', '.join(role_map)} (set tags in dataset_info.json)", "unknown_role",
                )
            turn_where = where.turn(turn_index)
            content = self._content(turn.get(content_tag), turn_where)
            if content is None and role in ("user", "tool", "system"):
                raise RowError(
                    f"{turn_where}: '{content_tag}' is missing (null); write the {role} turn's text", "missing_content"
                )
            if role == "system":
                if turn_index != 0:
                    raise RowError(f"{turn_where}: a system turn may only come first", "misplaced_system")
                system = self._as_text(content, turn_where, f"'{content_tag}'")
                if not system:  # explicitly empty: kept as a turn, templates render it unlike none
                    messages.append(_message("system", ""))
                continue
            reasoning = _reasoning(turn, turn_where)
            if reasoning and role not in ("assistant", "function"):
                raise RowError(
                    f"{turn_where}: a {role} turn has reasoning; only answers carry it", "misplaced_reasoning"
                )
            if role == "function":  # sharegpt: the turn's content is the call itself, the answer has no text
                messages.append(_message("assistant", None, self._calls(content, turn_where), reasoning=reasoning))
            elif role == "assistant" and turn.get("tool_calls"):  # openai: content (maybe null) plus calls
                text = content if content is None else self._as_text(content, turn_where, f"'{content_tag}'")
                messages.append(_message("assistant", text, self._calls(turn["tool_calls"], turn_where),
                                         reasoning=reasoning))
            elif role == "assistant":
                messages.append(_message("assistant", self._answer(content, turn_where, f"'{content_tag}'"),
                                         reasoning=reasoning))
            else:
                messages.append(_message(role, self._as_text(content, turn_where, f"'{content_tag}'"),
                                         tool_call_id=_text(turn.get("tool_call_id"))))
        _check_order(messages, where, ends_with_answer=not self.spec.ranking)
        return messages, system

    def _pair(self, row: dict, where: _Where) -> tuple[str, str]:
        pair = []
        for key in ("chosen", "rejected"):
            value = self._get(row, key)
            if isinstance(value, dict):  # sharegpt style {"from": "gpt", "value": "..."}
                extra = [k for k in ("tool_calls", *REASONING_KEYS) if value.get(k)]
                if extra:
                    raise RowError(
                        f"{where}: the {key} answer has {extra[0]}; ranking answers are text only here: "
                        f"remove {extra[0]} from chosen/rejected", "unsupported_ranking_answer",
                    )
                value = value.get(self.tags["content_tag"])
            pair.append(self._answer(value, where.part(key), f"the {key} answer"))
        return pair[0], pair[1]


_EMPTY_ROW = {"messages": [], "system": "", "tools": "", "chosen": "", "rejected": ""}


def _check_order(messages: list[dict], where: str, ends_with_answer: bool) -> None:
    """Prompt turns (a user turn, or the results of one call turn) and answers must alternate."""
    expect_answer = False
    for i, message in enumerate(messages):
        if message["role"] == "system":
            continue  # an explicitly empty system turn (only ever first)
        is_answer = message["role"] == "assistant"
        if message["role"] == "tool" and i and messages[i - 1]["role"] == "tool":
            continue  # several results of one turn's parallel calls
        if is_answer != expect_answer:
            expected = "an assistant" if expect_answer else "a user/tool"
            reason = "answer_first" if i == 0 or messages[i - 1]["role"] == "system" else "roles_out_of_order"
            raise RowError(
                f"{where}: turn {i} is {message['role']}, expected {expected} turn (roles must alternate)", reason
            )
        expect_answer = not expect_answer
    if ends_with_answer and (not messages or messages[-1]["role"] != "assistant"):
        raise RowError(f"{where}: the conversation must end with an assistant turn", "ends_without_answer")


def text_only_refusal(spec: DatasetSpec, what: str, fix: str) -> str:
    """The one line refusing images to a run whose model is text-only."""
    files = describe_files(spec)
    return (f"dataset '{spec.name}'{f' ({files})' if files else ''}{what}, but model_name_or_path is a text-only "
            f"model and would ignore the images: {fix}, or train a vision-language model (a folder with its processor)")


def _refuse_media(dataset: datasets.Dataset, spec: DatasetSpec, images: bool) -> None:
    """Rows that carry videos / audio (or images, for a text-only model) would train on their text alone: refuse."""
    image_column = spec.columns.get(IMAGE_COLUMN, IMAGE_COLUMN)
    for column in (*([] if images else [image_column]), *UNSUPPORTED_MEDIA_COLUMNS):
        if column in dataset.column_names:
            used = sum(1 for value in dataset[column] if value)
            if used and column == image_column:
                raise DataError(text_only_refusal(spec, f": {used} rows have {column}", f"remove the '{column}' field from the rows"))
            if used:
                files = describe_files(spec)
                raise DataError(
                    f"dataset '{spec.name}'{f' ({files})' if files else ''}: {used} rows have {column}, but tunelab "
                    f"trains text and image models and would ignore them: remove the '{column}' field from the rows"
                )


def _keep(reasons: list[str]) -> list[bool]:
    return [not reason for reason in reasons]


def to_canonical(
    dataset: datasets.Dataset, spec: DatasetSpec, num_proc: int | None = None, skip_bad_rows: bool = False,
    row_check: Callable[[dict], tuple[str, str] | None] | None = None, images: bool = False,
) -> tuple[datasets.Dataset, ConversionStats]:
    """Convert rows to the canonical columns; returns the kept rows and what conversion counted.

    A structurally wrong row (or one `row_check` faults) raises DataError naming it, or with `skip_bad_rows`
    is left out and counted per reason; ranking rows with identical answers are always left out and counted.
    """
    _refuse_media(dataset, spec, images)
    converter = RowConverter(spec, list(dataset.column_names), skip_bad_rows, row_check, images=images)
    features = {**CANONICAL_FEATURES, **_DROP_COLUMNS}
    if "kto_tag" in converter.present:
        features["kto_tag"] = datasets.Value("bool")
    if images:
        features[IMAGE_COLUMN] = IMAGES_FEATURE
    converted = dataset.map(
        converter.convert_batch, batched=True, with_indices=True, remove_columns=list(dataset.column_names),
        num_proc=num_proc, features=datasets.Features(features), desc=f"Converting {spec.name}",
    )
    stats = ConversionStats(rows=len(dataset))
    if len(converted) == 0:  # no rows in: datasets' map writes none of the columns either
        return converted, stats
    table = converted.with_format("arrow")[:]  # counts in Arrow: a Python object per row costs as much as converting
    reasons = table["drop_reason"]
    for entry in pc.value_counts(reasons).to_pylist():
        if entry["values"]:
            stats.dropped[entry["values"]] = entry["counts"]
            first = pc.index(reasons, entry["values"]).as_py()
            stats.first[entry["values"]] = table["drop_message"][first].as_py()
    kept_mask = pc.equal(reasons, "")
    kept = table.filter(kept_mask)
    stats.empty_answers, stats.with_reasoning = _answer_counts(kept)
    stats.numbers_as_text = int(pc.sum(kept["numbers_as_text"]).as_py() or 0)
    stats.null_arguments = int(pc.sum(kept["null_arguments"]).as_py() or 0)
    if stats.total_dropped:
        converted = converted.filter(
            _keep, input_columns="drop_reason", batched=True, num_proc=num_proc, desc=f"Leaving out rows of {spec.name}"
        )
    return converted.remove_columns(list(_DROP_COLUMNS)), stats


def _answer_counts(table: pa.Table) -> tuple[int, int]:
    """(rows with an empty answer, rows with reasoning) of converted rows, counted in Arrow."""
    if table.num_rows == 0:
        return 0, 0
    messages = table["messages"].combine_chunks()
    turns = pc.list_flatten(messages)
    owner = pc.list_parent_indices(messages)
    answers = pc.equal(pc.struct_field(turns, "role"), "assistant")
    no_calls = pc.equal(pc.fill_null(pc.struct_field(turns, "tool_calls"), ""), "")
    blank = pc.equal(pc.utf8_trim_whitespace(pc.fill_null(pc.struct_field(turns, "content"), "")), "")
    empty = pc.and_(pc.and_(answers, no_calls), blank)
    reasoned = pc.and_(answers, pc.not_equal(pc.fill_null(pc.struct_field(turns, "reasoning"), ""), ""))

    def rows_where(mask: pa.Array) -> int:
        return len(pc.unique(pc.filter(owner, mask)))

    chosen, rejected = (table[key].combine_chunks() for key in ("chosen", "rejected"))
    ranking = pc.or_(pc.not_equal(chosen, ""), pc.not_equal(rejected, ""))
    blank_side = pc.or_(*(pc.equal(pc.utf8_trim_whitespace(side), "") for side in (chosen, rejected)))
    empty_pairs = pc.sum(pc.and_(ranking, blank_side)).as_py() or 0
    return rows_where(empty) + empty_pairs, rows_where(reasoned)
