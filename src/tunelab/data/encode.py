"""Canonical conversations → (input_ids, labels): the one place that decides which tokens train.

The template renders the whole conversation once and reports the character span of every assistant
answer (content + end-of-turn). The fast tokenizer tokenises that text once, with offsets, and a
token is supervised when its first character lies inside a span. So supervised ids always decode to
exactly the assistant answers, and the ids equal `tokenizer(official_render)` token for token.

    text:    <|im_start|>user\\n2+2?<|im_end|>\\n<|im_start|>assistant\\n4<|im_end|>\\n
    spans:                                                      [----------]
    labels:  -100 ...                                           4 <|im_end|>  -100

Options: train_on_prompt supervises every token; mask_history supervises only the last answer.
Truncation keeps the first cutoff_len tokens (the prompt, then as much of the answers as fits);
an example left with no supervised token is dropped and counted, never trained on as zero loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tunelab.data.templates import Template

IGNORE_INDEX = -100


@dataclass
class EncodeStats:
    """What encoding did to a dataset, for the run log."""

    examples: int = 0
    truncated: int = 0
    dropped_no_supervised: int = 0
    tokens: int = 0
    supervised_tokens: int = 0

    def merge(self, other: "EncodeStats") -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass(frozen=True)
class SupervisedEncoder:
    """Encodes canonical rows for supervised stages. Picklable, so datasets.map can run it in workers."""

    tokenizer: object
    template: "Template"
    cutoff_len: int
    train_on_prompt: bool = False
    mask_history: bool = False

    def conversation(self, row: dict) -> list[dict]:
        messages = [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
        if row.get("system"):
            messages.insert(0, {"role": "system", "content": row["system"]})
        return messages

    def render(self, row: dict) -> tuple[str, list[tuple[int, int]]]:
        tools = row.get("tools") or None
        return self.template.render_with_spans(
            self.conversation(row), tools=_parse_tools(tools), **self._token_strings()
        )

    def _token_strings(self) -> dict:
        tok = self.tokenizer
        return {"bos_token": tok.bos_token or "", "eos_token": tok.eos_token or ""}

    def label_tokens(self, offsets: list[tuple[int, int]], spans: list[tuple[int, int]], ids: list[int]) -> list[int]:
        if self.train_on_prompt:
            return list(ids)
        if self.mask_history:
            spans = spans[-1:]
        labels = [IGNORE_INDEX] * len(ids)
        span_index = 0
        for i, (start, end) in enumerate(offsets):
            while span_index < len(spans) and start >= spans[span_index][1]:
                span_index += 1
            if span_index == len(spans):
                break
            if end > start and spans[span_index][0] <= start < spans[span_index][1]:
                labels[i] = ids[i]
        return labels

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        """Batched datasets.map function: rows in, encoded rows out (dropped rows removed)."""
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        rendered = [self.render(row) for row in rows]
        encoded = self.tokenizer(
            [text for text, _ in rendered], add_special_tokens=False, return_offsets_mapping=True
        )
        out: dict[str, list] = {"input_ids": [], "labels": [], "truncated": [], "num_supervised": []}
        for (text, spans), ids, offsets in zip(rendered, encoded["input_ids"], encoded["offset_mapping"]):
            labels = self.label_tokens(offsets, spans, ids)
            truncated = len(ids) > self.cutoff_len
            ids, labels = ids[: self.cutoff_len], labels[: self.cutoff_len]
            num_supervised = sum(1 for label in labels[1:] if label != IGNORE_INDEX)
            if num_supervised == 0:
                continue  # nothing left to learn from (the first label never reaches the loss)
            out["input_ids"].append(ids)
            out["labels"].append(labels)
            out["truncated"].append(truncated)
            out["num_supervised"].append(num_supervised)
        return out


def _parse_tools(tools: str | None):
    if not tools:
        return None
    import json  # noqa: PLC0415

    try:
        parsed = json.loads(tools)
    except json.JSONDecodeError:
        return None
    return parsed if isinstance(parsed, list) else [parsed]
