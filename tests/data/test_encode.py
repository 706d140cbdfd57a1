"""The one function that decides which tokens train: exact per-turn masks, options, truncation."""

from __future__ import annotations

import datasets
import pytest
import torch

from tests.official import official_render
from tunelab.data.collate import SupervisedCollator
from tunelab.data.encode import IGNORE_INDEX, SupervisedEncoder
from tunelab.data.pipeline import encode_dataset
from tunelab.data.templates import Template, get_template

CONVERSATION = {
    "messages": [
        {"role": "user", "content": "Reverse: abc"},
        {"role": "assistant", "content": "cba"},
        {"role": "user", "content": "Reverse: hello"},
        {"role": "assistant", "content": "olleh"},
        {"role": "user", "content": "Reverse: xy"},
        {"role": "assistant", "content": "yx"},
    ],
    "system": "You reverse strings.",
    "tools": "",
    "chosen": "",
    "rejected": "",
}


def encode(tokenizer, template_name="chatml", row=CONVERSATION, **options):
    encoder = SupervisedEncoder(tokenizer=tokenizer, template=get_template(template_name, tokenizer), cutoff_len=options.pop("cutoff_len", 1024), **options)
    batch = {key: [value] for key, value in row.items()}
    out = encoder(batch)
    return out["input_ids"][0], out["labels"][0]


def supervised_runs(tokenizer, ids, labels) -> list[str]:
    """Decode each maximal run of supervised tokens."""
    runs, current = [], []
    for token, label in zip(ids, labels):
        if label == IGNORE_INDEX:
            if current:
                runs.append(tokenizer.decode(current))
                current = []
        else:
            assert label == token
            current.append(token)
    if current:
        runs.append(tokenizer.decode(current))
    return runs


@pytest.mark.parametrize("template_name, end", [("chatml", "<|im_end|>"), ("qwen2_5", "<|im_end|>"), ("llama3", "<|eot_id|>")])
def test_every_assistant_turn_is_trained_exactly(tiny_tokenizer, template_name, end):
    ids, labels = encode(tiny_tokenizer, template_name)
    assert supervised_runs(tiny_tokenizer, ids, labels) == [f"cba{end}", f"olleh{end}", f"yx{end}"]


def test_mask_history_trains_only_the_last_answer(tiny_tokenizer):
    ids, labels = encode(tiny_tokenizer, mask_history=True)
    assert supervised_runs(tiny_tokenizer, ids, labels) == ["yx<|im_end|>"]


def test_train_on_prompt_trains_everything(tiny_tokenizer):
    ids, labels = encode(tiny_tokenizer, train_on_prompt=True)
    assert labels == ids


def test_ids_equal_tokenizing_the_official_render(tiny_tokenizer):
    """Our ids == tokenizer(official ChatML render), token for token."""
    messages = [{"role": "system", "content": CONVERSATION["system"]}] + CONVERSATION["messages"]
    text = official_render("chatml", messages)
    ids, _ = encode(tiny_tokenizer)
    assert ids == tiny_tokenizer(text, add_special_tokens=False)["input_ids"]


def test_collator_pads_right_with_minus_100():
    collate = SupervisedCollator(pad_token_id=7, pad_to_multiple_of=4)
    batch = collate([
        {"input_ids": [1, 2, 3, 4, 5], "labels": [-100, -100, 3, 4, 5]},
        {"input_ids": [8, 9], "labels": [-100, 9]},
    ])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 7, 7, 7], [8, 9, 7, 7, 7, 7, 7, 7]]
    assert batch["labels"].tolist() == [[-100, -100, 3, 4, 5, -100, -100, -100], [-100, 9] + [-100] * 6]
    assert batch["attention_mask"].tolist() == [[1] * 5 + [0] * 3, [1, 1] + [0] * 6]
    assert all(t.dtype == torch.long for t in batch.values())


def test_a_template_without_prefix_property_trains_each_answer_after_its_prompt(tiny_tokenizer):
    # Renders the number of messages first, so earlier renders are not prefixes of later ones: each answer
    # becomes its own example, the generation prompt the model is given followed by the answer.
    template = Template(name="bad", jinja="{{ messages|length }}{% for m in messages %}{{ m.content }}|{% endfor %}")
    encoder = SupervisedEncoder(tokenizer=tiny_tokenizer, template=template, cutoff_len=64)
    out = encoder({k: [v] for k, v in CONVERSATION.items()})
    assert out["expanded"] == [2, 0, 0]
    texts = [tiny_tokenizer.decode(ids) for ids in out["input_ids"]]
    assert texts[0] == "2You reverse strings.|Reverse: abc|cba|"
    assert texts[2] == "6You reverse strings.|Reverse: abc|cba|Reverse: hello|olleh|Reverse: xy|yx|"
    runs = [supervised_runs(tiny_tokenizer, ids, labels) for ids, labels in zip(out["input_ids"], out["labels"])]
    assert runs == [["cba|"], ["olleh|"], ["yx|"]]

