"""Masking options on every built-in family, at token level: what trains is exactly the answers.

A 3-answer conversation (with and without a system turn, where the family allows one) is encoded with a
byte-level tokenizer holding the family's literal special tokens, so every supervised run decodes exactly:
default trains each answer plus its end-of-turn, mask_history only the last, train_on_prompt everything.
Texts are checked against the official template: the full render, or for families that rewrite history
(Qwen3, Mistral-Nemo with a system prompt) one example per answer — the official generation prompt for
that answer followed by the answer. Also: bos appears only where the template writes it, even when the
tokenizer is set to add one itself.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.data.test_encode import supervised_runs
from tests.official import official_render
from tests.data.test_template_spans import ANSWER, EXCHANGES, SYSTEM, family_tokenizer, special_tokens
from tunelab.data.encode import IGNORE_INDEX, SupervisedEncoder
from tunelab.data.formats import template_messages
from tunelab.data.templates import TEMPLATE_NAMES, get_template

CASES = [(name, system) for name in TEMPLATE_NAMES for system in (False, True) if not (name == "gemma2" and system)]
EXPANDS = {("qwen3", False), ("qwen3", True), ("mistral_nemo", True)}  # templates that rewrite earlier turns
ANSWERS = [answer for _, answer in EXCHANGES[:3]]


def row(system: bool) -> dict[str, Any]:
    messages = []
    for question, answer in EXCHANGES[:3]:
        messages += [
            {"role": "user", "content": question, "tool_calls": "", "tool_call_id": ""},
            {"role": "assistant", "content": answer, "tool_calls": "", "tool_call_id": ""},
        ]
    return {"messages": messages, "system": SYSTEM["content"] if system else "", "tools": ""}


def encode(name: str, system: bool, add_bos_token: bool = False, **options: Any) -> tuple[Any, dict[str, list]]:
    tokenizer = family_tokenizer(name, add_bos_token)
    encoder = SupervisedEncoder(tokenizer=tokenizer, template=get_template(name, tokenizer), cutoff_len=4096, **options)
    return tokenizer, encoder({key: [value] for key, value in row(system).items()})


def runs(tokenizer: Any, out: dict[str, list]) -> list[str]:
    pairs = zip(out["input_ids"], out["labels"])
    return [run for ids, labels in pairs for run in supervised_runs(tokenizer, ids, labels)]


def official_texts(name: str, system: bool) -> list[str]:
    """The full official render, or per answer: the official prompt for it + the answer as trained."""
    messages = template_messages(row(system))
    if name == "default":  # our own format: no official counterpart
        return [get_template(name).render(messages, **special_tokens(name))]
    tokens = special_tokens(name)
    if (name, system) not in EXPANDS:
        return [official_render(name, messages, **tokens)]
    texts = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            texts.append(official_render(name, messages[:i], add_generation_prompt=True, **tokens)
                         + ANSWER[name](message["content"], True))
    return texts


@pytest.mark.parametrize(("name", "system"), CASES)
def test_default_trains_every_answer_exactly(name: str, system: bool) -> None:
    tokenizer, out = encode(name, system)
    expected = [ANSWER[name](answer, i == len(ANSWERS) - 1) for i, answer in enumerate(ANSWERS)]
    assert runs(tokenizer, out) == expected
    texts = official_texts(name, system)
    assert len(out["input_ids"]) == len(texts) == (3 if (name, system) in EXPANDS else 1)
    for ids, text in zip(out["input_ids"], texts, strict=True):
        decoded = tokenizer.decode(ids)
        # per-answer examples end with the answer; only the end-of-turn's trailing whitespace may follow
        assert decoded == text or (decoded.startswith(text) and not decoded[len(text) :].strip())
        assert ids == tokenizer(decoded, add_special_tokens=False)["input_ids"]
    assert out["expanded"] == ([2, 0, 0] if (name, system) in EXPANDS else [0])


@pytest.mark.parametrize(("name", "system"), CASES)
def test_mask_history_trains_only_the_last_answer(name: str, system: bool) -> None:
    tokenizer, out = encode(name, system, mask_history=True)
    assert runs(tokenizer, out) == [ANSWER[name](ANSWERS[-1], True)]
    decoded = tokenizer.decode(out["input_ids"][0])
    assert decoded.startswith(official_texts(name, system)[-1])
    assert out["expanded"] == [0]


@pytest.mark.parametrize(("name", "system"), CASES)
def test_train_on_prompt_trains_everything(name: str, system: bool) -> None:
    tokenizer, out = encode(name, system, train_on_prompt=True)
    (ids,), (labels,) = out["input_ids"], out["labels"]
    assert labels == ids and IGNORE_INDEX not in labels
    full = template_messages(row(system))
    render = get_template(name).render if name == "default" else lambda *a, **k: official_render(name, *a, **k)
    assert tokenizer.decode(ids) == render(full, **special_tokens(name))


# --- bos ----------------------------------------------------------------------------------------------

BOS_FAMILIES = [name for name in TEMPLATE_NAMES if "bos_token" in get_template(name).jinja]


def test_bos_families_are_the_ones_expected() -> None:
    assert BOS_FAMILIES == [
        "deepseek_r1_distill", "deepseek_v2", "default", "gemma2", "gemma3", "internlm2",
        "llama2", "llama3", "llama3_1", "mistral_nemo", "mistral_v0_3",
    ]


@pytest.mark.parametrize("name", BOS_FAMILIES)
@pytest.mark.parametrize("mask_history", [False, True])
def test_bos_exactly_once_even_when_the_tokenizer_adds_one(name: str, mask_history: bool) -> None:
    tokenizer, out = encode(name, name != "gemma2", add_bos_token=True, mask_history=mask_history)
    bos = tokenizer.bos_token_id
    assert tokenizer("x")["input_ids"][0] == bos  # the tokenizer really is set to add bos itself
    for ids in out["input_ids"]:
        assert ids[0] == bos and ids[1] != bos
        # Llama-2's official format opens every [INST] turn with bos; every other family writes it once.
        turns = tokenizer.decode(ids).count("[INST]") if name == "llama2" else 1
        assert ids.count(bos) == turns
