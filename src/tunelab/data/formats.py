"""Dataset formats (alpaca, sharegpt, openai) → one canonical conversation row.

Canonical row (what templates and encoders read):
    messages: [{"role": "user"|"assistant"|"tool"|"function", "content": str}, ...]
              alternating prompt turns and answers, ending with an assistant turn for supervised data
              (for ranking data it ends with the prompt turn; the answers are in chosen/rejected)
    system:   str ("" when none)
    tools:    str ("" when none; a JSON list of tool schemas)
    chosen / rejected: str ("" unless the dataset is a ranking set)

This module owns the column and role mapping; it knows nothing of tokens or templates.
Rows that are structurally wrong raise DataError naming the dataset and row; rows whose answer is
empty are dropped and counted (an empty target teaches nothing and would be silently zero loss).
"""

from __future__ import annotations

import json
from typing import Any

import datasets

from tunelab.data.registry import DatasetSpec
from tunelab.errors import DataError

CANONICAL_COLUMNS = ("messages", "system", "tools", "chosen", "rejected")

ALPACA_COLUMNS = {
    "prompt": "instruction", "query": "input", "response": "output", "history": None, "system": None,
    "tools": None, "chosen": "chosen", "rejected": "rejected",
}
SHAREGPT_COLUMNS = {"messages": "conversations", "system": None, "tools": None, "chosen": "chosen", "rejected": "rejected"}
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
        for key in required:
            column = self.columns.get(key)
            if column not in column_names:
                raise DataError(
                    f"dataset '{spec.name}': column '{column}' (mapped as {key}) is missing; "
                    f"the file has {', '.join(column_names)} — set columns.{key} in dataset_info.json"
                )
        # Optional columns that are mapped by default but absent simply stay empty.
        self.present = {k: v for k, v in self.columns.items() if v in column_names}

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
        if self.spec.ranking:
            out["chosen"], out["rejected"] = self._pair(row, where)
            if messages and messages[-1]["role"] == "assistant":
                raise DataError(f"{where}: a ranking row must end with the prompt, not an assistant turn")
        return out

    def _alpaca_messages(self, row: dict, where: str) -> list[dict]:
        messages = []
        for turn in self._get(row, "history") or []:
            if not (isinstance(turn, (list, tuple)) and len(turn) == 2):
                raise DataError(f"{where}: history must be a list of [query, response] pairs")
            messages += [{"role": "user", "content": _text(turn[0])}, {"role": "assistant", "content": _text(turn[1])}]
        prompt = _text(self._get(row, "prompt"))
        query = _text(self._get(row, "query"))
        content = f"{prompt}\n{query}" if prompt and query else (prompt or query)
        if not content:
            raise DataError(f"{where}: empty prompt (columns {self.columns['prompt']}/{self.columns['query']})")
        messages.append({"role": "user", "content": content})
        if not self.spec.ranking:
            messages.append({"role": "assistant", "content": _text(self._get(row, "response"))})
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
            content = _text(turn.get(tags["content_tag"]))
            if role == "system":
                if turn_index != 0:
                    raise DataError(f"{where} turn {turn_index}: a system turn may only come first")
                system = content
                continue
            messages.append({"role": role, "content": content})
        # Prompt turns (user / tool results) and answers (assistant / function calls) must alternate.
        for i, message in enumerate(messages):
            is_answer = message["role"] in ("assistant", "function")
            if is_answer != (i % 2 == 1):
                expected = "an assistant" if i % 2 else "a user/tool"
                raise DataError(f"{where}: turn {i} is {message['role']}, expected {expected} turn (roles must alternate)")
        if not self.spec.ranking and (not messages or messages[-1]["role"] not in ("assistant", "function")):
            raise DataError(f"{where}: the conversation must end with an assistant turn")
        for m in messages:  # the templates know function calls as assistant turns
            if m["role"] == "function":
                m["role"] = "assistant"
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
    return any(m["role"] == "assistant" and not m["content"].strip() for m in row["messages"])


def to_canonical(dataset: datasets.Dataset, spec: DatasetSpec, num_proc: int | None = None) -> tuple[datasets.Dataset, int]:
    """Convert rows to the canonical columns; returns (dataset, rows dropped for an empty answer)."""
    converter = _Converter(spec, list(dataset.column_names))
    converted = dataset.map(
        converter, with_indices=True, remove_columns=list(dataset.column_names), num_proc=num_proc,
        desc=f"Converting {spec.name}",
    )
    kept = converted.filter(lambda row: not _has_empty_answer(row), num_proc=num_proc)
    return kept, len(converted) - len(kept)
