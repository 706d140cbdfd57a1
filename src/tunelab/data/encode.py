"""Canonical conversations → (input_ids, labels): the one place that decides which tokens train.

The template renders a conversation and reports the character span of every trained answer (content +
end-of-turn). The ids are then built per segment, so that for every trained answer

    ids = tokenize(prompt up to and including the generation header) + tokenize(answer + end-of-turn) + …
          ^ exactly the ids the model is given at inference          ^ exactly the ids it must produce

    text:    <|im_start|>user\\n2+2?<|im_end|>\\n<|im_start|>assistant\\n | 4<|im_end|> | \\n
    pieces:  [ prompt: tokenised alone, as the inference prompt is    ] [ answer   ] [ rest ]
    labels:  -100 ...                                                  4 <|im_end|>  -100

Tokenising the whole render at once lets a token straddle the prompt/answer seam (a byte-level BPE writes
"\\n" + "  Two" as "\\n ", " Two"): the model would train on a prompt it never sees and lose the answer's
first character. Every piece after the first is tokenised as text that follows a special token (the
tokenizer's own behaviour between two added tokens), the first one alone, as an inference prompt is.

Several trained answers in one example: answer k's prompt is the render up to it, earlier answers
included, tokenised whole at inference. That equals the pieces built so far exactly when every earlier
seam falls where the tokenizer splits anyway. Added tokens (<|im_end|>, <|eot_id|>) split the text before
anything else, so only the stretch between two added tokens around a seam can differ: it is tokenised
once whole and once cut. If they differ, the conversation is encoded as one example per answer (its exact
inference prompt + the answer), counted in ``split_at_seams``. Templates that rewrite earlier turns once
later ones follow (Qwen3, Mistral-Nemo with a system prompt) are encoded per answer the same way
(``expanded``).

Options: train_on_prompt supervises every token of the render (tokenised whole); mask_history supervises
only the last answer (its prompt, history included, is tokenised whole).

Truncation keeps answers, not the oldest turns. An example longer than cutoff_len
  1. drops whole earliest exchanges (a user turn up to the next user turn: its answers, tool calls and
     results), re-rendering what is left — the system prompt and tool definitions stay; trained answers
     lost so are counted in ``answers_dropped``;
  2. when one exchange is left, cuts the end of its user turn's content so that the answer fits whole;
  3. when the answer alone is too long, keeps the prompt and the start of the answer (a row never ends
     inside a prompt: trailing untrained tokens are removed).
An example left with no supervised token is dropped and counted, never trained on as zero loss.

Bounded work per row. The rule above keeps at most cutoff_len tokens, and of each message only a prefix of its
tokens (an exchange is dropped whole, a prompt or answer loses its end). So a message's text past its first
cutoff_len + LONG_TEXT_MARGIN tokens can never reach an example, while the message still cannot fit whole —
every decision above comes out the same. Before rendering, a message (content or reasoning) longer than
LONG_TEXT_CHARS_PER_TOKEN x (cutoff_len + margin) characters is cut there, at a word start (before " x"), if that
prefix alone already tokenises to at least cutoff_len + margin tokens (else the prefix doubles, up to the whole
text). The count comes from the tokenizer itself, not from a characters-per-token assumption: a token can cover
many characters (runs of spaces or punctuation) and one character several tokens (byte fallback, emoji), so no
fixed ratio is safe for every tokenizer. Cutting before " x" keeps the pre-tokens before the cut as the whole text
has them (regex pre-tokenizers of byte-level BPE and SentencePiece's "▁" both split there). Rows whose messages
are under the bound — every normal row — are encoded exactly as before; a cut message is counted in
``texts_cut``. One 50 MB row so costs a few cutoff lengths of tokenising, not the whole text.
"""

from __future__ import annotations

import bisect
import json
import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from transformers import PreTrainedTokenizerFast
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from tunelab.data.formats import template_messages
from tunelab.data.templates import HistoryRewriteError

if TYPE_CHECKING:
    from tunelab.data.templates import Template

IGNORE_INDEX = -100
# Bounded work per row (module docstring): tokens a cut message keeps beyond cutoff_len, and the characters per
# token the first prefix tried assumes (generous: a few per token for prose, the count decides anyway).
LONG_TEXT_MARGIN = 64
LONG_TEXT_CHARS_PER_TOKEN = 8
_WORD_START = re.compile(r"(?<=\S) (?=\S)")

Message = dict[str, Any]
Span = tuple[int, int]
# Columns an encoded example carries besides input_ids/labels, for the pipeline to sum and remove.
COUNTER_COLUMNS = (
    "truncated", "num_supervised", "expanded", "answers_dropped", "split_at_seams", "texts_cut", "rows_shortened",
)
# ... and those of examples with images (data/vision.py).
IMAGE_COUNTERS = ("num_images", "num_image_tokens", "images_dont_fit")


def as_examples(rows_shortened: int, truncated: int) -> str:
    """The examples the shortened rows make, where they are more than the rows (rows encoded one per answer)."""
    return f" as {truncated} examples, one per answer" if truncated != rows_shortened else ""


@dataclass
class EncodeStats:
    """What encoding did to a dataset, for the run log and data_report.json."""

    examples: int = 0
    truncated: int = 0  # examples shortened to fit cutoff_len (history dropped, prompt cut or answer cut)
    rows_shortened: int = 0  # ... the rows they come from: a conversation encoded per answer counts once
    answers_dropped: int = 0  # trained answers removed with the earliest turns (or cut off whole) to fit
    dropped_no_supervised: int = 0
    tokens: int = 0
    supervised_tokens: int = 0
    expanded_conversations: int = 0  # conversations encoded as one example per answer
    split_at_seams: int = 0  # ... of which because an earlier answer's seam tokenised differently
    texts_cut: int = 0  # messages cut before tokenising: far longer than cutoff_len (bounded work per row)
    images: int = 0  # vision runs (data/vision.py): images in the kept examples
    image_tokens: int = 0  # ... and their tokens
    images_dont_fit: int = 0  # ... examples dropped because an image's tokens did not fit cutoff_len

    def merge(self, other: EncodeStats) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass(frozen=True)
class _Unit:
    """A conversation (template messages) to encode as one example."""

    messages: list[Message]
    last_only: bool  # only the final answer trains (mask_history, or one answer of a split conversation)
    fixed_prompt: bool = False  # pairs: the prompt is settled, only the end may be cut
    truncated: bool = False
    answers_dropped: int = 0
    texts_cut: int = 0  # messages cut before tokenising (bounded work per row)
    split: bool = False  # one answer of a conversation split at a seam
    order: tuple[int, ...] = ()  # place among its conversation's examples


@dataclass
class _Prepared:
    """A rendered unit and the character ranges to tokenise."""

    unit: _Unit
    text: str
    spans: list[Span]  # trained character spans; None-like [] with train_on_prompt means everything trains
    pieces: list[tuple[Span, bool]]  # (range, trained), in order, covering the text
    checks: list[tuple[Span, list[Span]]] = field(default_factory=list)  # (stretch, its cut parts)


@dataclass
class _Result:
    ids: list[int]
    labels: list[int]
    answers: list[Span]  # token ranges of the trained answers
    consistent: bool


class PieceTokenizer:
    """How the encoder tokenises pieces: the first of a text alone, the others as text after a special token.

    ``sentinel`` is a special token that is one id and splits the text (the eos, else another special);
    "after a special token" is tokenising sentinel + piece and dropping that id. ``added`` finds the added
    tokens in a text: the places the tokenizer splits before anything else.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.backend = _direct_backend(tokenizer)
        self.sentinel, self.sentinel_id = self._find_sentinel()
        contents = sorted(_added_token_contents(tokenizer), key=len, reverse=True)
        self.added = re.compile("|".join(map(re.escape, contents))) if contents else None

    def _raw(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        if self.backend is not None:
            return [e.ids for e in self.backend.encode_batch_fast(texts, add_special_tokens=False)]
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def _find_sentinel(self) -> tuple[str, int | None]:
        tokenizer = self.tokenizer
        candidates = [tokenizer.eos_token, tokenizer.bos_token, tokenizer.pad_token, *tokenizer.all_special_tokens]
        for token in candidates:
            if not isinstance(token, str) or not token:
                continue
            probes = self._raw_plain([token, token + "a b", token + " "])
            if len(probes[0]) == 1 and all(p[:1] == probes[0] for p in probes):
                return token, probes[0][0]
        return "", None

    def _raw_plain(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def __call__(self, pieces: list[tuple[str, bool]]) -> list[list[int]]:
        """Ids of each (text, at_start) piece: at the start of a text alone, elsewhere after a special token."""
        if self.sentinel_id is None:
            return self._raw([text for text, _ in pieces])
        encoded = self._raw([text if at_start else self.sentinel + text for text, at_start in pieces])
        return [ids if at_start else ids[1:] for ids, (_, at_start) in zip(encoded, pieces)]

    def prefix_of(self, text: str, tokens: int, chars: int) -> str:
        """The start of `text` that tokenises (alone) to at least `tokens` tokens, cut before a word start at or
        after `chars` characters; the prefix doubles until it does, so the work is about twice that prefix's.
        `text` itself when no shorter prefix has that many tokens."""
        while chars < len(text):
            match = _WORD_START.search(text, chars)
            end = match.start() if match else chars  # one huge "word": cut where we are
            if len(self._raw([text[:end]])[0]) >= tokens:
                return text[:end]
            chars *= 2
        return text

    def offsets(self, text: str) -> list[tuple[int, int]]:
        """Character offsets of the tokens of a text on its own."""
        if self.backend is not None:
            return self.backend.encode(text, add_special_tokens=False).offsets
        return self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]

    def edges(self, text: str) -> list[int]:
        """Sorted positions where the tokenizer splits regardless of context: text ends and added tokens."""
        points = {0, len(text)}
        if self.added is not None:
            for match in self.added.finditer(text):
                points.update(match.span())
        return sorted(points)


@dataclass(frozen=True)
class SupervisedEncoder:
    """Encodes canonical rows for supervised stages. Picklable, so datasets.map can run it in workers.

    ``template_vars`` reach the template as extra variables (e.g. ``{"enable_thinking": False}``).
    Output columns besides input_ids/labels, for the pipeline to sum and remove (COUNTER_COLUMNS):
    ``truncated``, ``num_supervised``, ``answers_dropped``, and on the first kept example of a conversation
    encoded per answer ``expanded`` (how many examples it added, so dropped examples count exactly) and
    ``split_at_seams`` (1 when the split was for a seam); ``rows_shortened`` is 1 on the first kept example of a
    conversation any of whose kept examples is ``truncated``.
    """

    tokenizer: Any
    template: Template
    cutoff_len: int
    train_on_prompt: bool = False
    mask_history: bool = False
    template_vars: dict[str, Any] = field(default_factory=dict, hash=False)
    _tokens: PieceTokenizer = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self):
        object.__setattr__(self, "_tokens", PieceTokenizer(self.tokenizer))

    # ---- rendering ---------------------------------------------------------------------------------------

    def options(self, row: dict) -> dict[str, Any]:
        """The template variables one canonical row renders with."""
        tok = self.tokenizer
        return {
            "tools": parse_tools(row.get("tools") or None),
            "bos_token": tok.bos_token or "",
            "eos_token": tok.eos_token or "",
            **self.template_vars,
        }

    def examples(self, row: dict) -> list[tuple[str, list[Span]]]:
        """The (text, trained character spans) examples one canonical row renders as (before tokenising)."""
        messages, options = self.bounded(template_messages(row, self.template))[0], self.options(row)
        if self.train_on_prompt:  # every token trains, so one render of the whole conversation is all it takes
            return [(self.template.render(messages, **options), [])]
        return self.template.training_examples(messages, last_only=self.mask_history, **options)

    def _prepare(self, unit: _Unit, options: dict[str, Any]) -> list[_Prepared]:
        """The unit rendered: one prepared example, or one per answer for a template that rewrites history."""
        messages = unit.messages
        answers = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        if self.train_on_prompt or not answers:
            text = self.template.render(messages, **options)
            return [_Prepared(unit, text, [], [((0, len(text)), self.train_on_prompt)])]
        if unit.last_only:
            text, span = self.template.answer_example(messages[: answers[-1] + 1], **options)
            return [self._segmented(unit, text, [span])]
        try:
            text, spans = self.template.render_with_spans(messages, **options)
        except HistoryRewriteError:
            return [prepared for unit_i in _per_answer(unit) for prepared in self._prepare(unit_i, options)]
        return [self._segmented(unit, text, spans)]

    def _segmented(self, unit: _Unit, text: str, spans: list[Span]) -> _Prepared:
        pieces: list[tuple[Span, bool]] = []
        last = 0
        for start, end in spans:
            if start > last:
                pieces.append(((last, start), False))
            pieces.append(((start, end), True))
            last = end
        if last < len(text):
            pieces.append(((last, len(text)), False))
        return _Prepared(unit, text, spans, pieces, self._seam_checks(text, spans))

    def _seam_checks(self, text: str, spans: list[Span]) -> list[tuple[Span, list[Span]]]:
        """For each stretch between added tokens that holds a seam before a later answer's prompt ends: the
        stretch (up to that prompt's end) and its parts cut at the seams. Equal ids whole and cut ⇔ consistent."""
        if len(spans) < 2:
            return []
        edges = self._tokens.edges(text)
        seams = sorted({p for span in spans[:-1] for p in span})
        checks: dict[tuple[Span, tuple[int, ...]], None] = {}
        for k in range(1, len(spans)):
            prompt_end = spans[k][0]
            for seam in seams:
                if seam >= prompt_end:
                    break
                at = bisect.bisect_left(edges, seam)
                if edges[at] == seam:
                    continue  # already a split point
                start, end = edges[at - 1], min(edges[at], prompt_end)
                cuts = tuple(q for q in seams if start < q < end)
                checks[((start, end), cuts)] = None
        return [((start, end), _cut((start, end), cuts)) for (start, end), cuts in checks]

    # ---- tokenising ----------------------------------------------------------------------------------------

    @staticmethod
    def _strings(prepared: _Prepared) -> list[tuple[str, bool]]:
        text = prepared.text
        ranges = [span for span, _ in prepared.pieces]
        for whole, parts in prepared.checks:
            ranges += [whole, *parts]
        return [(text[start:end], start == 0) for start, end in ranges]

    @staticmethod
    def _finish(prepared: _Prepared, tokens: list[list[int]]) -> _Result:
        ids: list[int] = []
        labels: list[int] = []
        answers: list[Span] = []
        for (_, trained), piece in zip(prepared.pieces, tokens):
            if trained:
                answers.append((len(ids), len(ids) + len(piece)))
            ids += piece
            labels += piece if trained else [IGNORE_INDEX] * len(piece)
        consistent, at = True, len(prepared.pieces)
        for _, parts in prepared.checks:
            whole = tokens[at]
            cut = [token for part in tokens[at + 1 : at + 1 + len(parts)] for token in part]
            consistent = consistent and whole == cut
            at += 1 + len(parts)
        return _Result(ids, labels, answers, consistent)

    def _encode(self, units: list[tuple[_Unit, dict[str, Any]]]) -> list[list[dict[str, Any]]]:
        """Each unit's examples, in rounds: every unit of a round rendered, then tokenised in one call; the units
        that must be encoded again (split at a seam, shortened to fit) make the next round."""
        out: list[list[tuple[tuple[int, ...], dict[str, Any]]]] = [[] for _ in units]
        pending = [(i, unit, options) for i, (unit, options) in enumerate(units)]
        while pending:
            prepared = [(i, p, options) for i, unit, options in pending for p in self._prepare(unit, options)]
            strings = [self._strings(p) for _, p, _ in prepared]
            tokens = self._tokens([s for group in strings for s in group])
            pending, at = [], 0
            for (i, p, options), group in zip(prepared, strings):
                result = self._finish(p, tokens[at : at + len(group)])
                at += len(group)
                done, again = self._settle(p, result, options)
                out[i] += [(p.unit.order, example) for example in done]
                pending += [(i, unit, options) for unit in again]
        return [[example for _, example in sorted(examples, key=lambda pair: pair[0])] for examples in out]

    # ---- consistency and length ------------------------------------------------------------------------

    def _settle(
        self, prepared: _Prepared, result: _Result, options: dict[str, Any]
    ) -> tuple[list[dict[str, Any]], list[_Unit]]:
        """(finished examples, units to encode again) of one prepared unit: split per answer at a seam that
        tokenises differently, fitted to cutoff_len."""
        unit = prepared.unit
        if not result.consistent:
            return [], [replace(u, split=True) for u in _per_answer(unit)]
        if len(result.ids) > self.cutoff_len:
            return self._fit(prepared, result, options)
        return [self._example(unit, result)], []

    def _example(self, unit: _Unit, result: _Result) -> dict[str, Any]:
        labels = result.labels
        return {
            "input_ids": result.ids, "labels": labels, "truncated": unit.truncated or unit.texts_cut > 0,
            "num_supervised": len(labels) - 1 - labels[1:].count(IGNORE_INDEX),
            "answers_dropped": unit.answers_dropped, "texts_cut": unit.texts_cut, "rows_shortened": 0,
            "_messages": unit.messages,
            "_split": unit.split,
        }

    def bounded(self, messages: list[Message]) -> tuple[list[Message], int]:
        """The messages with every text far longer than any example can hold cut before tokenising (module
        docstring, "Bounded work per row"), and how many were cut. Normal rows come back as they are."""
        keep = self.cutoff_len + LONG_TEXT_MARGIN
        chars = LONG_TEXT_CHARS_PER_TOKEN * keep
        out, cut = [], 0
        for message in messages:
            for key in ("content", "reasoning_content"):
                text = message.get(key)
                if isinstance(text, str) and len(text) > chars:
                    shorter = self._tokens.prefix_of(text, keep, chars)
                    if len(shorter) < len(text):
                        message, cut = {**message, key: shorter}, cut + 1
            out.append(message)
        return (out, cut) if cut else (messages, 0)

    def _fit(
        self, prepared: _Prepared, result: _Result, options: dict[str, Any]
    ) -> tuple[list[dict[str, Any]], list[_Unit]]:
        """An example longer than cutoff_len: drop earliest exchanges, then cut the oldest prompt, then the end."""
        unit = prepared.unit
        if not self.train_on_prompt and not unit.fixed_prompt:
            starts = _exchange_starts(unit.messages)
            if starts:
                keep = self._exchanges_to_keep(unit, starts, options)
                head = _system_head(unit.messages)
                dropped = unit.messages[len(head) : starts[keep]]
                trained = 0 if unit.last_only else sum(m.get("role") == "assistant" for m in dropped)
                shorter = replace(
                    unit, messages=[*head, *unit.messages[starts[keep] :]], truncated=True,
                    answers_dropped=unit.answers_dropped + trained,
                )
                return [], [shorter]
            cut = self._cut_prompt(unit, len(result.ids) - self.cutoff_len)
            if cut is not None:
                return [], [cut]
        return self._cut_end(unit, result), []

    def _exchanges_to_keep(self, unit: _Unit, starts: list[int], options: dict[str, Any]) -> int:
        """Index into ``starts``: the fewest exchanges to drop so that the whole render fits (binary search on
        its length; the last exchange always stays)."""
        head = _system_head(unit.messages)

        def length(k: int) -> int:
            messages = [*head, *unit.messages[starts[k] :]]
            return len(self._tokens([(self.template.render(messages, **options), True)])[0])

        low, high = 0, len(starts) - 1
        while low < high:
            mid = (low + high) // 2
            if length(mid) <= self.cutoff_len:
                high = mid
            else:
                low = mid + 1
        return low

    def _cut_prompt(self, unit: _Unit, excess: int) -> _Unit | None:
        """The unit with the end of its first user turn's content cut by ``excess`` tokens (+ what re-rendering
        costs), or None when that turn cannot absorb it (the answer alone is too long) or has no text."""
        head = _system_head(unit.messages)
        at = len(head)
        if at >= len(unit.messages) or unit.messages[at].get("role") != "user":
            return None
        content = unit.messages[at].get("content")
        if not isinstance(content, str) or not content:
            return None
        offsets = self._tokens.offsets(content)
        keep = len(offsets) - excess
        if keep < 1:
            return None
        shorter = content[: offsets[keep][0]] if keep < len(offsets) else content
        if shorter == content:
            return None
        messages = list(unit.messages)
        messages[at] = {**messages[at], "content": shorter}
        return replace(unit, messages=messages, truncated=True)

    def _cut_end(self, unit: _Unit, result: _Result) -> list[dict]:
        """Keep the first cutoff_len tokens, less any untrained tail (a row never ends inside a prompt).

        Answers that start past the cut are lost (their prompt alone fills cutoff_len): the example's messages
        then end with the last answer it holds, the conversation its ids are the render of."""
        ids, labels = result.ids[: self.cutoff_len], result.labels[: self.cutoff_len]
        end = len(labels)
        while end > 0 and labels[end - 1] == IGNORE_INDEX:
            end -= 1
        if end == 0 or self.train_on_prompt:
            end = len(ids)
        lost = 0 if unit.last_only else sum(start >= end for start, _ in result.answers)
        kept = replace(unit, truncated=True, answers_dropped=unit.answers_dropped + lost)
        if lost and lost < len(result.answers):
            answers = [i for i, m in enumerate(unit.messages) if m.get("role") == "assistant"]
            last = answers[len(result.answers) - lost - 1]
            kept = replace(kept, messages=unit.messages[: last + 1])
        # Kept even with no supervised token left: encode_conversations counts it among the conversation's examples
        # (so a lost answer of a conversation encoded per answer is counted) and then leaves it out.
        return [self._example(kept, _Result(ids[:end], labels[:end], [], True))]

    # ---- rows -------------------------------------------------------------------------------------------------

    def encode_conversations(
        self, conversations: list[tuple[list[Message], dict[str, Any]]], fixed_prompt: bool = False
    ) -> list[list[dict[str, Any]]]:
        """Each (template messages, options) conversation's kept examples (see ``encode_rows``).

        ``fixed_prompt``: the prompt is settled (the other side of a pair): only the end may be cut.
        """
        units = []
        for messages, options in conversations:
            messages, cut = self.bounded(messages)
            units.append((_Unit(messages, last_only=self.mask_history, fixed_prompt=fixed_prompt, texts_cut=cut), options))
        out = []
        for examples in self._encode(units):
            kept = [e for e in examples if e["num_supervised"] > 0]
            if kept:
                kept[0]["expanded"] = len(examples) - 1
                kept[0]["split_at_seams"] = int(any(e["_split"] for e in examples))
                kept[0]["rows_shortened"] = int(any(e["truncated"] for e in kept))
                for e in kept[1:]:
                    e["expanded"] = e["split_at_seams"] = e["texts_cut"] = 0  # a conversation's cuts count once
                if len(examples) > 1:  # each per-answer example carries what its conversation lost once
                    kept[0]["answers_dropped"] = sum(e["answers_dropped"] for e in examples)
                    for e in kept[1:]:
                        e["answers_dropped"] = 0
            out.append(kept)
        return out

    def encode_rows(self, rows: list[dict]) -> list[list[dict[str, Any]]]:
        """Each canonical row's kept examples: dicts of input_ids, labels and COUNTER_COLUMNS (plus the internal
        ``_messages`` the example was rendered from). A row whose every example lost its supervised tokens gets
        an empty list (pairwise data drops the whole pair then; see data/pairwise.py)."""
        return self.encode_conversations([(template_messages(row, self.template), self.options(row)) for row in rows])

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        """Batched datasets.map function: rows in, encoded examples out (dropped examples removed)."""
        columns = list(batch)  # datasets' lazy batch: read each column once, not once per row
        rows = [dict(zip(columns, values)) for values in zip(*(batch[c] for c in columns))]
        keys = ("input_ids", "labels", *COUNTER_COLUMNS)
        out: dict[str, list] = {key: [] for key in keys}
        for kept in self.encode_rows(rows):
            for example in kept:
                for key in keys:
                    out[key].append(example[key])
        return out


def _per_answer(unit: _Unit) -> list[_Unit]:
    """One unit per answer: the conversation up to it, training only it. What the unit lost to truncation
    stays with the first, so a split conversation counts it once."""
    answers = [i for i, m in enumerate(unit.messages) if m.get("role") == "assistant"]
    return [
        replace(unit, messages=unit.messages[: i + 1], last_only=True, order=(*unit.order, k),
                answers_dropped=unit.answers_dropped if k == 0 else 0)
        for k, i in enumerate(answers)
    ]


def _cut(span: Span, cuts: tuple[int, ...]) -> list[Span]:
    points = [span[0], *cuts, span[1]]
    return list(zip(points, points[1:]))


def _system_head(messages: list[Message]) -> list[Message]:
    """The leading system messages: kept whatever is dropped to fit cutoff_len."""
    at = 0
    while at < len(messages) and messages[at].get("role") == "system":
        at += 1
    return messages[:at]


def _exchange_starts(messages: list[Message]) -> list[int]:
    """Indices of the user turns after the first (where a droppable run of earliest exchanges may end),
    those before the conversation's last assistant turn."""
    last_answer = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
    users = [i for i, m in enumerate(messages) if m.get("role") == "user" and i < last_answer]
    return users[1:]


def _added_token_contents(tokenizer: Any) -> list[str]:
    """The added tokens the tokenizer splits out before anything else (special ones unless told not to)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    split_special = bool(getattr(tokenizer, "split_special_tokens", False))
    return [t.content for t in decoder.values() if t.content and not (split_special and t.special)]


def _direct_backend(tokenizer: Any) -> Any:
    """The Rust backend when it encodes as ``tokenizer(...)`` does, else None: a fast tokenizer whose class keeps
    transformers' encoding path, and a backend left without truncation or padding (``tokenizer(...)`` would
    switch them off) and splitting special tokens as the tokenizer asks (it would set that too). Calling it
    directly skips transformers' per-encoding conversion to Python (about a tenth of the tokenising time)."""
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


def parse_tools(tools: str | None) -> list[Any] | None:
    """A row's `tools` column (JSON text) as the list of tool definitions a template renders; None when absent or
    unreadable."""
    if not tools:
        return None
    try:
        parsed = json.loads(tools)
    except json.JSONDecodeError:
        return None
    return parsed if isinstance(parsed, list) else [parsed]


def supervised_runs(labels: list[int]) -> list[Span]:
    """Token ranges of the maximal runs of supervised labels."""
    runs, start = [], None
    for i, label in enumerate(labels):
        if label != IGNORE_INDEX and start is None:
            start = i
        elif label == IGNORE_INDEX and start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(labels)))
    return runs


def inference_mismatch(encoder: SupervisedEncoder, example: dict[str, Any], options: dict[str, Any]) -> str | None:
    """How an encoded example (from ``encode_rows``) breaks the train/inference guarantee, or None.

    Brute force, independent of how the ids were built (``tunelab data verify``, the tests): for each trained
    answer, the render of the conversation before it up to the generation header, tokenised alone as an
    inference prompt is, must be exactly the ids in front of it, and the supervised ids that follow must be
    the answer's own (+ end-of-turn; only the last may be cut short by truncation).
    """
    if encoder.train_on_prompt:
        return None  # everything trains: there is no prompt/answer seam
    messages, ids, labels = example["_messages"], example["input_ids"], example["labels"]
    answers = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    runs = supervised_runs(labels)
    if not runs or len(runs) > len(answers):
        return f"{len(runs)} supervised runs for {len(answers)} answers"
    if len(runs) == 1:
        text, span = encoder.template.answer_example(messages[: answers[-1] + 1], **options)
        spans = [span]
    else:
        text, spans = encoder.template.render_with_spans(messages, **options)
    for number, ((start, end), (span_start, span_end)) in enumerate(zip(runs, spans, strict=True), 1):
        prompt, answer = encoder._tokens([(text[:span_start], True), (text[span_start:span_end], span_start == 0)])
        if ids[:start] != prompt:
            return (f"answer {number}: the ids before it are not the tokenised prompt ({len(prompt)} prompt tokens, "
                    f"{start} ids; first difference at {_first_difference(ids[:start], prompt)})")
        cut_short = end == len(ids) and end - start < len(answer)
        if ids[start:end] != answer[: end - start] or (end - start != len(answer) and not cut_short):
            return f"answer {number}: the supervised ids are not the answer's own ids"
    if ids[end:] and ids[end:] != encoder._tokens([(text[span_end:], False)])[0]:
        return "the ids after the last answer are not the template's closing text (a row must not end in a prompt)"
    return None


def encoded_row_problem(encoder: SupervisedEncoder, row: dict) -> str | None:
    """Everything ``tunelab data verify`` checks about how one canonical row encodes, first problem or None:
    each example within cutoff_len; every trained answer after its exact inference prompt, as its own ids
    (``inference_mismatch``); each whole answer ending with the template's end-of-turn token; the
    conversation's last answer kept (truncation drops the earliest turns first), unless its prompt alone, every
    earlier exchange dropped, fills cutoff_len (then the row ends with the last answer before it that fits)."""
    options = encoder.options(row)
    examples = encoder.encode_rows([row])[0]
    marker = encoder.template.stop_words[0] if encoder.template.stop_words else ""
    marker_ids = encoder.tokenizer(marker, add_special_tokens=False)["input_ids"] if marker else []
    for number, example in enumerate(examples, 1):
        where = f"example {number}" if len(examples) > 1 else "example"
        if len(example["input_ids"]) > encoder.cutoff_len:
            return f"{where}: {len(example['input_ids'])} tokens > cutoff_len {encoder.cutoff_len}"
        problem = inference_mismatch(encoder, example, options)
        if problem:
            return f"{where}: {problem}"
        if len(marker_ids) == 1 and not encoder.train_on_prompt:
            runs = supervised_runs(example["labels"])
            whole = runs if runs[-1][1] < len(example["input_ids"]) or not example["truncated"] else runs[:-1]
            for start, end in whole:
                text = encoder.tokenizer.decode(example["input_ids"][start:end])
                if text.endswith(marker) and example["input_ids"][end - 1] != marker_ids[0]:
                    return f"{where}: an answer ends with the text of {marker!r} but not with its token"
    messages = encoder.bounded(template_messages(row, encoder.template))[0]
    answers = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not (examples and answers) or examples[-1]["_messages"][-1] == messages[answers[-1]]:
        return None
    # Truncation loses the last answer only where its shortest prompt (the system turns and the answer's own
    # exchange: every earlier one dropped) alone fills cutoff_len, so that nothing of the answer could follow it.
    last = answers[-1]
    start = max(i for i in range(last) if messages[i].get("role") == "user")
    shortest = [*_system_head(messages), *messages[start:last]]
    prompt = encoder.template.render(shortest, add_generation_prompt=True, **options)
    size = len(encoder._tokens([(prompt, True)])[0])
    if size < encoder.cutoff_len:
        return (f"the conversation's last answer is not kept, although its prompt with the earlier exchanges dropped "
                f"({size} tokens) fits cutoff_len {encoder.cutoff_len}")
    return None


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
