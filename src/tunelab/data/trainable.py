"""The row check every supervised run converts its rows with: the row trains what it says, or it is a row fault.

``TrainableRow`` is the ``row_check`` of ``formats.to_canonical`` (the one path bad rows take: an error naming the
dataset, file and line, or with ``skip_bad_rows`` a skip counted per reason). It renders the row through the run's
template and encoder options before anything is tokenised, and faults:

    template_refused           the template raises on the conversation (Llama-3.1: parallel calls; Gemma-3: a tool
                               turn), or no trained span can be found in its render (DeepSeek-V3: a second round of
                               calls after tool results, which it writes after a prompt the model is never given);
    tool_calls_not_rendered    an answer's tool calls are not in what it trains (Llama-3, SmolLM2: no place for calls;
                               the turn would train an empty answer; DeepSeek-V3: calls only in a turn without text),
                               or, for an answer that does not train, not in the conversation at all;
    content_not_rendered       the text beside an answer's tool calls is not in what it trains (Llama-3.1 writes only
                               the call);
    reasoning_not_rendered     an answer's reasoning is not in what it trains (no place for it, or none at that point);
    reasoning_prompt_mismatch  an answer's reasoning is rendered, but after a prompt unlike the one the model is given
                               at inference (Qwen3 with enable_thinking false pre-fills an empty think block): written as
                               reasoning_content or inline as <think>...</think>, the same fault.

Only answers that train are checked for their calls' and reasoning's place in the trained text (with mask_history
the last one; in ranking rows the appended chosen / rejected answer); earlier answers' calls must still be in the
conversation. Cost: rows of text turns only render once (a refusal is all that can go wrong there); rows with tool
calls, tool results or reasoning render as the encoder renders them (a few renders per answer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tunelab.data.encode import SupervisedEncoder
from tunelab.data.formats import is_ranking_row, renders_reasoning, renders_tool_turns, template_messages
from tunelab.data.templates import TEMPLATE_NAMES, get_template
from tunelab.errors import TemplateError

Fault = tuple[str, str]  # (reason, one-line message without the row's location)


@dataclass(frozen=True)
class TrainableRow:
    """Row check for to_canonical (module docstring): None, or (reason, message) for a row that cannot train as
    written. Picklable: datasets.map may run it in workers."""

    encoder: SupervisedEncoder

    def __call__(self, row: dict) -> Fault | None:
        if is_ranking_row(row):  # the pair stages train the appended answer alone; both sides must render
            for key in ("chosen", "rejected"):
                answer = {"role": "assistant", "content": row[key], "tool_calls": "", "tool_call_id": "", "reasoning": ""}
                fault = self._check({**row, "messages": [*row["messages"], answer]}, last_only=True)
                if fault is not None:
                    return fault
            return None
        return self._check(row, last_only=self.encoder.mask_history)

    def _check(self, row: dict, last_only: bool) -> Fault | None:
        encoder, template = self.encoder, self.encoder.template
        messages = encoder.bounded(template_messages(row, template))[0]
        options = encoder.options(row)
        answers = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        trains = answers[-1:] if last_only else answers
        tools = any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)
        if not tools and not any(_reasoning(m) for m in messages):
            try:
                template.render(messages, **options)
            except TemplateError as exc:
                return "template_refused", str(exc)
            return None
        fault = self._checked(messages, answers, trains, last_only, options)
        if fault is not None and fault[0] == "template_refused" and tools and not renders_tool_turns(template):
            hint = ("it has no place for tool calls and results: remove the tool turns or use a template that writes "
                    "them, the model's own if it has them")
            return fault[0], f"{fault[1]} ({hint})"
        return fault

    def _checked(
        self, messages: list[dict[str, Any]], answers: list[int], trains: list[int], last_only: bool,
        options: dict[str, Any],
    ) -> Fault | None:
        encoder, template = self.encoder, self.encoder.template
        number = {i: k for k, i in enumerate(answers, start=1)}
        fault = self._reasoning_faults(messages, trains, number, options)
        if fault is not None:
            return fault
        try:  # what SupervisedEncoder.examples renders, with this row's last_only
            if encoder.train_on_prompt:
                examples = [(template.render(messages, **options), [])]
            else:
                examples = template.training_examples(messages, last_only=last_only, **options)
        except TemplateError as exc:
            return "template_refused", str(exc)
        texts = [text for text, _ in examples]
        if encoder.train_on_prompt:
            trained = {i: "".join(texts) for i in trains}
        else:
            spans = [text[start:end] for text, example_spans in examples for start, end in example_spans]
            trained = dict(zip(trains, spans, strict=True))
        for i in answers:
            fault = self._answer_fault(messages[i], number[i], trained.get(i), "".join(texts))
            if fault is not None:
                return fault
        return None

    def _reasoning_faults(
        self, messages: list[dict[str, Any]], trains: list[int], number: dict[int, int], options: dict[str, Any]
    ) -> Fault | None:
        template = self.encoder.template
        wanted = [i for i in trains if (messages[i].get("reasoning_content") or "").strip()]
        if wanted and not renders_reasoning(template):
            return "reasoning_not_rendered", (
                f"answer {number[wanted[0]]} has reasoning, but chat template '{template.name}' has no place for it (it "
                f"does not read reasoning_content); use a template that does ({', '.join(_reasoning_templates())}) "
                "or remove the reasoning"
            )
        for i in trains:
            reasoning = _reasoning(messages[i])
            if not reasoning:
                continue
            try:
                own = template.render(messages[: i + 1], **options)
                prompt = template.render(messages[:i], add_generation_prompt=True, **options)
                before = template.render(messages[:i], **options)
            except TemplateError as exc:
                return "template_refused", str(exc)
            answer = own[len(before) :] if own.startswith(before) else own
            if reasoning in answer and not own.startswith(prompt):
                opening = prompt[len(before) :] if prompt.startswith(before) else prompt[-40:]
                variables = ", ".join(f"{key}={value!r}" for key, value in self.encoder.template_vars.items())
                under = f" with {variables}" if variables else ""
                return "reasoning_prompt_mismatch", (
                    f"answer {number[i]} has reasoning, but chat template '{template.name}'{under} opens that answer "
                    f"at inference with {opening!r}, which its reasoning does not follow (it would train after a prompt "
                    "the model is never given); remove the reasoning (reasoning_content or the <think> block) from "
                    "that answer, or set the template variables that let the model reason (template_kwargs)"
                )
        return None

    def _answer_fault(self, message: dict[str, Any], number: int, trained: str | None, conversation: str) -> Fault | None:
        """An answer's calls, call-turn text and reasoning in what it trains (None: it does not train, so its calls
        in the conversation)."""
        name = self.encoder.template.name
        where = conversation if trained is None else trained
        for call in message.get("tool_calls") or []:
            function = call.get("function", call)
            if function["name"] not in where:
                place = "what the answer trains" if trained is not None else "the conversation"
                if (message.get("content") or "").strip() and renders_tool_turns(self.encoder.template):
                    return "tool_calls_not_rendered", (  # DeepSeek-V3: calls only in a turn without text
                        f"answer {number} calls {function['name']!r} beside text, but chat template '{name}' writes "
                        f"tool calls only in an answer without text (content null or \"\"), so {place} would hold the "
                        f"text {_excerpt(message['content'].strip())} alone; remove the text beside the calls"
                    )
                return "tool_calls_not_rendered", (
                    f"answer {number} calls {function['name']!r}, but chat template '{name}' does not write that call "
                    f"into {place} (it has no place for tool calls, so the turn would train as an empty answer); use "
                    "a template that writes tool calls (the model's own, if it has them) or remove the tool turns"
                )
        if trained is None:
            return None
        text = (message.get("content") or "").split("</think>")[-1].strip()
        if message.get("tool_calls") and text and text not in trained:
            return "content_not_rendered", (
                f"answer {number} has text beside its tool calls, but chat template '{name}' writes only the calls "
                f"of such a turn (the text {_excerpt(text)} would be dropped); remove the text from that answer or use "
                "a template that writes both"
            )
        reasoning = (message.get("reasoning_content") or "").strip()
        if reasoning and reasoning not in trained:
            return "reasoning_not_rendered", (
                f"the reasoning of answer {number} is not in what chat template '{name}' trains (the "
                "template writes no reasoning at that point of the conversation); remove it from that answer"
            )
        return None


def _reasoning(message: dict[str, Any]) -> str:
    """An answer's reasoning as written: its reasoning_content, else the text of an inline <think> block."""
    if message.get("role") != "assistant":
        return ""
    field = (message.get("reasoning_content") or "").strip()
    content = message.get("content") or ""
    if field or "</think>" not in content:
        return field
    return content.split("</think>")[0].split("<think>")[-1].strip()


def _excerpt(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def _reasoning_templates() -> list[str]:
    return [name for name in TEMPLATE_NAMES if renders_reasoning(get_template(name))]
