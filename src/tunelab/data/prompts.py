"""Canonical rows → generation prompts and reference answers, for the stages that generate (grpo, ppo).

The rows come from the same registry, formats, mixing and val split as every other stage
(pipeline.load_canonical_splits); the prompt is the conversation up to its last answer, rendered by
the run's template with the generation prompt — exactly what `infer/generate.py` and a served model
see. The reference is that last answer (for a ranking row, its chosen answer).

    row:       user "Sort...\\n3 1 2" → assistant "1 2 3"
    prompt:    <|im_start|>user\\nSort...\\n3 1 2<|im_end|>\\n<|im_start|>assistant\\n
    reference: 1 2 3

Prompts are never cut (a truncated question has another answer): a prompt longer than cutoff_len
is dropped and counted in the report.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import datasets

from tunelab.config.args import DataArguments
from tunelab.data.encode import parse_tools
from tunelab.data.formats import prompt_and_reference
from tunelab.data.pipeline import load_canonical_splits
from tunelab.data.templates import Template
from tunelab.errors import DataError

logger = logging.getLogger(__name__)


@dataclass
class PromptBundle:
    train: datasets.Dataset  # columns: prompt (text), prompt_ids, reference, messages (JSON), tools
    eval_rows: dict[str, datasets.Dataset]  # canonical rows, for the exact-match check before/after
    report: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PromptEncoder:
    """Picklable row → {prompt, prompt_ids, reference, messages, tools}, for datasets.map.

    `messages` (the prompt's template messages as JSON) and `tools` let a reward model score the full
    render of prompt + answer, as the rm stage trained it, and a tool-using rollout render the turns that follow.
    `template_vars`: the run's template_kwargs. `tools`: the schemas of the run's own tools (grpo's option tools),
    rendered after the row's own; the `tools` column then holds them all, as JSON."""

    tokenizer: Any
    template: Template
    template_vars: dict[str, Any] = field(default_factory=dict, hash=False)
    tools: tuple[dict[str, Any], ...] = field(default=(), hash=False)

    def __call__(self, row: dict) -> dict:
        messages, reference = prompt_and_reference(row, self.template)
        tools = parse_tools(row.get("tools") or None)
        if self.tools:
            tools = [*(tools or []), *self.tools]
        prompt = self.template.prompt(
            messages, tools,
            bos_token=self.tokenizer.bos_token or "", eos_token=self.tokenizer.eos_token or "", **self.template_vars,
        )
        ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        rendered_tools = json.dumps(tools, ensure_ascii=False) if self.tools else row.get("tools") or ""
        return {"prompt": prompt, "prompt_ids": ids, "reference": reference,
                "messages": json.dumps(messages, ensure_ascii=False), "tools": rendered_tools}


def build_prompt_datasets(data_args: DataArguments, tokenizer, template: Template, seed: int,
                          tools: Sequence[dict[str, Any]] = ()) -> PromptBundle:
    """The prompts (rendered with the run's `tools` beside each row's own) and the held-out rows."""
    report: dict[str, Any] = {}
    train_rows, eval_rows = load_canonical_splits(data_args, seed, report)
    encoded = train_rows.map(
        PromptEncoder(tokenizer, template, data_args.template_kwargs or {}, tuple(tools)),
        remove_columns=list(train_rows.column_names),
        num_proc=data_args.preprocessing_num_workers, desc="Rendering prompts",
    )
    kept = encoded.filter(lambda row: len(row["prompt_ids"]) <= data_args.cutoff_len)
    report["train"] = {"prompts": len(kept), "dropped_longer_than_cutoff": len(encoded) - len(kept)}
    if len(kept) < len(encoded):
        logger.warning("dropped %d of %d prompts longer than cutoff_len=%d", len(encoded) - len(kept), len(encoded),
                       data_args.cutoff_len)
    if len(kept) == 0:
        raise DataError(f"every prompt is longer than cutoff_len ({data_args.cutoff_len}); raise cutoff_len")
    return PromptBundle(train=kept, eval_rows=eval_rows, report=report)
