"""Templates that rewrite history: a k-answer conversation encodes as k examples, each exactly official.

Qwen3 drops the reasoning of answers before the last user turn; Mistral-Nemo writes the system prompt only
into a final user turn. Example i is the conversation up to answer i as the official template renders it
when the model generates answer i, and trains only answer i (+ end-of-turn). The encoder counts such
conversations (``expanded``), and the pipeline reports them and still counts dropped examples exactly.
"""

from __future__ import annotations

from typing import Any

import datasets
import pytest

from tests.data.test_encode import supervised_runs
from tests.official import official_render, special_tokens
from tests.data.test_template_spans import family_tokenizer
from tunelab.data.encode import EncodeStats, SupervisedEncoder
from tunelab.data.formats import template_messages
from tunelab.data.pipeline import encode_dataset
from tunelab.data.templates import HistoryRewriteError, get_template
from tunelab.errors import TemplateError

QWEN3_TOKENS = special_tokens("qwen3")


def message(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content, "tool_calls": "", "tool_call_id": ""}


def canonical(*turns: tuple[str, str], system: str = "") -> dict[str, Any]:
    messages = [message(role, content) for role, content in turns]
    return {"messages": messages, "system": system, "tools": "", "chosen": "", "rejected": ""}


THINKING = canonical(
    ("user", "q1"), ("assistant", "<think>\nfirst thought\n</think>\n\na1"),
    ("user", "q2"), ("assistant", "a2"),
    ("user", "q3"), ("assistant", "<think>third</think>a3"),
)


def encode(name: str, row: dict[str, Any], **options: Any) -> tuple[Any, dict[str, list]]:
    tokenizer = family_tokenizer(name)
    encoder = SupervisedEncoder(tokenizer=tokenizer, template=get_template(name, tokenizer), cutoff_len=4096, **options)
    return tokenizer, encoder({key: [value] for key, value in row.items()})


def answer_indices(messages: list[dict[str, Any]]) -> list[int]:
    return [i for i, m in enumerate(messages) if m["role"] == "assistant"]


# --- Qwen3 --------------------------------------------------------------------------------------------


PLAIN = canonical(("user", "q1"), ("assistant", "a1"), ("user", "q2"), ("assistant", "a2"),
                  ("user", "q3"), ("assistant", "a3"))
THOUGHTS = ["<think>\nfirst thought\n</think>\n\na1", "<think>\n\n</think>\n\na2", "<think>\nthird\n</think>\n\na3"]


@pytest.mark.parametrize(
    ("row", "template_vars", "trained"),
    [
        (THINKING, {}, THOUGHTS),
        (THINKING, {"enable_thinking": True}, THOUGHTS),
        # thinking off: the prompt already holds the empty think block, so the answer trains bare
        (PLAIN, {"enable_thinking": False}, ["a1", "a2", "a3"]),
    ],
    ids=["default", "thinking-on", "thinking-off"],
)
def test_qwen3_each_answer_is_its_own_official_example(
    row: dict[str, Any], template_vars: dict[str, Any], trained: list[str]
) -> None:
    tokenizer, out = encode("qwen3", row, template_vars=template_vars)
    messages = template_messages(row)
    assert len(out["input_ids"]) == 3 and out["expanded"] == [2, 0, 0]
    for ids, labels, i, answer in zip(out["input_ids"], out["labels"], answer_indices(messages), trained, strict=True):
        text = official_render("qwen3", messages[: i + 1], **QWEN3_TOKENS, **template_vars)
        assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
        assert supervised_runs(tokenizer, ids, labels) == [answer + "<|im_end|>"]
    # in the last example the earlier answers appear as the template rewrites them: reasoning dropped
    assert "<think>\n\n</think>\n\na2" not in tokenizer.decode(out["input_ids"][-1])
    assert "first thought" not in tokenizer.decode(out["input_ids"][-1])


def test_qwen3_reasoning_in_content_with_thinking_off_is_refused() -> None:
    # The prompt pre-fills an empty think block, so an answer that starts with reasoning cannot follow it.
    with pytest.raises(TemplateError) as err:
        encode("qwen3", THINKING, template_vars={"enable_thinking": False})
    assert str(err.value) == (
        "chat template 'qwen3' writes message 1 (an answer) after other text than the prompt the model is given to "
        "generate it (from character 60: prompt '\\n</think>\\n\\n', conversation 'first thought\\n</think>\\n\\na1<|im_e'), "
        "so it cannot train as it is generated; remove that turn and the ones after it, or use another template"
    )
    # (a pipeline run refuses such a row before encoding, naming it: test_real_tokenizers.py, test_trainable.py)


def test_qwen3_reasoning_content_field_in_earlier_turns() -> None:
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2", "reasoning_content": "\nr2\n"},
    ]
    template = get_template("qwen3")
    with pytest.raises(HistoryRewriteError):
        template.render_with_spans(messages)
    for variables in ({}, {"enable_thinking": True}, {"enable_thinking": False}):
        examples = template.training_examples(messages, **variables)
        assert [text for text, _ in examples] == [
            official_render("qwen3", messages[:3], **variables), official_render("qwen3", messages, **variables)
        ]
        trained = [text[start:end] for text, spans in examples for start, end in spans]
        if variables.get("enable_thinking") is False:  # "<think>\n" is the shared header; the rest trains
            assert trained == ["r1\n</think>\n\na1<|im_end|>", "r2\n</think>\n\na2<|im_end|>"]
        else:
            assert trained == ["<think>\nr1\n</think>\n\na1<|im_end|>", "<think>\nr2\n</think>\n\na2<|im_end|>"]


def test_qwen3_single_answer_is_not_expanded() -> None:
    tokenizer, out = encode("qwen3", canonical(("user", "q"), ("assistant", "a")))
    assert out["expanded"] == [0]
    assert supervised_runs(tokenizer, out["input_ids"][0], out["labels"][0]) == ["<think>\n\n</think>\n\na<|im_end|>"]


def test_qwen3_mask_history_is_the_last_example() -> None:
    tokenizer, full = encode("qwen3", THINKING)
    _, last = encode("qwen3", THINKING, mask_history=True)
    assert last["input_ids"] == full["input_ids"][-1:] and last["labels"] == full["labels"][-1:]
    assert last["expanded"] == [0]


def test_qwen3_train_on_prompt_is_one_official_render() -> None:
    tokenizer, out = encode("qwen3", THINKING, train_on_prompt=True)
    text = official_render("qwen3", template_messages(THINKING), **QWEN3_TOKENS)
    assert out["input_ids"] == out["labels"] == [tokenizer(text, add_special_tokens=False)["input_ids"]]


# --- Mistral-Nemo with a system prompt ------------------------------------------------------------------


def test_mistral_nemo_system_goes_with_each_answers_prompt() -> None:
    row = canonical(("user", "q1"), ("assistant", "a1"), ("user", "q2"), ("assistant", "a2"),
                    ("user", "q3"), ("assistant", "a3"), system="Be brief.")
    tokenizer, out = encode("mistral_nemo", row)
    messages = template_messages(row)
    tokens = special_tokens("mistral_nemo")
    assert out["expanded"] == [2, 0, 0]
    for ids, labels, i in zip(out["input_ids"], out["labels"], answer_indices(messages), strict=True):
        # The official render of a finished turn drops the system prompt; the prompt the model is given has it.
        prompt = official_render("mistral_nemo", messages[:i], add_generation_prompt=True, **tokens)
        answer = messages[i]["content"] + "</s>"
        assert "[INST]Be brief.\n\n" in prompt
        assert ids == tokenizer(prompt + answer, add_special_tokens=False)["input_ids"]
        assert supervised_runs(tokenizer, ids, labels) == [answer]


def test_mistral_nemo_without_system_is_one_example() -> None:
    row = canonical(("user", "q1"), ("assistant", "a1"), ("user", "q2"), ("assistant", "a2"))
    tokenizer, out = encode("mistral_nemo", row)
    assert out["expanded"] == [0]
    assert supervised_runs(tokenizer, out["input_ids"][0], out["labels"][0]) == ["a1</s>", "a2</s>"]


# --- counts -------------------------------------------------------------------------------------------


def test_pipeline_counts_expanded_conversations_and_dropped_examples() -> None:
    tokenizer = family_tokenizer("qwen3")
    single = canonical(("user", "q"), ("assistant", "a"))
    rows = datasets.Dataset.from_list([THINKING, single, THINKING])
    encoder = SupervisedEncoder(tokenizer=tokenizer, template=get_template("qwen3", tokenizer), cutoff_len=4096)
    encoded, stats = encode_dataset(rows, encoder, "train", num_proc=None)
    assert encoded.column_names == ["input_ids", "labels"]
    assert (stats.examples, stats.expanded_conversations, stats.dropped_no_supervised) == (7, 2, 0)
    # Cut at the second example's length: each third example drops its earliest exchange (untrained history) to fit.
    cutoff = len(encoded[1]["input_ids"])
    encoder = SupervisedEncoder(tokenizer=tokenizer, template=get_template("qwen3", tokenizer), cutoff_len=cutoff)
    _, stats = encode_dataset(rows, encoder, "train", num_proc=None)
    assert (stats.examples, stats.expanded_conversations, stats.dropped_no_supervised, stats.truncated) == (7, 2, 0, 2)
    assert stats.answers_dropped == 0
    # With a system prompt longer than the cutoff every example of a conversation is dropped: counted per row.
    long_system = {**THINKING, "system": "rules " * cutoff}
    rows = datasets.Dataset.from_list([long_system, single, long_system])
    _, stats = encode_dataset(rows, encoder, "train", num_proc=None)
    assert (stats.examples, stats.expanded_conversations, stats.dropped_no_supervised, stats.truncated) == (1, 0, 2, 0)


def test_encode_stats_merge_sums_expanded() -> None:
    stats = EncodeStats(examples=3, expanded_conversations=1)
    stats.merge(EncodeStats(examples=2, expanded_conversations=2))
    assert (stats.examples, stats.expanded_conversations) == (5, 3)
