"""Preference data for stages rm, dpo (pairs) and kto (unpaired examples), encoded by the sft encoder.

A ranking row (formats.py) ends its `messages` with the prompt turn and keeps the answers in
`chosen` / `rejected`. Each answer is appended as the final assistant turn and the conversation goes
through the same SupervisedEncoder as sft, with only that last answer supervised (mask_history), so
rendering, masking and truncation are exactly sft's:

    row: messages=[user: "Sort 3 1 2"], chosen="1 2 3", rejected="2 1 3"
      chosen_input_ids   <|im_start|>user\\nSort 3 1 2<|im_end|>\\n<|im_start|>assistant\\n1 2 3<|im_end|>\\n
      chosen_labels      -100 ...                                                       1 2 3<|im_end|>  -100
      rejected_...       the same with "2 1 3"

A pair is dropped (and counted) when either side has no supervised token left after truncation.

KTO rows are single examples with a `kto_tag` (desirable or not): a ranking row gives two (chosen →
desirable, rejected → undesirable); a supervised row with a `kto_tag` column (mapped in
dataset_info.json, `"columns": {"kto_tag": "label"}`) gives one. Each example also carries its KL
example: its own prompt with the answer of the next row in the map batch (cycling), as in the KTO
paper's mismatched pairs, so the reference point z0 can be estimated from the same batch.
Columns: input_ids, labels, kl_input_ids, kl_labels, kto_tag.

This module owns turning canonical rows into these columns; padding is collate.py's PairedCollator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import datasets

from tunelab.config.stages import stage_row
from tunelab.data.cache import cached_bundle
from tunelab.data.encode import SupervisedEncoder
from tunelab.data.formats import IMAGES_FEATURE, is_ranking_row
from tunelab.data.pipeline import build_datasets
from tunelab.data.vision import VisionEncoder, vision_fingerprint
from tunelab.errors import DataError

PAIR_COLUMNS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")
KTO_COLUMNS = ("input_ids", "labels", "kl_input_ids", "kl_labels", "kto_tag")


def pair_sides(stage: str) -> tuple[str, str]:
    """The column prefixes of a pair stage's two sequences per row, in PairedCollator's order."""
    return ("", "kl_") if stage_row(stage).reads == "unpaired" else ("chosen_", "rejected_")


def _assistant(content: str) -> dict[str, str]:
    return {"role": "assistant", "content": content, "tool_calls": "", "tool_call_id": "", "reasoning": ""}


def with_answer(row: dict, answer: dict) -> dict:
    """The row with `answer` (a canonical message) appended as its final assistant turn."""
    return {**row, "messages": [*row["messages"], answer]}


class ReferenceAnswerEncoder:
    """The generating stages' rows (grpo, ppo) as `tunelab data` encodes them: a ranking row with its chosen answer
    as its last turn, the reference training compares with (data/formats.py prompt_and_reference); others as read."""

    def __init__(self, encoder: SupervisedEncoder):
        self.encoder, self.cutoff_len = encoder, encoder.cutoff_len

    @staticmethod
    def _answered(rows: list[dict]) -> list[dict]:
        return [with_answer(row, _assistant(row["chosen"])) if is_ranking_row(row) else row for row in rows]

    def encode_rows(self, rows: list[dict]) -> list[list[dict[str, Any]]]:
        return self.encoder.encode_rows(self._answered(rows))

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        rows = self._answered(_rows(batch))
        return self.encoder({key: [row[key] for row in rows] for key in batch})


def _rows(batch: dict[str, list]) -> list[dict]:
    return [dict(zip(batch, values)) for values in zip(*batch.values())]


def _size(messages: list[dict]) -> tuple[int, int]:
    """How much of a conversation truncation left: turns, then characters."""
    return len(messages), sum(len(str(m.get("content") or "")) for m in messages)


def _stats(kept: list[dict]) -> dict[str, Any]:
    return {
        "truncated": any(e["truncated"] for e in kept),
        "num_supervised": kept[0]["num_supervised"],
        "num_tokens": sum(len(e["input_ids"]) for e in kept),
        "expanded": 0,
    }


@dataclass(frozen=True)
class PairwiseEncoder:
    """Batched datasets.map function: ranking rows → chosen_/rejected_ input_ids and labels.

    `encoder` is the sft SupervisedEncoder with mask_history=True (only the appended answer trains).
    Also writes the columns pipeline.encode_dataset counts and removes (truncated, num_supervised of
    both sides, num_tokens, expanded).
    """

    encoder: SupervisedEncoder

    @property
    def cutoff_len(self) -> int:
        return self.encoder.cutoff_len

    def examples(self, row: dict):
        """The rendered prompt (for dedup): rows with the same prompt are duplicates."""
        return self.encoder.examples(row)

    @property
    def vision(self) -> bool:
        """The sft encoder is data/vision.py's VisionEncoder: pairs carry their (shared) prompt's images."""
        return hasattr(self.encoder, "processor")

    @property
    def features(self):
        """The encoded columns' types, given to datasets.map in vision runs (None: inferred, as for text)."""
        if not self.vision:
            return None
        ints = datasets.List(datasets.Value("int64"))
        columns = {key: ints for key in PAIR_COLUMNS}
        columns.update(truncated=datasets.Value("bool"), num_supervised=datasets.Value("int64"),
                       num_tokens=datasets.Value("int64"), expanded=datasets.Value("int64"), images=IMAGES_FEATURE)
        return datasets.Features(columns)

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        rows = _rows(batch)
        for row in rows:
            if not is_ranking_row(row):
                raise DataError("pairwise data needs ranking rows (chosen and rejected); set ranking: true in dataset_info.json")
        n = len(rows)
        encoded = self.encoder.encode_rows(
            [with_answer(r, _assistant(r["chosen"])) for r in rows]
            + [with_answer(r, _assistant(r["rejected"])) for r in rows]
        )
        # Vision: an example whose image did not fit comes back as an empty marker (data/vision.py): no side.
        encoded = [[e for e in examples if e["input_ids"]] for examples in encoded]
        self._same_prompts(rows, encoded)
        columns = (*PAIR_COLUMNS, "truncated", "num_supervised", "num_tokens", "expanded", *(["images"] if self.vision else []))
        out: dict[str, list] = {k: [] for k in columns}
        for chosen, rejected in zip(encoded[:n], encoded[n:]):
            if not chosen or not rejected:
                continue  # a side lost every supervised token to truncation: the pair is dropped
            (chosen,), (rejected,) = chosen, rejected  # mask_history: one example per conversation
            if self.vision:
                if chosen["images"] != rejected["images"]:
                    continue  # truncation left the two sides different images: the pair is dropped
                out["images"].append(chosen["images"])
            for side, example in (("chosen", chosen), ("rejected", rejected)):
                out[f"{side}_input_ids"].append(example["input_ids"])
                out[f"{side}_labels"].append(example["labels"])
            stats = _stats([chosen, rejected])
            stats["num_supervised"] = chosen["num_supervised"] + rejected["num_supervised"]
            for key, value in stats.items():
                out[key].append(value)
        return out


    def _same_prompts(self, rows: list[dict], encoded: list[list[dict]]) -> None:
        """Both sides of a pair must see the same prompt. When truncation shortened one side's history more
        (its answer is longer), the other side is encoded again on that shorter prompt, in place."""
        n = len(rows)
        redo: list[tuple[int, list[dict], dict]] = []  # (index in encoded, messages, options)
        for i, (chosen, rejected) in enumerate(zip(encoded[:n], encoded[n:])):
            if not chosen or not rejected:
                continue
            prompts = chosen[0]["_messages"][:-1], rejected[0]["_messages"][:-1]
            if prompts[0] == prompts[1]:
                continue
            shorter = min((0, 1), key=lambda side: _size(prompts[side]))
            other = i + n if shorter == 0 else i
            answer = encoded[other][0]["_messages"][-1]
            redo.append((other, [*prompts[shorter], answer], self.encoder.options(rows[i])))
        if redo and self.vision:  # the shortened prompt would need its images re-counted: drop such pairs
            for at, _, _ in redo:
                encoded[at] = []
        elif redo:
            again = self.encoder.encode_conversations([(m, o) for _, m, o in redo], fixed_prompt=True)
            for (at, _, _), examples in zip(redo, again):
                encoded[at] = examples


@dataclass(frozen=True)
class KTOEncoder:
    """Batched datasets.map function: ranking rows or kto_tag rows → KTO examples with their KL examples."""

    encoder: SupervisedEncoder

    @property
    def cutoff_len(self) -> int:
        return self.encoder.cutoff_len

    def examples(self, row: dict):
        return self.encoder.examples(row)

    @staticmethod
    def _split(row: dict, where: str) -> tuple[dict, list[tuple[dict, bool]]]:
        """(prompt row, [(answer message, desirable)]) of one canonical row."""
        if is_ranking_row(row):
            return row, [(_assistant(row["chosen"]), True), (_assistant(row["rejected"]), False)]
        tag = row.get("kto_tag")
        if tag is None or not row["messages"] or row["messages"][-1]["role"] != "assistant":
            raise DataError(
                f"{where}: stage kto needs ranking rows or a kto_tag column; map it in dataset_info.json "
                '("columns": {"kto_tag": "<your column>"}) or use a ranking dataset'
            )
        return {**row, "messages": row["messages"][:-1]}, [(row["messages"][-1], bool(tag))]

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        split = [self._split(row, "kto data") for row in _rows(batch)]
        items, kl_items = [], []
        for i, (prompt, answers) in enumerate(split):
            others = split[(i + 1) % len(split)][1]  # the next row's answers: mismatched with this prompt
            for j, (answer, desirable) in enumerate(answers):
                items.append((with_answer(prompt, answer), desirable))
                kl_items.append(with_answer(prompt, others[j % len(others)][0]))
        encoded = self.encoder.encode_rows([row for row, _ in items] + kl_items)
        n = len(items)
        out: dict[str, list] = {k: [] for k in (*KTO_COLUMNS, "truncated", "num_supervised", "num_tokens", "expanded")}
        for (_, desirable), example, kl_example in zip(items, encoded[:n], encoded[n:]):
            if not example or not kl_example:
                continue
            (example,), (kl_example,) = example, kl_example
            out["input_ids"].append(example["input_ids"])
            out["labels"].append(example["labels"])
            out["kl_input_ids"].append(kl_example["input_ids"])
            out["kl_labels"].append(kl_example["labels"])
            out["kto_tag"].append(desirable)
            for key, value in _stats([example, kl_example]).items():
                out[key].append(value)
        if out["expanded"]:  # a ranking row gives two examples: the batch's extra ones, so drops count exactly
            out["expanded"][0] = n - len(split)
        return out


def preference_encoder(stage: str, tokenizer, template, data_args, vision=None) -> PairwiseEncoder | KTOEncoder:
    """The encoder of stage rm / dpo (pairs) or kto: the sft encoder, supervising only the final answer.
    `vision` ((processor, ImageSettings), stage dpo): the sft encoder is data/vision.py's VisionEncoder."""
    inner = SupervisedEncoder(
        tokenizer=tokenizer, template=template, cutoff_len=data_args.cutoff_len, mask_history=True,
        template_vars=data_args.template_kwargs or {},
    )
    if vision is not None:

        inner = VisionEncoder(inner, *vision)
    return KTOEncoder(inner) if stage_row(stage).reads == "unpaired" else PairwiseEncoder(inner)


def preference_bundle(data_args, tokenizer, template, stage: str, seed: int, is_main_process: bool = True,
                      vision=None):
    """The encoded datasets of stage rm / dpo / kto, through the tokenized cache (rm and dpo share
    their entries: the same pairs), with the val split and eval sets as for sft."""

    encoder = preference_encoder(stage, tokenizer, template, data_args, vision)
    kind = stage if stage_row(stage).reads == "unpaired" else "pairwise"  # (kto's entries: its own name)
    return cached_bundle(
        data_args, tokenizer, template.jinja + vision_fingerprint(vision), kind, seed,
        build=lambda: build_datasets(data_args, tokenizer, template, seed, encoder=encoder, images=vision is not None),
        is_main_process=is_main_process,
    )
