"""Dataset formats (alpaca, sharegpt, openai) → one canonical conversation row.

Canonical row (what templates and encoders read):
    messages: [{"role": "user"|"assistant"|"tool", "content": str, "tool_calls": str, "tool_call_id": str}, ...]
              prompt turns (user, or one or more tool results) alternating with assistant answers, ending
              with an assistant turn for supervised data (for ranking data it ends with the prompt turn;
              the answers are in chosen/rejected). tool_calls is "" or a JSON list of
              {"type": "function", "function": {"name", "arguments": {...}}, ["id"]} (a string column:
              Arrow cannot type arbitrary JSON); tool_call_id is "" or the id a tool result answers.
    system:   str ("" when none)
    tools:    str ("" when none; a JSON list of tool schemas)
    chosen / rejected: str ("" unless the dataset is a ranking set)
    kto_tag:  bool, only for datasets that map a kto_tag column (stage kto: is the last answer desirable?)

sharegpt function_call turns become assistant turns with tool_calls and empty content, observation turns
become tool turns; openai rows keep their assistant tool_calls and tool messages. ``template_messages``
turns a canonical row back into the message dicts chat templates read.

This module owns the column and role mapping; it knows nothing of tokens or templates.
Rows that are structurally wrong raise DataError naming the dataset and row; rows whose answer is
empty are dropped and counted (an empty target teaches nothing and would be silently zero loss).
"""

from __future__ import annotations

import json
from typing import Any

import datasets

from tunelab.data.registry import MEDIA_COLUMNS, DatasetSpec
from tunelab.errors import DataError

CANONICAL_COLUMNS = ("messages", "system", "tools", "chosen", "rejected")

_STRING = datasets.Value("string")
# A fixed schema, so canonical sets from any format (with or without tools) concatenate and interleave.
CANONICAL_FEATURES = datasets.Features({
    "messages": [{"role": _STRING, "content": _STRING, "tool_calls": _STRING, "tool_call_id": _STRING}],
    "system": _STRING, "tools": _STRING, "chosen": _STRING, "rejected": _STRING,
})

ALPACA_COLUMNS = {
    "prompt": "instruction", "query": "input", "response": "output", "history": None, "system": None,
    "tools": None, "chosen": "chosen", "rejected": "rejected",
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


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def _message(role: str, content: str, tool_calls: str = "", tool_call_id: str = "") -> dict[str, str]:
    return {"role": role, "content": content, "tool_calls": tool_calls, "tool_call_id": tool_call_id}


def _tool_calls(value: Any, where: str) -> str:
    """Calls as sharegpt ({"name", "arguments"} or a list, maybe JSON text) or openai writes them → canonical JSON."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: the function call is not valid JSON ({exc.msg}); write it as "
                            '{"name": ..., "arguments": {...}} or a list of those') from None
    calls = []
    for call in value if isinstance(value, list) else [value]:
        function = call.get("function", call) if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise DataError(f"{where}: a function call needs a name; write it as "
                            '{"name": ..., "arguments": {...}}')
        arguments = function.get("arguments")
        if arguments is None or arguments == "":
            arguments = {}
        if isinstance(arguments, str):  # OpenAI sends arguments as JSON text; templates expect an object
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(arguments, dict):
            raise DataError(f"{where}: the arguments of function call '{name}' must be a JSON object")
        canonical: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
        if isinstance(call, dict) and call.get("id"):
            canonical["id"] = str(call["id"])
        calls.append(canonical)
    return json.dumps(calls, ensure_ascii=False) if calls else ""


def template_messages(row: dict) -> list[dict[str, Any]]:
    """A canonical row as the messages a chat template reads: system first, tool calls decoded.

    Keys a template tests for presence (Llama-3.1 checks ``'tool_calls' in message``) are set only when used.
    """
    messages: list[dict[str, Any]] = [{"role": "system", "content": row["system"]}] if row.get("system") else []
    for m in row["messages"]:
        message: dict[str, Any] = {"role": m["role"], "content": m["content"]}
        if m.get("tool_calls"):
            message["tool_calls"] = json.loads(m["tool_calls"])
        if m.get("tool_call_id"):
            message["tool_call_id"] = m["tool_call_id"]
        messages.append(message)
    return messages


def prompt_and_reference(row: dict) -> tuple[list[dict[str, Any]], str]:
    """A canonical row as the template messages of its prompt and its reference answer: a ranking row's chosen
    answer, else its last assistant turn ("" when the row ends with another role)."""
    messages = template_messages(row)
    if row.get("chosen"):
        return messages, row["chosen"]
    if messages and messages[-1]["role"] == "assistant":
        return messages[:-1], messages[-1]["content"]
    return messages, ""


class _Converter:
    """Row converter for one dataset spec (a class so datasets.map can pickle it)."""

    def __init__(self, spec: DatasetSpec, column_names: list[str]):
        self.spec = spec
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
        for key in required:
            column = self.columns.get(key)
            if column not in column_names:
                raise DataError(
                    f"dataset '{spec.name}': column '{column}' (mapped as {key}) is missing; "
                    f"the file has {', '.join(column_names)} — set columns.{key} in dataset_info.json"
                )
        # Optional columns that are mapped by default but absent simply stay empty.
        self.present = {k: v for k, v in self.columns.items() if v in column_names}
        self.output_columns = [*CANONICAL_COLUMNS, *(["kto_tag"] if "kto_tag" in self.present else [])]

    def _get(self, row: dict, key: str) -> Any:
        column = self.present.get(key)
        return row.get(column) if column else None

    def __call__(self, row: dict, index: int) -> dict:
        where = f"dataset '{self.spec.name}' row {index}"
        if self.spec.formatting == "alpaca":
            messages = self._alpaca_messages(row, where)
            system = _text(self._get(row, "system"))
        else:
            messages, system = self._sharegpt_messages(row, where)
        out = {"messages": messages, "system": system, "tools": _text(self._get(row, "tools")),
               "chosen": "", "rejected": ""}
        if "kto_tag" in self.present:
            out["kto_tag"] = bool(self._get(row, "kto_tag"))
        if self.spec.ranking:
            out["chosen"], out["rejected"] = self._pair(row, where)
            if messages and messages[-1]["role"] == "assistant":
                raise DataError(f"{where}: a ranking row must end with the prompt, not an assistant turn")
        return out

    def convert_batch(self, batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        """Batched datasets.map function: the converted rows less those with an empty answer. One pass over
        plain dicts, instead of a map and a filter over datasets' lazy per-row views."""
        columns = list(batch)  # datasets' lazy batch: read each column once, not once per row
        values = zip(*(batch[c] for c in columns))
        rows = (self(dict(zip(columns, row)), index) for row, index in zip(values, indices))
        kept = [row for row in rows if not _has_empty_answer(row)]
        return {key: [row[key] for row in kept] for key in self.output_columns}

    def _alpaca_messages(self, row: dict, where: str) -> list[dict]:
        messages = []
        for turn in self._get(row, "history") or []:
            if not (isinstance(turn, (list, tuple)) and len(turn) == 2):
                raise DataError(f"{where}: history must be a list of [query, response] pairs")
            messages += [_message("user", _text(turn[0])), _message("assistant", _text(turn[1]))]
        prompt = _text(self._get(row, "prompt"))
        query = _text(self._get(row, "query"))
        content = f"{prompt}\n{query}" if prompt and query else (prompt or query)
        if not content:
            raise DataError(f"{where}: empty prompt (columns {self.columns['prompt']}/{self.columns['query']})")
        messages.append(_message("user", content))
        if not self.spec.ranking:
            messages.append(_message("assistant", _text(self._get(row, "response"))))
        return messages

    def _sharegpt_messages(self, row: dict, where: str) -> tuple[list[dict], str]:
        tags = self.tags
        role_map = {
            tags["user_tag"]: "user", tags["assistant_tag"]: "assistant", tags["observation_tag"]: "tool",
            tags["function_tag"]: "function", tags["system_tag"]: "system",
        }
        raw = self._get(row, "messages")
        if not isinstance(raw, list) or not raw:
            raise DataError(f"{where}: '{self.columns['messages']}' must be a non-empty list of turns")
        system = _text(self._get(row, "system"))
        messages: list[dict] = []
        for turn_index, turn in enumerate(raw):
            role = role_map.get(turn.get(tags["role_tag"])) if isinstance(turn, dict) else None
            if role is None:
                raise DataError(
                    f"{where} turn {turn_index}: role {turn.get(tags['role_tag']) if isinstance(turn, dict) else turn!r} "
                    f"is not one of {', '.join(role_map)} (set tags in dataset_info.json)"
                )
            content = turn.get(tags["content_tag"])
            if role == "system":
                if turn_index != 0:
                    raise DataError(f"{where} turn {turn_index}: a system turn may only come first")
                system = _text(content)
                continue
            turn_where = f"{where} turn {turn_index}"
            if role == "function":  # sharegpt: the turn's content is the call itself
                messages.append(_message("assistant", "", _tool_calls(content, turn_where)))
            elif role == "assistant" and turn.get("tool_calls"):  # openai: content (maybe null) plus calls
                messages.append(_message("assistant", _text(content), _tool_calls(turn["tool_calls"], turn_where)))
            else:
                messages.append(_message(role, _text(content), tool_call_id=_text(turn.get("tool_call_id"))))
        # Prompt turns (a user turn, or the results of one call turn) and answers must alternate.
        expect_answer = False
        for i, message in enumerate(messages):
            is_answer = message["role"] == "assistant"
            if message["role"] == "tool" and i and messages[i - 1]["role"] == "tool":
                continue  # several results of one turn's parallel calls
            if is_answer != expect_answer:
                expected = "an assistant" if expect_answer else "a user/tool"
                raise DataError(
                    f"{where}: turn {i} is {message['role']}, expected {expected} turn (roles must alternate)"
                )
            expect_answer = not expect_answer
        if not self.spec.ranking and (not messages or messages[-1]["role"] != "assistant"):
            raise DataError(f"{where}: the conversation must end with an assistant turn")
        return messages, system

    def _pair(self, row: dict, where: str) -> tuple[str, str]:
        pair = []
        for key in ("chosen", "rejected"):
            value = self._get(row, key)
            if isinstance(value, dict):  # sharegpt style {"from": "gpt", "value": "..."}
                value = value.get(self.tags["content_tag"])
            pair.append(_text(value))
        return pair[0], pair[1]


def _has_empty_answer(row: dict) -> bool:
    if row["chosen"] or row["rejected"]:
        return not (row["chosen"].strip() and row["rejected"].strip())
    return any(
        m["role"] == "assistant" and not m["content"].strip() and not m.get("tool_calls") for m in row["messages"]
    )


def _refuse_media(dataset: datasets.Dataset, spec: DatasetSpec) -> None:
    """Rows that carry images / videos / audio (multimodal data) would train on their text alone: refuse."""
    for column in MEDIA_COLUMNS:
        if column in dataset.column_names:
            used = sum(1 for value in dataset[column] if value)
            if used:
                raise DataError(
                    f"dataset '{spec.name}': {used} rows have {column}, but tunelab trains text-only models and "
                    f"would ignore them: remove the '{column}' field from the rows (or use a multimodal trainer)"
                )


def to_canonical(dataset: datasets.Dataset, spec: DatasetSpec, num_proc: int | None = None) -> tuple[datasets.Dataset, int]:
    """Convert rows to the canonical columns; returns (dataset, rows dropped for an empty answer)."""
    _refuse_media(dataset, spec)
    converter = _Converter(spec, list(dataset.column_names))
    features = CANONICAL_FEATURES
    if "kto_tag" in converter.present:
        features = datasets.Features({**CANONICAL_FEATURES, "kto_tag": datasets.Value("bool")})
    kept = dataset.map(
        converter.convert_batch, batched=True, with_indices=True, remove_columns=list(dataset.column_names),
        num_proc=num_proc, features=features, desc=f"Converting {spec.name}",
    )
    return kept, len(dataset) - len(kept)
