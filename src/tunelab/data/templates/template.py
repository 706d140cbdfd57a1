"""The ``Template`` value: a Jinja chat-template source plus the stop words generation must end at.

Owns rendering a conversation (training text, inference prompt), the per-turn trained spans, the
training examples a conversation becomes (one, or one per answer for templates that rewrite history),
and deriving stop words generically from a probe conversation. Works the same for built-in templates
and for a tokenizer's own ``chat_template``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tunelab.data.templates.builtin import BUILTIN_NAMES
from tunelab.data.templates.engine import check_source, render_source
from tunelab.data.templates.spans import HistoryRewriteError, answer_example, assistant_spans
from tunelab.errors import TemplateError

Message = dict[str, Any]
Span = tuple[int, int]
Example = tuple[str, list[Span]]  # a training text and the character spans that train in it

_PROBE_CONTENT = "PROBE"  # no whitespace, so a template's trim/strip cannot move it


@dataclass(frozen=True)
class Template:
    """A chat template: ``jinja`` is saved as the trained model's ``chat_template``."""

    name: str
    jinja: str
    stop_words: tuple[str, ...] = ()

    @classmethod
    def from_jinja(
        cls,
        name: str,
        jinja: str,
        stop_words: Sequence[str] | None = None,
        bos_token: str = "",
        eos_token: str = "",
    ) -> Template:
        """Build a template from source; stop words are derived from a probe render unless given."""
        check_source(name, jinja)  # fail early on bad syntax, and warm the cache
        template = cls(name=name, jinja=jinja)
        words = tuple(stop_words) if stop_words is not None else template._derive_stop_words(bos_token, eos_token)
        return cls(name=name, jinja=jinja, stop_words=words)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, name: str = "model") -> Template:
        """The tokenizer's own ``chat_template`` (a dict of named templates → its ``default`` one)."""
        source = tokenizer_source(tokenizer)
        if source is None:
            raise TemplateError(
                f"template: the tokenizer has no chat_template; set template to one of {', '.join(BUILTIN_NAMES)}"
            )
        bos, eos = special_token(tokenizer, "bos_token"), special_token(tokenizer, "eos_token")
        return cls.from_jinja(name, source, bos_token=bos, eos_token=eos)

    def render(
        self,
        messages: Sequence[Message],
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        bos_token: str = "",
        eos_token: str = "",
        **kwargs: Any,
    ) -> str:
        """Render like ``tokenizer.apply_chat_template(..., tokenize=False)`` with the same variables."""
        context = {
            "documents": None,
            **kwargs,
            "messages": list(messages),
            "tools": list(tools) if tools is not None else None,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": bos_token,
            "eos_token": eos_token,
        }
        return render_source(self.name, self.jinja, context)

    def render_with_spans(
        self,
        messages: Sequence[Message],
        tools: Sequence[dict[str, Any]] | None = None,
        bos_token: str = "",
        eos_token: str = "",
        **kwargs: Any,
    ) -> tuple[str, list[tuple[int, int]]]:
        """Full training text and the (start, end) character span of each assistant turn's trained part.

        Raises ``HistoryRewriteError`` when the template renders an earlier turn differently once later turns
        follow; ``training_examples`` handles that case by encoding one answer at a time.
        """

        def render(part: Sequence[Message], add_generation_prompt: bool, bos: str, eos: str) -> str:
            return self.render(part, tools, add_generation_prompt, bos, eos, **kwargs)

        return assistant_spans(render, messages, bos_token, eos_token, self.name)

    def training_examples(
        self,
        messages: Sequence[Message],
        tools: Sequence[dict[str, Any]] | None = None,
        bos_token: str = "",
        eos_token: str = "",
        last_only: bool = False,
        **kwargs: Any,
    ) -> list[Example]:
        """The (text, trained spans) examples a conversation trains as, each rendered by this template.

        Normally one example: the full render with every answer's span (``last_only``: the last answer's).
        A template that renders earlier turns differently once later ones follow (Qwen3 drops old
        reasoning, Mistral-Nemo moves the system prompt) gives one example per answer instead: the
        conversation up to answer i as the template renders it at that point (the generation prompt for
        answer i, then answer i), training only answer i — what the model sees when it generates it.
        ``last_only`` then keeps the last.
        """
        answers = [i for i, message in enumerate(messages) if message.get("role") == "assistant"]

        def upto(i: int) -> Example:
            text, span = self.answer_example(messages[: i + 1], tools, bos_token, eos_token, **kwargs)
            return text, [span]

        if not answers:
            return [(self.render(messages, tools, False, bos_token, eos_token, **kwargs), [])]
        if last_only:
            return [upto(answers[-1])]
        try:
            return [self.render_with_spans(messages, tools, bos_token, eos_token, **kwargs)]
        except HistoryRewriteError:
            return [upto(i) for i in answers]

    def answer_example(
        self,
        messages: Sequence[Message],
        tools: Sequence[dict[str, Any]] | None = None,
        bos_token: str = "",
        eos_token: str = "",
        **kwargs: Any,
    ) -> tuple[str, Span]:
        """For a conversation ending with an answer: the text that trains only that answer, and its span.

        The conversation's own render; for a template that rewrites the history once the answer follows, the
        generation prompt the model is given followed by the answer (spans.answer_example).
        """

        def render(part: Sequence[Message], add_generation_prompt: bool, bos: str, eos: str) -> str:
            return self.render(part, tools, add_generation_prompt, bos, eos, **kwargs)

        return answer_example(render, messages, bos_token, eos_token, self.name)

    def prompt(
        self,
        messages: Sequence[Message],
        tools: Sequence[dict[str, Any]] | None = None,
        bos_token: str = "",
        eos_token: str = "",
        **kwargs: Any,
    ) -> str:
        """Inference prompt: the conversation so far plus the generation prompt for the next answer."""
        if not messages or messages[-1].get("role") not in ("user", "tool"):
            last = messages[-1].get("role") if messages else "nothing"
            raise TemplateError(
                f"chat template '{self.name}': a prompt must end with a user or tool message, got {last}; "
                "drop the trailing messages the model should generate"
            )
        return self.render(messages, tools, True, bos_token, eos_token, **kwargs)

    def _derive_stop_words(self, bos_token: str, eos_token: str) -> tuple[str, ...]:
        # What the template writes right after an answer is its end-of-turn. Prefer a non-final turn: some
        # templates add an eos only after the last one. Fall back to one turn for templates that rewrite history.
        probes = (
            [_user("Hi"), _assistant(), _user("Hi"), _assistant()],
            [_user("Hi"), _assistant()],
        )
        for probe in probes:
            try:
                text, spans = self.render_with_spans(probe, bos_token=bos_token, eos_token=eos_token)
            except TemplateError:
                continue
            trained = text[spans[0][0] : spans[0][1]]
            at = trained.rfind(_PROBE_CONTENT)
            if at < 0:
                return ()
            tail = trained[at + len(_PROBE_CONTENT) :].split()
            return (tail[0],) if tail else ()
        return ()


def _user(content: str) -> Message:
    return {"role": "user", "content": content}


def _assistant() -> Message:
    return {"role": "assistant", "content": _PROBE_CONTENT}


def tokenizer_source(tokenizer: Any) -> str | None:
    """A tokenizer's ``chat_template`` text (a dict of named templates → its ``default`` one), or None."""
    source = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if isinstance(source, dict):
        source = source.get("default")
    return source if isinstance(source, str) and source else None


def special_token(tokenizer: Any, attr: str) -> str:
    """A tokenizer's special token as text ("" when there is no tokenizer or no such token)."""
    value = getattr(tokenizer, attr, None) if tokenizer is not None else None
    return value if isinstance(value, str) else ""


_MARKUP = re.compile(r"^(<[^<>\s]+>|\[[^\[\]\s]+\])$")  # looks like a special token: <|eot_id|>, </s>, [/INST]


def split_end_of_turn_markers(template: Template, tokenizer: Any) -> list[tuple[str, int]]:
    """The template's end-of-turn markers that look like special tokens but are several tokens of this tokenizer,
    with their token counts. The first marker ends every answer; others end special turns (Llama-3.1's
    <|eom_id|> after a built-in tool call). Such a marker would be trained as plain text, and generation, which
    stops on single token ids, could never end a turn on it."""
    split = []
    for word in template.stop_words:
        if _MARKUP.match(word):  # a plain-text marker (a custom format) is text by design: stop strings handle it
            ids = tokenizer(word, add_special_tokens=False)["input_ids"]
            if len(ids) != 1:
                split.append((word, len(ids)))
    return split


def end_of_turn_message(template: Template, word: str, count: int) -> str:
    return (
        f"template '{template.name}' ends answers with {word!r}, which this tokenizer splits into {count} tokens, so "
        "the model could never stop on it; use the tokenizer's own template (template: model) or the one of the "
        f"model's family, or add the marker as a token (add_special_tokens: {word})"
    )
