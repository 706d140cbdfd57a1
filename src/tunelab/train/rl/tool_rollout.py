"""Tool-using rollouts (grpo's option tools): the policy answers, calls tools, reads their results and answers again,
up to max_tool_turns calls; one rollout row holds the whole exchange, and only the policy's own tokens train.

One row, a call and a final answer (Qwen's template; P: the prompt, left-padded as in rollout.py):

    [pad | <|im_start|>…assistant\\n | <tool_call>\\n{…}\\n</tool_call><|im_end|> | \\n<|im_start|>user\\n
     <tool_response>\\n42\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n | The answer is 42<|im_end|> | pad]
    completion_mask:                  1 … 1                         0 …  (the template's turns: glue, result) 0
                                                                                            1 … 1              0

The ids are what inference would send (the template contract): after a turn with calls the conversation so far
(the prompt's messages, the assistant turn with its parsed calls, one tool message per result) is rendered again
by the run's template with the generation prompt and tokenized, exactly as the API renders a client's messages;
the next turn is sampled after those ids. The policy's tokens that the render keeps in place train: all of them in
the usual case, where the model writes its calls as its template does; the rest - the end of its turn, the tool
turn, the next generation prompt - is masked. From the first token where the render differs from what the policy
sampled (other JSON spacing in a call, say) everything is masked, and the turn counted (`tools/rewritten_calls`):
those tokens in the row are the template's, not the policy's. A template that rewrites earlier turns once a call
follows cannot be used (TemplateError, from a probe before training). A render that re-tokenizes the end of the
prompt itself (a token merged across it) ends the row with that turn, unused (`tools/unrendered_calls`).

A turn is parsed for calls by the template's own tool-call syntax (infer/tool_calls.py, the API's parser). It ends
the rollout when it has no well-formed call, was cut by max_new_tokens, or comes after max_tool_turns calling turns
(its calls are then not run). Each turn samples up to max_new_tokens. The calls of a whole batch run at once
(tools.py's ToolRunner).

The reward functions see the final turn's text as `completions` and, when they name a parameter
`completion_messages`, each rollout's turns after the prompt as messages: the assistant turns (with `tool_calls`)
and the tool results, in the template's message format (train/rl/rewards.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tunelab.data.formats import message_conventions, template_call_turn
from tunelab.data.prompts import PromptEncoder
from tunelab.data.templates import Template
from tunelab.errors import TemplateError
from tunelab.infer.generate import Prediction
from tunelab.infer.tool_calls import ToolSyntax, tool_syntax
from tunelab.train.rl.rollout import Rollout, generate_rollout, left_pad
from tunelab.train.rl.tools import Tool, ToolRunner


_REWRITES_HISTORY = (
    "tools: chat template '{name}' renders the conversation before a tool call differently once the call and its "
    "result follow, so a rollout's ids cannot be what inference sends; use a template that keeps earlier turns as "
    "they were (template: qwen2_5 for Qwen models)"
)


@dataclass
class ToolUse:
    """What a tool-using rollout needs beside the model: the template that renders the turns, its call syntax, the
    tools and how many calling turns a rollout may take."""

    template: Template
    syntax: ToolSyntax
    runner: ToolRunner
    max_tool_turns: int
    bos_token: str = ""
    eos_token: str = ""
    template_vars: dict[str, Any] = field(default_factory=dict)
    kept_tokens: dict[int, str] = field(default_factory=dict)  # call openings that are one special token (Mistral's
    # [TOOL_CALLS]): decoding keeps them, as the API's decoder does (infer/engine.py)

    @classmethod
    def build(cls, template: Template, tokenizer, tools: Sequence[Tool], max_tool_turns: int,
              template_vars: dict[str, Any] | None = None) -> ToolUse:
        """The tool use of a run; TemplateError when the template cannot show tools or render tool turns."""
        bos, eos = tokenizer.bos_token or "", tokenizer.eos_token or ""
        runner = ToolRunner(tools)
        syntax = tool_syntax(template, bos, eos)
        if syntax is None:
            raise TemplateError(
                f"tools: chat template '{template.name}' does not show the model its tools or write tool calls; use "
                "a template that does (template: model for Qwen2.5 / Qwen3 / Llama-3.1 / Mistral models, or qwen2_5)"
            )
        use = cls(template, syntax, runner, max_tool_turns, bos, eos, dict(template_vars or {}))
        use._check_keeps_history()
        for opening in syntax.openings:
            ids = tokenizer(opening, add_special_tokens=False)["input_ids"]
            special = len(ids) == 1 and not tokenizer.decode(ids, skip_special_tokens=True)
            if special and tokenizer.decode(ids) == opening:
                use.kept_tokens[ids[0]] = opening
        return use

    def _check_keeps_history(self) -> None:
        """A probe: the prompt before a call must be the start of the render once the call and its result follow."""
        tools = self.runner.schemas or None
        name = tools[0]["function"]["name"] if tools else "probe"
        asked = [{"role": "user", "content": "PROBE"}]
        content, calls = template_call_turn("", [{"type": "function", "id": "call_probe0001", "function": {
            "name": name, "arguments": {}}}], message_conventions(self.template))
        answered = [*asked, {"role": "assistant", "content": content, "tool_calls": calls},
                    {"role": "tool", "tool_call_id": "call_probe0001", "name": name, "content": "PROBE RESULT"}]
        if not self.render(answered, tools).startswith(self.render(asked, tools)):
            raise TemplateError(_REWRITES_HISTORY.format(name=self.template.name))

    def decode(self, tokenizer, ids: list[int]) -> str:
        """The turn's text as the API's parser reads it: special tokens skipped, but the call openings."""
        parts, start = [], 0
        for i, token in enumerate(ids):
            if token in self.kept_tokens:
                parts += [tokenizer.decode(ids[start:i], skip_special_tokens=True), self.kept_tokens[token]]
                start = i + 1
        return "".join(parts) + tokenizer.decode(ids[start:], skip_special_tokens=True)

    def held_out_answers(self, model, tokenizer, rows, stop_ids: list[int], max_new_tokens: int,
                         batch_size: int) -> tuple[list[Prediction], float]:
        return held_out_tool_answers(model, tokenizer, self, rows, stop_ids, max_new_tokens, batch_size)

    def render(self, messages: list[dict], tools: list[dict] | None) -> str:
        return self.template.prompt(messages, tools, bos_token=self.bos_token, eos_token=self.eos_token,
                                    **self.template_vars)


@dataclass
class _Row:
    messages: list[dict]  # the conversation so far, from the prompt's messages on
    tools: list[dict] | None  # as the prompt rendered them
    ids: list[int]  # prompt + completion so far
    prompt_length: int
    own: list[int] = field(default_factory=list)  # per completion token: 1 the policy sampled it and it trains
    exchange: list[dict] = field(default_factory=list)  # the messages after the prompt
    answer: str = ""
    finished: bool = False
    calling_turns: int = 0
    calls: int = 0


@dataclass
class ToolRollout:
    rollout: Rollout
    completion_messages: list[list[dict]]  # per row: the turns after the prompt
    stats: dict[str, float]  # for the log: tools/...


def tool_rollout(
    model, tokenizer, tool_use: ToolUse, rows: list[dict], stop_ids: list[int], max_new_tokens: int,
    temperature: float, pad_id: int, group_size: int, greedy: bool = False,
) -> ToolRollout:
    """Sample `group_size` tool-using rollouts of each prompt row (columns prompt_ids, messages, tools); `greedy`:
    greedy turns instead (the held-out answers)."""
    states = [
        _Row(json.loads(row["messages"]), _parsed_tools(row["tools"]), list(row["prompt_ids"]), len(row["prompt_ids"]))
        for row in rows for _ in range(group_size)
    ]

    def next_turns(prompt_ids: list[list[int]], group: int) -> list[list[int]]:
        if greedy:
            return _greedy_turns(model, prompt_ids, stop_ids, max_new_tokens, pad_id)
        return _sampled_turns(generate_rollout(model, tokenizer, prompt_ids, stop_ids, max_new_tokens, temperature,
                                               pad_id, group_size=group))

    # 1) the first turn of every row, sampled as plain rollouts are (the prompt's cache shared by its group)
    turns = next_turns([row["prompt_ids"] for row in rows], group_size)
    active = list(range(len(states)))
    rewritten = unrendered = 0
    while active:
        # 2) each turn's calls, or the end of its row
        calling: list[tuple[int, list[int], str, str, list]] = []
        for index, tokens in zip(active, turns):
            state = states[index]
            ended_at_stop = bool(tokens) and tokens[-1] in stop_ids
            text = tool_use.decode(tokenizer, tokens[:-1] if ended_at_stop else tokens)
            parsed = tool_use.syntax.parse(text) if ended_at_stop else None
            if parsed is None or not parsed[1] or state.calling_turns >= tool_use.max_tool_turns:
                _final_turn(state, tokens, text, ended_at_stop)
            else:
                calling.append((index, tokens, text, parsed[0], parsed[1]))
        # 3) run every call of the batch at once; the results become tool turns, rendered by the template
        results = iter(tool_use.runner.run_many([(call.name, call.arguments) for *_, calls in calling
                                                 for call in calls]))
        active = []
        for index, tokens, text, content, calls in calling:
            state = states[index]
            # The turn in the shapes the template renders as meant: the rule training data and the API share.
            content, shaped = template_call_turn(content, [
                {"type": "function", "id": call.id, "function": {"name": call.name, "arguments": call.arguments}}
                for call in calls], message_conventions(tool_use.template))
            answers = [{"role": "tool", "tool_call_id": call.id, "name": call.name, "content": next(results).text}
                       for call in calls]
            state.calls += len(calls)
            kept = _append_turns(state, tokens, [{"role": "assistant", "content": content, "tool_calls": shaped},
                                                 *answers], tool_use, tokenizer)
            if kept is None:  # the render re-tokenizes the prompt's end: the row ends with this turn
                _final_turn(state, tokens, text, True)
                unrendered += 1
                continue
            rewritten += not kept
            state.calling_turns += 1
            active.append(index)
        # 4) the next turn of the rows that called tools, sampled after the rendered conversation
        if active:
            turns = next_turns([states[i].ids for i in active], 1)
    tool_stats = tool_use.runner.pop_stats()
    stats = {
        "tools/calls_per_rollout": sum(s.calls for s in states) / len(states),
        "tools/rollouts_with_calls": sum(s.calls > 0 for s in states) / len(states),
        "tools/errors": tool_stats["errors"], "tools/timeouts": tool_stats["timeouts"],
        "tools/rewritten_calls": rewritten, "tools/unrendered_calls": unrendered,
    }
    device = next(model.parameters()).device
    return ToolRollout(_as_rollout(states, pad_id, group_size, device), [s.exchange for s in states], stats)


def held_out_tool_answers(model, tokenizer, tool_use: ToolUse, rows, stop_ids: list[int], max_new_tokens: int,
                          batch_size: int) -> tuple[list[Prediction], float]:
    """Greedy tool-using answers to canonical rows (the held-out check of a run with tools): their final answers as
    predictions, and the tool calls per answer."""
    encode = PromptEncoder(tokenizer, tool_use.template, tool_use.template_vars, tuple(tool_use.runner.schemas))
    encoded = [encode(row) for row in rows]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    predictions, calls = [], 0.0
    for start in range(0, len(encoded), batch_size):
        chunk = encoded[start : start + batch_size]
        result = tool_rollout(model, tokenizer, tool_use, chunk, stop_ids, max_new_tokens, 1.0, pad_id, 1, greedy=True)
        calls += result.stats["tools/calls_per_rollout"] * len(chunk)
        predictions += [Prediction(row["prompt"], row["reference"], answer)
                        for row, answer in zip(chunk, result.rollout.completions)]
    return predictions, calls / max(len(encoded), 1)


def _parsed_tools(column: str) -> list[dict] | None:
    return json.loads(column) if column else None


def _sampled_turns(rollout: Rollout) -> list[list[int]]:
    """Each row's sampled tokens through its stop token (or all of them, when cut by max_new_tokens)."""
    lengths = rollout.completion_mask.sum(dim=1).long().tolist()
    completions = rollout.input_ids[:, rollout.prompt_width:].tolist()
    return [row[:n] for row, n in zip(completions, lengths)]


@torch.no_grad()
def _greedy_turns(model, prompt_ids: list[list[int]], stop_ids: list[int], max_new_tokens: int,
                  pad_id: int) -> list[list[int]]:
    """Each prompt's greedy continuation through its stop token (infer/generate.py's decoding)."""
    prompts, mask = left_pad(prompt_ids, pad_id, next(model.parameters()).device)
    output = model.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                            eos_token_id=stop_ids, pad_token_id=pad_id)
    turns = []
    for row in output[:, prompts.shape[1]:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in stop_ids), len(row))
        turns.append(row[:cut])
    return turns


def _final_turn(state: _Row, tokens: list[int], text: str, finished: bool) -> None:
    """The turn that ends the row: the policy's tokens as sampled, all trained."""
    state.ids += tokens
    state.own += [1] * len(tokens)
    state.exchange.append({"role": "assistant", "content": text})
    state.answer, state.finished = text, finished


def _append_turns(state: _Row, sampled: list[int], turns: list[dict], tool_use: ToolUse, tokenizer) -> bool | None:
    """Render the conversation with `turns` (the assistant's calls and the results) and the generation prompt; its
    ids become the row's. Of the policy's tokens, those the render keeps in place train (they are what it sampled,
    after what it saw); from the first token the render writes otherwise on, everything is masked. True when the
    whole sampled turn was kept; None (the row unchanged) when the render does not even keep the prompt's ids (a
    token merged across the prompt's end)."""
    text = tool_use.render(state.messages + turns, state.tools)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    had = state.ids + sampled
    common = next((i for i, (a, b) in enumerate(zip(ids, had)) if a != b), min(len(ids), len(had)))
    if common < state.prompt_length:
        return None
    state.messages += turns
    state.exchange += turns
    own = state.own + [1] * len(sampled)
    state.own = own[: common - state.prompt_length] + [0] * (len(ids) - common)
    state.ids = ids
    return common >= len(had)


def _as_rollout(states: list[_Row], pad_id: int, group_size: int, device) -> Rollout:
    """The rows as one Rollout: prompts left-padded to one width, completions right-padded; the completion mask is 1
    on the policy's own tokens only, the attention mask on every real token."""
    prompts, prompt_mask = left_pad([s.ids[: s.prompt_length] for s in states], pad_id, device)
    width = max(len(s.ids) - s.prompt_length for s in states)
    completion = [s.ids[s.prompt_length:] for s in states]
    ids = torch.tensor([c + [pad_id] * (width - len(c)) for c in completion], device=device, dtype=prompts.dtype)
    real = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in completion], device=device,
                        dtype=prompt_mask.dtype)
    own = torch.tensor([s.own + [0] * (width - len(s.own)) for s in states], device=device, dtype=torch.float32)
    return Rollout(
        torch.cat([prompts, ids], dim=1), torch.cat([prompt_mask, real], dim=1), own, prompts.shape[1],
        [s.answer for s in states], [s.finished for s in states], group_size,
    )
