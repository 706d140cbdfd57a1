"""Trained spans found by prefix rendering, for every built-in and for templates where the method must refuse.

Each assistant turn's span must be exactly its answer plus the family's end-of-turn text; a template that
renders history differently once later turns follow must raise HistoryRewriteError instead of guessing
(encoding then splits the conversation per answer: test_template_expansion.py). The token-level tests
tokenize our render and the official one with a tiny byte-level tokenizer that knows the family's special
tokens, and check the trained tokens decode to exactly the expected spans. ``family_tokenizer`` is shared
with the other token-level test modules.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tests.official import family_facts, official_render, special_tokens
from tunelab.data.templates import TEMPLATE_NAMES, HistoryRewriteError, Template, get_template
from tunelab.errors import TemplateError

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
EXCHANGES = [
    ("Hello! Who are you?", "I am an AI assistant."),
    ("  What is 2+2?\n", "\n2+2 equals 4.  "),
    ("中文?", "好的：{\"a\": 1}"),
    ("Multi\nline", "Multi\nline answer\n"),
]

EOS_R1 = "<｜end▁of▁sentence｜>"

# name -> (answer content, is last turn) -> exact trained text
ANSWER: dict[str, Callable[[str, bool], str]] = {
    "default": lambda c, last: " " + c + "</s>",
    "chatml": lambda c, last: c + "<|im_end|>",
    "qwen2_5": lambda c, last: c + "<|im_end|>",
    "yi": lambda c, last: c + "<|im_end|>",
    "qwen3": lambda c, last: "<think>\n\n</think>\n\n" + c.lstrip("\n") + "<|im_end|>",
    "internlm2": lambda c, last: c + "<|im_end|>" + ("\n</s>" if last else ""),
    "llama3": lambda c, last: c.strip() + "<|eot_id|>",
    "llama3_1": lambda c, last: c.strip() + "<|eot_id|>",
    "llama2": lambda c, last: " " + c.strip() + " </s>",
    "mistral_v0_3": lambda c, last: " " + c + " </s>",
    "mistral_nemo": lambda c, last: c + "</s>",
    "gemma2": lambda c, last: c.strip() + "<end_of_turn>",
    "gemma3": lambda c, last: c.strip() + "<end_of_turn>",
    "phi3_5": lambda c, last: c + "<|end|>" + ("\n<|endoftext|>" if last else ""),
    "deepseek_v2": lambda c, last: " " + c + EOS_R1,
    "deepseek_r1_distill": lambda c, last: c + EOS_R1,
    "glm4": lambda c, last: ("\n" + c).rstrip(),
}

def conversation(turns: int, system: bool) -> list[dict[str, Any]]:
    messages = [SYSTEM] if system else []
    for question, answer in EXCHANGES[:turns]:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return messages


def refuses(name: str, turns: int, system: bool) -> bool:
    # Official behaviour that makes masking impossible (see the refusal tests below).
    return (
        (name == "gemma2" and system)
        or (name == "qwen3" and turns > 1)
        or (name == "mistral_nemo" and system)
    )


def test_every_builtin_has_expected_spans() -> None:
    assert sorted(ANSWER) == sorted(TEMPLATE_NAMES)


@pytest.mark.parametrize("name", sorted(ANSWER))
@pytest.mark.parametrize(("turns", "system"), list(itertools.product([1, 2, 3, 4], [False, True])))
def test_spans_are_answer_plus_end_of_turn(name: str, turns: int, system: bool) -> None:
    template, tokens = get_template(name), special_tokens(name)
    messages = conversation(turns, system)
    if refuses(name, turns, system):
        with pytest.raises(TemplateError):
            template.render_with_spans(messages, **tokens)
        return
    text, spans = template.render_with_spans(messages, **tokens)
    assert text == template.render(messages, **tokens)
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    expected = [ANSWER[name](answer, i == len(answers) - 1) for i, answer in enumerate(answers)]
    assert [text[start:end] for start, end in spans] == expected
    assert "".join(text[start:end] for start, end in spans) == "".join(expected)
    ends = [0, *itertools.chain.from_iterable(spans)]
    assert ends == sorted(ends)


def test_chatml_span_examples() -> None:
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "2+2 equals 4."}]
    text, spans = get_template("chatml").render_with_spans(messages)
    assert [text[s:e] for s, e in spans] == ["2+2 equals 4.<|im_end|>"]
    assert text[spans[0][1] :] == "\n"
    text, spans = get_template("llama2").render_with_spans(messages, bos_token="<s>", eos_token="</s>")
    assert [text[s:e] for s, e in spans] == [" 2+2 equals 4. </s>"]


def test_spans_with_empty_special_tokens() -> None:
    # Callers without bos/eos strings still get the template's own end-of-turn.
    text, spans = get_template("phi3_5").render_with_spans(conversation(2, False))
    assert [text[s:e] for s, e in spans] == ["I am an AI assistant.<|end|>", "\n2+2 equals 4.  <|end|>"]


def test_tool_turns_are_trained() -> None:
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "20"},
        {"role": "assistant", "content": "It is 20."},
    ]
    text, spans = get_template("qwen2_5").render_with_spans(messages, tools=[{"type": "function", "function": {}}])
    assert [text[s:e] for s, e in spans] == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "It is 20.<|im_end|>",
    ]


def test_generation_prompt_the_answer_does_not_repeat() -> None:
    # R1-distill prompts "<｜Assistant｜><think>\n" but renders an answer as "<｜Assistant｜>answer": the span
    # starts after the shared header, even when the answer itself starts like the prompt's extra text.
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<thinking aloud"}]
    text, spans = get_template("deepseek_r1_distill").render_with_spans(messages, bos_token="<s>")
    assert [text[s:e] for s, e in spans] == ["<thinking aloud" + EOS_R1]


def test_qwen3_multi_turn_is_refused() -> None:
    with pytest.raises(HistoryRewriteError, match=r"^chat template 'qwen3' renders earlier turns differently"):
        get_template("qwen3").render_with_spans(conversation(2, False))


def test_history_rewriting_template_is_refused() -> None:
    hides_history = Template(
        "hides_history",
        "{% for m in messages %}<{{ m.role }}>{{ m.content if loop.last else '...' }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}",
    )
    messages = conversation(2, False)
    with pytest.raises(HistoryRewriteError, match="message 1: the conversation up to it is not a prefix of the full"):
        hides_history.render_with_spans(messages)
    # Per answer it is sound: the generation prompt the model is given, then the answer as the template writes it.
    examples = hides_history.training_examples(messages)
    assert examples == [
        ("<user>Hello! Who are you?\n<assistant>I am an AI assistant.\n", [(37, 58)]),
        ("<user>...\n<assistant>...\n<user>  What is 2+2?\n\n<assistant>\n2+2 equals 4.  \n", [(58, 72)]),
    ]
    assert [text[s:e] for text, spans in examples for s, e in spans] == ["I am an AI assistant.", "\n2+2 equals 4."]


def test_end_only_text_other_than_eos_is_refused() -> None:
    closes_chat = Template(
        "closes_chat",
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% else %}<|done|>{% endif %}",
    )
    with pytest.raises(HistoryRewriteError, match="closes_chat"):
        closes_chat.render_with_spans(conversation(2, False))
    # a single turn is fine: nothing follows it
    text, spans = closes_chat.render_with_spans(conversation(1, False))
    assert [text[s:e] for s, e in spans] == ["I am an AI assistant.<|end|><|done|>"]


def test_eos_that_shares_a_prefix_with_the_next_turn_is_not_half_trained() -> None:
    # eos "<|endoftext|>" and the next header "<|user|>" share "<|"; the span must stop at <|end|>.
    text, spans = get_template("phi3_5").render_with_spans(conversation(2, False), eos_token="<|endoftext|>")
    assert text[spans[0][0] : spans[0][1]] == "I am an AI assistant.<|end|>"


def test_template_that_inspects_eos_falls_back_safely() -> None:
    # Markers cannot stand in for an eos the template transforms; the plain-text search must then refuse
    # rather than cut a span inside "<|endoftext|>".
    shouting = Template(
        "shouting",
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% else %}{{ eos_token | lower }}{% endif %}",
    )
    with pytest.raises(TemplateError, match="shouting"):
        shouting.render_with_spans(conversation(2, False), eos_token="<|EOT|>")


def test_conversation_starting_with_assistant_is_refused() -> None:
    messages = [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}]
    with pytest.raises(TemplateError, match="starts with an assistant message"):
        get_template("chatml").render_with_spans(messages)


def test_no_assistant_turn_gives_no_spans() -> None:
    text, spans = get_template("chatml").render_with_spans([{"role": "user", "content": "x"}])
    assert (text, spans) == ("<|im_start|>user\nx<|im_end|>\n", [])


# --- token level --------------------------------------------------------------------------------------


def tiny_tokenizer(
    special: list[str], bos: str | None, eos: str | None, add_bos_token: bool = False
) -> PreTrainedTokenizerFast:
    # Byte-level BPE without merges: one token per byte, plus the family's special tokens as single tokens.
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=eos, add_bos_token=add_bos_token
    )
    tokenizer.add_tokens(special, special_tokens=True)
    return tokenizer


@functools.cache
def family_tokenizer(name: str, add_bos_token: bool = False) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer holding every literal special token the family's template writes, plus bos/eos.

    Markup-like literals only ("<|im_start|>", "[INST]"): DeepSeek-V2's "User: " is plain text, not a token.
    """
    tokens = special_tokens(name)
    literal = [] if name == "default" else [t for t in family_facts(name)["literal_special_tokens"] if t[0] in "<["]
    marks = [t for t in (tokens["bos_token"], tokens["eos_token"]) if t and t not in literal]
    return tiny_tokenizer(literal + marks, tokens["bos_token"] or None, tokens["eos_token"] or None, add_bos_token)


TOKEN_CASES = {
    "chatml": (["<|im_start|>", "<|im_end|>"], "<s>", "<|im_end|>"),
    "llama3": (
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|begin_of_text|>",
        "<|eot_id|>",
    ),
    "qwen2_5": (["<|im_start|>", "<|im_end|>", "<|endoftext|>"], "<|endoftext|>", "<|im_end|>"),
    "llama2": (["<s>", "</s>"], "<s>", "</s>"),
}


@pytest.mark.parametrize("name", sorted(TOKEN_CASES))
@pytest.mark.parametrize("system", [False, True])
def test_tokens_match_official_and_mask_exactly(name: str, system: bool) -> None:
    special, bos, eos = TOKEN_CASES[name]
    tokenizer = tiny_tokenizer(special, bos, eos)
    messages = conversation(3, system)
    ours_text, spans = get_template(name, tokenizer).render_with_spans(messages, bos_token=bos, eos_token=eos)
    official_text = official_render(name, messages, bos_token=bos, eos_token=eos)

    encoded = tokenizer(ours_text, add_special_tokens=False, return_offsets_mapping=True)
    assert encoded["input_ids"] == tokenizer(official_text, add_special_tokens=False)["input_ids"]
    for token in special:
        if token in ours_text:  # each special token is one token, not bytes
            assert tokenizer.convert_tokens_to_ids(token) in encoded["input_ids"]

    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    for (start, end), answer in zip(spans, answers, strict=True):
        pairs = zip(encoded["input_ids"], encoded["offset_mapping"], strict=True)
        trained = [token for token, (s, e) in pairs if start <= s and e <= end]
        assert tokenizer.decode(trained) == ANSWER[name](answer, False)
