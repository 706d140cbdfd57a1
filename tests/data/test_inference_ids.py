"""Training ids are the ids the model sees at inference (issue: encoding that is right on real chat data).

For every trained answer: tokenising the prompt up to its generation header alone (as an inference engine
does) gives exactly the ids in front of it, and the supervised ids are the answer's own. Checked by brute
force (``inference_mismatch``) for every built-in family, with the embedded tokenizer and with a GPT-2-style
byte-level BPE whose merges cross the prompt/answer seam ("\\n" + "  Two" → "\\n ", " Two"), on answers that
start or end with whitespace, multi-turn conversations and tool calls.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tests.data.test_template_spans import family_tokenizer
from tests.official import family_facts, special_tokens
from tunelab.data.encode import IGNORE_INDEX, SupervisedEncoder, inference_mismatch, supervised_runs
from tunelab.data.formats import template_messages
from tunelab.data.templates import TEMPLATE_NAMES, get_template

ANSWERS = ["Greetings, friend.", "  Two leading spaces.", " They went home.", "\nNew line first.",
           "\n\nTwo new lines.", "Ends with space ", "Ends with new line\n", "12 + 30 = 42", "中文 answer"]
QUESTIONS = ["Hi", "Say something.\n", "  spaced question  ", "What is 12 + 30?"]

CORPUS = [
    "Hello there.\n\nGreetings from the team.\n They went home.\n\n  Two spaces.\n  Two leading spaces.\n",
    "The quick brown fox.\n\nHe said: 'yes'\n \nNew line first.\n\n",
    "Ends with space \nEnds with new line\n\nWhat is 12 + 30?\n\n",
] * 40


@functools.cache
def gpt2_style_tokenizer(name: str) -> PreTrainedTokenizerFast:
    """Byte-level BPE with GPT-2's pre-tokenizer, trained on a small corpus (so "\\n\\n", "\\n " and " They" are
    single tokens), holding the family's literal special tokens and bos/eos."""
    tokens = special_tokens(name)
    literal = [] if name == "default" else [t for t in family_facts(name)["literal_special_tokens"] if t[0] in "<["]
    specials = list(dict.fromkeys([*literal, *(t for t in tokens.values() if t)]))
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=tokens["bos_token"] or None, eos_token=tokens["eos_token"] or None
    )


@functools.cache
def embedded_tokenizer() -> PreTrainedTokenizerFast:
    from transformers import AutoTokenizer  # noqa: PLC0415

    from tunelab.assets import TINY_MODEL_DIR  # noqa: PLC0415

    return AutoTokenizer.from_pretrained(str(TINY_MODEL_DIR))


TOKENIZERS = {"embedded": lambda name: embedded_tokenizer(), "gpt2_style": gpt2_style_tokenizer,
              "byte": family_tokenizer}


def message(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content, "tool_calls": "", "tool_call_id": ""}


def row(exchanges: list[tuple[str, str]], system: str = "") -> dict[str, Any]:
    messages = [m for q, a in exchanges for m in (message("user", q), message("assistant", a))]
    return {"messages": messages, "system": system, "tools": "", "chosen": "", "rejected": ""}


ROWS = [row([(q, a)]) for q, a in zip(QUESTIONS * 3, ANSWERS)] + [
    row(list(zip(QUESTIONS, ANSWERS[:4]))),
    row(list(zip(QUESTIONS, ANSWERS[4:8])), system="Be brief."),
    row(list(zip(QUESTIONS[:2], ANSWERS[1:3]))),
]


def encoded(name: str, tokenizer: Any, rows: list[dict], **options: Any) -> list[tuple[dict, dict]]:
    # The template without the tokenizer check: the embedded tokenizer lacks several families' end-of-turn tokens,
    # which a run refuses (test_end_of_turn.py) but which makes no difference to where the seams fall.
    encoder = SupervisedEncoder(tokenizer=tokenizer, template=get_template(name), cutoff_len=4096, **options)
    out = []
    for r, examples in zip(rows, encoder.encode_rows(rows), strict=True):
        out += [(example, encoder.options(r)) for example in examples]
    return encoder, out


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
@pytest.mark.parametrize("name", TEMPLATE_NAMES)
@pytest.mark.parametrize("mask_history", [False, True])
def test_every_answer_follows_its_inference_prompt(name: str, kind: str, mask_history: bool) -> None:
    tokenizer = TOKENIZERS[kind](name)
    rows = ROWS if name != "gemma2" else [{**r, "system": ""} for r in ROWS]  # gemma2 refuses system turns
    encoder, examples = encoded(name, tokenizer, rows, mask_history=mask_history)
    assert examples
    problems = [inference_mismatch(encoder, example, options) for example, options in examples]
    assert problems == [None] * len(examples)


def test_the_seam_that_whole_text_tokenisation_gets_wrong() -> None:
    # ChatML's generation header ends with "\n"; GPT-2's pre-tokenizer joins "\n" with the answer's first space.
    tokenizer = gpt2_style_tokenizer("chatml")
    r = row([("Hi", "  Two leading spaces.")])
    messages = template_messages(r)
    template = get_template("chatml", tokenizer)
    prompt_text = template.render(messages[:1], add_generation_prompt=True)
    whole = tokenizer(template.render(messages), add_special_tokens=False)["input_ids"]
    prompt = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    assert whole[: len(prompt)] != prompt  # tokenising the whole render breaks the guarantee here...
    encoder, [(example, options)] = encoded("chatml", tokenizer, [r])
    ids, labels = example["input_ids"], example["labels"]
    assert ids[: len(prompt)] == prompt  # ...the encoder keeps it
    (start, end), = supervised_runs(labels)
    assert start == len(prompt)
    assert tokenizer.decode(ids[start:end]) == "  Two leading spaces.<|im_end|>"  # the leading spaces train
    assert ids[start:end] == tokenizer("<|im_end|>  Two leading spaces.<|im_end|>", add_special_tokens=False)["input_ids"][1:]


def test_a_seam_that_tokenises_differently_splits_the_conversation_per_answer() -> None:
    # "\n" + "  Two" merges across the first answer's start; in the second answer's prompt (tokenised whole,
    # history included) the first answer's ids differ from its training pieces: one example per answer then.
    tokenizer = gpt2_style_tokenizer("chatml")
    r = row([("Hi", "  Two leading spaces."), ("More?", "Yes.")])
    encoder, examples = encoded("chatml", tokenizer, [r])
    assert len(examples) == 2
    first, second = (example for example, _ in examples)
    assert (first["expanded"], first["split_at_seams"]) == (1, 1)
    assert (second["expanded"], second["split_at_seams"]) == (0, 0)
    assert [len(supervised_runs(e["labels"])) for e in (first, second)] == [1, 1]
    assert [inference_mismatch(encoder, e, options) for e, options in examples] == [None, None]
    # Where every seam falls on a split the tokenizer makes anyway, the conversation stays one example.
    encoder, examples = encoded("chatml", tokenizer, [row([("Hi", "Greetings, friend."), ("More?", "Yes.")])])
    assert len(examples) == 1 and examples[0][0]["split_at_seams"] == 0
    assert len(supervised_runs(examples[0][0]["labels"])) == 2


def test_the_check_catches_whole_text_tokenisation() -> None:
    tokenizer = gpt2_style_tokenizer("chatml")
    r = row([("Hi", "  Two leading spaces.")])
    encoder, [(example, options)] = encoded("chatml", tokenizer, [r])
    template = get_template("chatml", tokenizer)
    text, [(start, end)] = template.render_with_spans(template_messages(r))
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    labels = [i if start <= s < end else IGNORE_INDEX for i, (s, _) in zip(encoding["input_ids"], encoding["offset_mapping"])]
    old_style = {**example, "input_ids": encoding["input_ids"], "labels": labels}
    assert inference_mismatch(encoder, old_style, options).startswith(
        "answer 1: the ids before it are not the tokenised prompt"
    )
