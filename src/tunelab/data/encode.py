"""Canonical conversations → (input_ids, labels): the one place that decides which tokens train.

The template renders the whole conversation once and reports the character span of every assistant
answer (content + end-of-turn). The fast tokenizer tokenises that text once, with offsets, and a
token is supervised when its first character lies inside a span. So supervised ids always decode to
exactly the assistant answers, and the ids equal `tokenizer(official_render)` token for token.

    text:    <|im_start|>user\\n2+2?<|im_end|>\\n<|im_start|>assistant\\n4<|im_end|>\\n
    spans:                                                      [----------]
    labels:  -100 ...                                           4 <|im_end|>  -100

Options: train_on_prompt supervises every token of the conversation's render; mask_history supervises
only the last answer. A template that rewrites earlier turns once later ones follow (Qwen3, Mistral-Nemo
with a system prompt) cannot train every answer in one render: such a conversation becomes one example
per answer (the render up to that answer, training only it), counted in the `expanded` column.
Truncation keeps the first cutoff_len tokens (the prompt, then as much of the answers as fits);
an example left with no supervised token is dropped and counted, never trained on as zero loss.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tunelab.data.formats import template_messages

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
    expanded_conversations: int = 0  # conversations encoded as one example per answer

    def merge(self, other: "EncodeStats") -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass(frozen=True)
class SupervisedEncoder:
    """Encodes canonical rows for supervised stages. Picklable, so datasets.map can run it in workers.

    ``template_vars`` reach the template as extra variables (e.g. ``{"enable_thinking": False}``).
    Output columns besides input_ids/labels, for the pipeline to sum and remove: ``truncated``,
    ``num_supervised``, and ``expanded`` — on the first kept example of a conversation split per answer,
    how many examples it added (0 elsewhere), so that dropped examples can still be counted exactly.
    """

    tokenizer: Any
    template: "Template"
    cutoff_len: int
    train_on_prompt: bool = False
    mask_history: bool = False
    template_vars: dict[str, Any] = field(default_factory=dict, hash=False)

    def examples(self, row: dict) -> list[tuple[str, list[tuple[int, int]]]]:
        """The (text, trained character spans) examples one canonical row encodes as."""
        tok = self.tokenizer
        options = {
            "tools": _parse_tools(row.get("tools") or None),
            "bos_token": tok.bos_token or "",
            "eos_token": tok.eos_token or "",
            **self.template_vars,
        }
        messages = template_messages(row)
        if self.train_on_prompt:  # every token trains, so one render of the whole conversation is all it takes
            return [(self.template.render(messages, **options), [])]
        return self.template.training_examples(messages, last_only=self.mask_history, **options)

    def label_tokens(self, offsets: list[tuple[int, int]], spans: list[tuple[int, int]], ids: list[int]) -> list[int]:
        if self.train_on_prompt:
            return list(ids)
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

    def encode_rows(self, rows: list[dict]) -> list[list[dict[str, Any]]]:
        """Each row's kept examples: dicts of input_ids, labels, truncated, num_supervised, expanded.

        One tokenizer call for all rows. A row whose every example lost its supervised tokens to
        truncation gets an empty list (pairwise data drops the whole pair then; see data/pairwise.py).
        """
        per_row = [self.examples(row) for row in rows]
        texts = [text for examples in per_row for text, _ in examples]
        all_ids, all_offsets = tokenize_with_offsets(self.tokenizer, texts)
        out: list[list[dict[str, Any]]] = []
        position = 0
        for examples in per_row:
            kept = []
            for _, spans in examples:
                ids, offsets = all_ids[position], all_offsets[position]
                position += 1
                truncated = len(ids) > self.cutoff_len
                # A token's label depends on it and the tokens before it only: label what truncation keeps.
                ids, offsets = ids[: self.cutoff_len], offsets[: self.cutoff_len]
                labels = self.label_tokens(offsets, spans, ids)
                num_supervised = len(labels[1:]) - labels[1:].count(IGNORE_INDEX)
                if num_supervised == 0:
                    continue  # nothing left to learn from (the first label never reaches the loss)
                kept.append({
                    "input_ids": ids, "labels": labels, "truncated": truncated, "num_supervised": num_supervised,
                    "expanded": 0 if kept else len(examples) - 1,
                })
            out.append(kept)
        return out

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        """Batched datasets.map function: rows in, encoded examples out (dropped examples removed)."""
        columns = list(batch)  # datasets' lazy batch: read each column once, not once per row
        rows = [dict(zip(columns, values)) for values in zip(*(batch[c] for c in columns))]
        out: dict[str, list] = {"input_ids": [], "labels": [], "truncated": [], "num_supervised": [], "expanded": []}
        for kept in self.encode_rows(rows):
            for example in kept:
                for key, value in example.items():
                    out[key].append(value)
        return out


def tokenize_with_offsets(tokenizer: Any, texts: list[str]) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
    """Ids and character offsets of each text, no special tokens added: ``tokenizer(texts, ...)``'s, exactly.

    A fast tokenizer's Rust backend is called directly when that is all ``tokenizer(...)`` would do: it skips
    transformers' per-encoding conversion to Python (about a tenth of the tokenising time on alpaca rows).
    """
    backend = _direct_backend(tokenizer)
    if backend is None:
        encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        return encoded["input_ids"], encoded["offset_mapping"]
    encodings = backend.encode_batch(texts, add_special_tokens=False)
    return [e.ids for e in encodings], [e.offsets for e in encodings]


def _direct_backend(tokenizer: Any) -> Any:
    """The backend when it encodes as ``tokenizer(...)`` does, else None: a fast tokenizer whose class keeps
    transformers' encoding path, and a backend left without truncation or padding (``tokenizer(...)`` would
    switch them off) and splitting special tokens as the tokenizer asks (it would set that too)."""
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415 - keeps importing this module light
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase  # noqa: PLC0415

    cls = type(tokenizer)
    if not (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and cls.__call__ is PreTrainedTokenizerBase.__call__
        and cls._encode_plus is PreTrainedTokenizerFast._encode_plus
    ):
        return None
    backend = tokenizer.backend_tokenizer
    if backend.truncation is not None or backend.padding is not None:
        return None
    if backend.encode_special_tokens != bool(tokenizer.split_special_tokens):
        return None
    return backend


def _parse_tools(tools: str | None) -> list[Any] | None:
    if not tools:
        return None
    try:
        parsed = json.loads(tools)
    except json.JSONDecodeError:
        return None
    return parsed if isinstance(parsed, list) else [parsed]
