"""Truncation keeps the answers, not the oldest turns (docs/data.md, "Truncation").

An example longer than cutoff_len drops whole earliest exchanges first (the system prompt stays), then cuts
the end of the oldest remaining user turn so the answer fits whole, and only when the answer alone is too long
keeps the prompt and the start of the answer. A row never ends inside a prompt; lost answers are counted.
Each case is an equality with the encoding of the conversation that should be left.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import datasets
import pytest

from tunelab.data.encode import IGNORE_INDEX, SupervisedEncoder, encoded_row_problem, supervised_runs
from tunelab.data.pairwise import PairwiseEncoder
from tunelab.data.pipeline import encode_dataset
from tunelab.data.templates import get_template


def message(role: str, content: str, tool_calls: str = "") -> dict[str, str]:
    return {"role": role, "content": content, "tool_calls": tool_calls, "tool_call_id": ""}


def row(exchanges: list[tuple[str, str]], system: str = "You reverse strings.") -> dict[str, Any]:
    messages = [m for q, a in exchanges for m in (message("user", q), message("assistant", a))]
    return {"messages": messages, "system": system, "tools": "", "chosen": "", "rejected": ""}


EXCHANGES = [("Reverse: abc", "cba"), ("Reverse: hello", "olleh"), ("Reverse: xy", "yx")]


def encoder(tokenizer: Any, cutoff_len: int, template: str = "chatml", **options: Any) -> SupervisedEncoder:
    return SupervisedEncoder(tokenizer=tokenizer, template=get_template(template, tokenizer), cutoff_len=cutoff_len,
                             **options)


def encode(tokenizer: Any, r: dict[str, Any], cutoff_len: int = 4096, **options: Any) -> list[dict[str, Any]]:
    return encoder(tokenizer, cutoff_len, **options).encode_rows([r])[0]


def texts(tokenizer: Any, example: dict[str, Any]) -> list[str]:
    return [tokenizer.decode(example["input_ids"][s:e]) for s, e in supervised_runs(example["labels"])]


@pytest.mark.parametrize("kept", [2, 1])
def test_earliest_exchanges_are_dropped_first_and_counted(tiny_tokenizer, kept: int) -> None:
    expected = encode(tiny_tokenizer, row(EXCHANGES[-kept:]))[0]
    (example,) = encode(tiny_tokenizer, row(EXCHANGES), cutoff_len=len(expected["input_ids"]))
    assert (example["input_ids"], example["labels"]) == (expected["input_ids"], expected["labels"])
    assert tiny_tokenizer.decode(example["input_ids"]).startswith("<|im_start|>system\nYou reverse strings.")
    assert texts(tiny_tokenizer, example) == [f"{a}<|im_end|>" for _, a in EXCHANGES[-kept:]]
    assert (example["truncated"], example["answers_dropped"]) == (True, 3 - kept)


def test_the_fewest_exchanges_are_dropped(tiny_tokenizer) -> None:
    two = encode(tiny_tokenizer, row(EXCHANGES[-2:]))[0]
    (example,) = encode(tiny_tokenizer, row(EXCHANGES), cutoff_len=len(two["input_ids"]) + 1)  # one token more
    assert example["input_ids"] == two["input_ids"] and example["answers_dropped"] == 1


def test_mask_history_drops_history_without_losing_trained_answers(tiny_tokenizer) -> None:
    expected = encode(tiny_tokenizer, row(EXCHANGES[-1:]), mask_history=True)[0]
    (example,) = encode(tiny_tokenizer, row(EXCHANGES), cutoff_len=len(expected["input_ids"]), mask_history=True)
    assert example["input_ids"] == expected["input_ids"] and example["labels"] == expected["labels"]
    assert (example["truncated"], example["answers_dropped"]) == (True, 0)


def test_a_long_prompt_is_cut_so_the_answer_trains_whole(tiny_tokenizer) -> None:
    document = " ".join(f"word{i}" for i in range(300))
    r = row([(f"Summarise: {document}", "A list of words.")])
    (example,) = encode(tiny_tokenizer, r, cutoff_len=96)
    assert len(example["input_ids"]) <= 96
    assert texts(tiny_tokenizer, example) == ["A list of words.<|im_end|>"]
    text = tiny_tokenizer.decode(example["input_ids"])
    kept = text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
    assert kept and f"Summarise: {document}".startswith(kept) and len(kept) < len(document)
    assert (example["truncated"], example["answers_dropped"]) == (True, 0)
    # exactly the encoding of the conversation with that shorter user turn
    expected = encode(tiny_tokenizer, row([(kept, "A list of words.")]))[0]
    assert example["input_ids"] == expected["input_ids"]


def test_an_answer_longer_than_cutoff_keeps_the_prompt_and_its_start(tiny_tokenizer) -> None:
    long_answer = " ".join(f"part{i}" for i in range(200))
    full = encode(tiny_tokenizer, row([("Write it all.", long_answer)]))[0]
    (example,) = encode(tiny_tokenizer, row([("Write it all.", long_answer)]), cutoff_len=64)
    assert example["input_ids"] == full["input_ids"][:64] and example["labels"] == full["labels"][:64]
    assert example["labels"][-1] != IGNORE_INDEX  # it ends inside the answer
    assert (example["truncated"], example["answers_dropped"]) == (True, 0)


def test_a_prompt_longer_than_cutoff_is_dropped_and_counted(tiny_tokenizer) -> None:
    huge_system = " ".join(f"rule{i}" for i in range(300))
    rows = datasets.Dataset.from_list([row([("q", "a")], system=huge_system), row([("q", "a")])])
    encoded, stats = encode_dataset(rows, encoder(tiny_tokenizer, 64), "train", num_proc=None)
    assert (stats.examples, stats.dropped_no_supervised) == (1, 1)
    assert encoded[0]["input_ids"] == encode(tiny_tokenizer, row([("q", "a")]))[0]["input_ids"]


def test_a_row_never_ends_inside_a_prompt(tiny_tokenizer) -> None:
    # One exchange with a tool round: the cut falls inside the tool result, so the row ends after the call.
    call = json.dumps([{"type": "function", "function": {"name": "lookup", "arguments": {"q": "x"}}}])
    result = " ".join(f"line{i}" for i in range(200))
    r = {
        "messages": [message("user", "Look it up."), message("assistant", "", call), message("tool", result),
                     message("assistant", "Found it.")],
        "system": "", "tools": "", "chosen": "", "rejected": "",
    }
    full = encode(tiny_tokenizer, r, template="qwen2_5")[0]
    (first_end,) = [end for _, end in supervised_runs(full["labels"])[:1]]
    (example,) = encode(tiny_tokenizer, r, cutoff_len=first_end + 20, template="qwen2_5")
    assert example["input_ids"] == full["input_ids"][:first_end]
    assert texts(tiny_tokenizer, example) == [texts(tiny_tokenizer, full)[0]]
    assert texts(tiny_tokenizer, full)[0].endswith("</tool_call><|im_end|>")
    assert (example["truncated"], example["answers_dropped"]) == (True, 1)
    # The example is the render of the conversation up to the call, and `tunelab data verify` agrees: the call
    # follows its own inference prompt, and the final answer's prompt alone is longer than cutoff_len.
    assert [m["role"] for m in example["_messages"]] == ["user", "assistant"]
    assert encoded_row_problem(encoder(tiny_tokenizer, first_end + 20, template="qwen2_5"), r) is None


def tool_round(result_words: int) -> dict[str, Any]:
    call = json.dumps([{"type": "function", "function": {"name": "lookup", "arguments": {"q": "x"}}}])
    return {
        "messages": [message("user", "Look it up."), message("assistant", "", call),
                     message("tool", " ".join(f"line{i}" for i in range(result_words))), message("assistant", "Found it.")],
        "system": "", "tools": "", "chosen": "", "rejected": "",
    }


def test_an_answer_lost_from_a_conversation_encoded_per_answer_is_counted(tiny_tokenizer) -> None:
    # Qwen3 encodes each answer as its own example; when the final answer's prompt (the long tool result) alone is
    # longer than cutoff_len its example has nothing left to train: dropped, and counted as such.
    r = tool_round(200)
    full = encode(tiny_tokenizer, r, template="qwen3")
    assert len(full) == 2
    cutoff = len(full[0]["input_ids"]) + 5
    rows = datasets.Dataset.from_list([r])
    _, stats = encode_dataset(rows, encoder(tiny_tokenizer, cutoff, template="qwen3"), "train", num_proc=None)
    assert (stats.examples, stats.expanded_conversations, stats.dropped_no_supervised) == (1, 1, 1)
    assert encoded_row_problem(encoder(tiny_tokenizer, cutoff, template="qwen3"), r) is None


@dataclass(frozen=True)
class LosesTheLastAnswer(SupervisedEncoder):
    """A wrong encoder for the check below: it leaves out each conversation's last example."""

    def encode_rows(self, rows: list[dict]) -> list[list[dict[str, Any]]]:
        return [examples[:-1] for examples in super().encode_rows(rows)]


def test_verify_flags_a_lost_last_answer_whose_prompt_fits(tiny_tokenizer) -> None:
    r = tool_round(5)
    wrong = LosesTheLastAnswer(tokenizer=tiny_tokenizer, template=get_template("qwen3", tiny_tokenizer), cutoff_len=4096)
    problem = encoded_row_problem(wrong, r)
    assert problem.startswith("the conversation's last answer is not kept, although its prompt with the earlier "
                              "exchanges dropped (") and problem.endswith(" tokens) fits cutoff_len 4096")


def test_the_pipeline_reports_truncations_and_lost_answers(tiny_tokenizer, caplog) -> None:
    two = encode(tiny_tokenizer, row(EXCHANGES[-2:]))[0]
    rows = datasets.Dataset.from_list([row(EXCHANGES), row(EXCHANGES[:1]), row(EXCHANGES)])
    with caplog.at_level("WARNING", logger="tunelab.data.pipeline"):
        _, stats = encode_dataset(rows, encoder(tiny_tokenizer, len(two["input_ids"])), "train", num_proc=None)
    assert (stats.examples, stats.truncated, stats.answers_dropped, stats.dropped_no_supervised) == (3, 2, 2, 0)
    assert f"train: 2 rows shortened to fit cutoff_len={len(two['input_ids'])} (earliest turns dropped " \
           "first), losing 2 trained answers" in caplog.text


def test_both_sides_of_a_pair_keep_the_same_prompt(tiny_tokenizer) -> None:
    # The chosen answer is longer, so fitting it drops more history; the rejected side gets the same prompt.
    history = [m for q, a in EXCHANGES for m in (message("user", q), message("assistant", a))]
    pair = {"messages": [*history, message("user", "Reverse: ok")], "system": "S", "tools": "",
            "chosen": "ko " + " ".join(f"w{i}" for i in range(12)), "rejected": "ko"}
    inner = encoder(tiny_tokenizer, 4096, mask_history=True)
    full = PairwiseEncoder(inner)({k: [v] for k, v in pair.items()})
    cutoff = len(full["chosen_input_ids"][0]) - 5
    out = PairwiseEncoder(encoder(tiny_tokenizer, cutoff, mask_history=True))({k: [v] for k, v in pair.items()})
    chosen, rejected = out["chosen_input_ids"][0], out["rejected_input_ids"][0]
    assert len(chosen) <= cutoff and len(rejected) < len(full["rejected_input_ids"][0])
    prompt = next(i for i, label in enumerate(out["chosen_labels"][0]) if label != IGNORE_INDEX)
    assert chosen[:prompt] == rejected[:prompt]
    assert out["rejected_labels"][0][prompt] != IGNORE_INDEX  # the rejected answer starts right there


# ---- bounded work per row: a message far longer than cutoff_len is cut before tokenising -------------------


def _long_text(words: int, seed: int) -> str:
    """Varied text: words, digits, punctuation, double spaces and newlines (where tokenizers' pieces meet)."""
    import random

    rng = random.Random(seed)
    vocabulary = ["alpha", "beta", "Gamma", "delta,", "(eps)", "42", "3.14", "naïve", "東京", "x" * 30, "--", "é"]
    separators = [" "] * 8 + ["  ", "\n", "\n\n", "\t"]
    return "".join(rng.choice(vocabulary) + rng.choice(separators) for _ in range(words))


def _metaspace_tokenizer() -> Any:
    """A SentencePiece-style tokenizer (Metaspace "▁" pre-tokenizer, BPE) trained here, with chatml's tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>", "<|im_start|>", "<|im_end|>"])
    backend.train_from_iterator([_long_text(400, seed) for seed in range(5)], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>", pad_token="<unk>")


HUGE = _long_text(6000, seed=7)  # ~40,000 characters: far past any cutoff_len below


def _huge_rows() -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """(row, encoder options): a huge message in each place truncation treats differently."""
    return {
        "answer": (row([("Reverse: abc", HUGE)]), {}),
        "first user turn": (row([(HUGE, "cba")]), {}),
        "an early exchange": (row([(HUGE, "cba"), ("Reverse: hello", "olleh")]), {}),
        "a middle answer": (row([("Reverse: abc", "cba"), ("q", HUGE), ("Reverse: xy", "yx")]), {}),
        "the system prompt": (row(EXCHANGES, system=HUGE), {}),
        "history, mask_history": (row([("q", HUGE), ("Reverse: xy", "yx")]), {"mask_history": True}),
        "train_on_prompt": (row([(HUGE, "cba")]), {"train_on_prompt": True}),
    }


@pytest.mark.parametrize("tokenizer_name", ["byte-level BPE (tiny)", "Metaspace BPE"])
@pytest.mark.parametrize("case", list(_huge_rows()))
def test_a_huge_message_encodes_exactly_as_uncut(tiny_tokenizer, monkeypatch, tokenizer_name, case) -> None:
    import tunelab.data.encode as encode_module

    tokenizer = tiny_tokenizer if tokenizer_name.endswith("(tiny)") else _metaspace_tokenizer()
    r, options = _huge_rows()[case]
    cut = encode(tokenizer, r, cutoff_len=48, **options)
    monkeypatch.setattr(encode_module, "LONG_TEXT_CHARS_PER_TOKEN", 10**9)  # the whole text, as before the bound
    whole = encode(tokenizer, r, cutoff_len=48, **options)

    def same(e: dict[str, Any]) -> tuple:
        return e["input_ids"], e["labels"], e["truncated"], e["answers_dropped"], e["num_supervised"]

    assert [same(e) for e in cut] == [same(e) for e in whole]
    assert sum(e["texts_cut"] for e in cut) == (1 if cut else 0) and all(e["texts_cut"] == 0 for e in whole)


def test_a_huge_row_costs_a_few_cutoff_lengths(tiny_tokenizer, monkeypatch) -> None:
    """Characters handed to the tokenizer for one row with a 4 MB answer: bounded by the cutoff, not the row."""
    from tunelab.data.encode import LONG_TEXT_CHARS_PER_TOKEN, LONG_TEXT_MARGIN, PieceTokenizer

    seen = []
    raw = PieceTokenizer._raw
    monkeypatch.setattr(PieceTokenizer, "_raw",
                        lambda self, texts: seen.append(sum(map(len, texts))) or raw(self, texts))
    huge = HUGE * 100  # 4 MB
    (example,) = encode(tiny_tokenizer, row([("Reverse: abc", huge)]), cutoff_len=64)
    bound = LONG_TEXT_CHARS_PER_TOKEN * (64 + LONG_TEXT_MARGIN)  # the first prefix tried: 1,024 characters
    assert sum(seen) < 20 * bound < len(huge) / 200
    assert (len(example["input_ids"]), example["truncated"], example["texts_cut"]) == (64, True, 1)


def test_messages_under_the_bound_are_not_touched(tiny_tokenizer) -> None:
    enc = encoder(tiny_tokenizer, 64)
    messages = [message("user", "q" * 100), message("assistant", "a b " * 250)]  # 1,000 characters, under 1,024
    assert enc.bounded(messages) == (messages, 0)
