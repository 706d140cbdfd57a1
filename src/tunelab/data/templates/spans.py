"""Find the trained character span of every assistant turn, for any Jinja chat template.

The method renders prefixes of the conversation: for the assistant message at index i,
``render(messages[:i], add_generation_prompt=True)`` is the prompt and must be a prefix of
``render(messages[:i+1])``, which must be a prefix of the full render; the difference, less trailing
whitespace, is the trained span. Two template habits are tolerated because they stay sound:

* an end-of-conversation eos (Phi-3.5, InternLM2 append ``eos_token`` only after the last turn): the
  turn ends where its render and the full render part, provided all they disagree on is eos/whitespace;
* a generation prompt the finished turn does not repeat (DeepSeek-R1 prompts ``<think>\\n``): the
  turn starts after the header both share, found with a probe content that cannot match any text.

bos/eos are rendered as private-use marker characters while searching, so an eos can never be
confused with the template's own text that happens to start the same way (``<|endoftext|>`` vs
``<|user|>``); positions are then mapped back onto the real render.

A template that rewrites earlier turns once later ones follow (Qwen3 drops old reasoning, Mistral-Nemo
writes the system prompt only into a final user turn) fails the prefix property: that raises
``HistoryRewriteError``, and callers encode such a conversation one answer at a time with
``answer_example``: the prompt the model is given for that answer, then the answer as rendered.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tunelab.errors import TemplateError

# (messages, add_generation_prompt, bos_token, eos_token) -> rendered text
RenderFn = Callable[[Sequence[dict[str, Any]], bool, str, str], str]

_BOS_MARK = "\ue000"
_EOS_MARK = "\ue001"
_PROBE = "\ue002"  # stands in for content; shares no character with any template text
_SHOWN = 32  # characters of each side an error shows


class HistoryRewriteError(TemplateError):
    """The template renders an earlier turn differently once later turns follow (no prefix property)."""


def assistant_spans(
    render: RenderFn,
    messages: Sequence[dict[str, Any]],
    bos_token: str,
    eos_token: str,
    name: str,
    last_only: bool = False,
) -> tuple[str, list[tuple[int, int]]]:
    """Return the full render and the (start, end) character span of each assistant turn, in order.

    ``last_only``: only the last assistant turn's span. When the conversation ends with that turn, this
    holds for history-rewriting templates too: nothing after it can change how it renders.
    """
    text = render(messages, False, bos_token, eos_token)
    turns = [i for i, message in enumerate(messages) if message.get("role") == "assistant"]
    if not turns:
        return text, []
    if turns[0] == 0:
        raise TemplateError(
            f"chat template '{name}': the conversation starts with an assistant message, so that turn has no "
            "prompt; start with a user (or system) message"
        )
    marked = _marked_render(render, messages, text, bos_token, eos_token)
    domain, bos, eos = (marked, _BOS_MARK, _EOS_MARK) if marked is not None else (text, bos_token, eos_token)

    spans: list[tuple[int, int]] = []
    for i in turns[-1:] if last_only else turns:
        start, end = _turn_span(render, messages, i, domain, bos, eos, name)
        if marked is not None:
            start, end = _to_real(marked, start, bos_token, eos_token), _to_real(marked, end, bos_token, eos_token)
        while end > start and text[end - 1].isspace():
            end -= 1
        if spans and start < spans[-1][1]:
            raise HistoryRewriteError(
                f"chat template '{name}': assistant message {i} overlaps the previous one in the render; "
                "the template cannot be masked by prefix rendering"
            )
        spans.append((start, end))
    return text, spans


def answer_example(
    render: RenderFn, messages: Sequence[dict[str, Any]], bos_token: str, eos_token: str, name: str
) -> tuple[str, tuple[int, int]]:
    """For a conversation ending with an answer: the text that trains that answer, and the answer's span.

    Normally the conversation's own render (nothing follows the answer, so no later turn can rewrite it).
    A template may still render the history differently once the answer follows (Mistral-Nemo writes the
    system prompt only while a user turn is last): the text is then the generation prompt the model is given,
    followed by the answer as the template writes it — exactly what the model sees when it generates it.
    """
    try:
        text, spans = assistant_spans(render, messages, bos_token, eos_token, name, last_only=True)
        return text, spans[0]
    except HistoryRewriteError:
        pass
    i = len(messages) - 1
    prompt = render(messages[:i], True, bos_token, eos_token)
    base = render(messages[:i], False, bos_token, eos_token)
    upto = render(messages, False, bos_token, eos_token)
    # A plain probe answer (no tool calls) shows where the template starts writing an answer's text.
    probe = render([*messages[:i], {"role": "assistant", "content": _PROBE}], False, bos_token, eos_token)
    start = _common_prefix_len(upto, probe)
    generation = prompt[len(base) :] if prompt.startswith(base) else None
    if generation is None or not probe.startswith(_PROBE, start) or not upto[:start].endswith(generation):
        at = _common_prefix_len(prompt, upto)
        raise TemplateError(
            f"chat template '{name}' writes message {i} (an answer) after other text than the prompt the model is given "
            f"to generate it (from character {at}: prompt {prompt[at : at + _SHOWN]!r}, conversation "
            f"{upto[at : at + _SHOWN]!r}), so it cannot train as it is generated; remove that turn and the ones after "
            "it, or use another template"
        )
    answer = upto[start:]
    return prompt + answer, (len(prompt), len(prompt) + len(answer.rstrip()))


def _marked_render(
    render: RenderFn, messages: Sequence[dict[str, Any]], text: str, bos_token: str, eos_token: str
) -> str | None:
    # Usable only if the template treats bos/eos as opaque text: markers swapped back must give the real render.
    if any(mark in token for token in (bos_token, eos_token) for mark in (_BOS_MARK, _EOS_MARK, _PROBE)):
        return None
    marked = render(messages, False, _BOS_MARK, _EOS_MARK)
    if marked.replace(_BOS_MARK, bos_token).replace(_EOS_MARK, eos_token) != text:
        return None
    return marked


def _to_real(marked: str, pos: int, bos_token: str, eos_token: str) -> int:
    return (
        pos
        + marked.count(_BOS_MARK, 0, pos) * (len(bos_token) - 1)
        + marked.count(_EOS_MARK, 0, pos) * (len(eos_token) - 1)
    )


def _turn_span(
    render: RenderFn, messages: Sequence[dict[str, Any]], i: int, full: str, bos: str, eos: str, name: str
) -> tuple[int, int]:
    prompt = render(messages[:i], True, bos, eos)
    # For the last turn the conversation up to it is the whole conversation: `full`, already rendered.
    upto = full if i + 1 == len(messages) else render(messages[: i + 1], False, bos, eos)
    start = len(prompt) if upto.startswith(prompt) else _shared_header_end(render, messages, i, prompt, upto, bos, eos)
    if start is None or not full.startswith(upto[:start]):
        raise _not_prefix(name, i)
    if full.startswith(upto):
        return start, len(upto)
    # The turn's own render may end with what the template writes only at the very end (an eos).
    common = _common_prefix_len(upto, full)
    if common < start or not eos or upto[common:].replace(eos, "").strip():
        raise _not_prefix(name, i)
    return start, common


def _shared_header_end(
    render: RenderFn, messages: Sequence[dict[str, Any]], i: int, prompt: str, upto: str, bos: str, eos: str
) -> int | None:
    # The generation prompt and the finished turn disagree after a shared header (e.g. "<think>\n" only in the
    # prompt). A probe content makes the split exact: it cannot continue the header by accident.
    base = render(messages[:i], False, bos, eos)
    if not (prompt.startswith(base) and upto.startswith(base)):
        return None
    probe = render([*messages[:i], {**messages[i], "content": _PROBE}], False, bos, eos)
    header_end = _common_prefix_len(prompt, probe)
    if header_end < len(base) or upto[:header_end] != probe[:header_end]:
        return None
    return header_end


def _common_prefix_len(a: str, b: str) -> int:
    # Binary search over slice comparisons: C-speed on long renders, unlike a per-character loop.
    low, high = 0, min(len(a), len(b))
    while low < high:
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low


def _not_prefix(name: str, i: int) -> HistoryRewriteError:
    return HistoryRewriteError(
        f"chat template '{name}' renders earlier turns differently once later ones follow (message {i}: the "
        "conversation up to it is not a prefix of the full render), so its trained span cannot be found; "
        "encode the conversation one answer at a time (Template.training_examples does)"
    )
