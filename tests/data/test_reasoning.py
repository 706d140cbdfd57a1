"""Reasoning on answers: kept from the data, trained where the template writes it, never dropped silently.

Qwen3's template reads ``reasoning_content`` and keeps it only after the last user turn, so a k-answer
conversation trains k examples, each answer with its own reasoning. DeepSeek-R1-Distill's generation prompt
opens ``<think>\\n``: the built-in writes a last answer's reasoning as the model generates it after that prompt.
A template with no place for reasoning (ChatML), or a point in a conversation where the template writes none,
is an error naming the row, or with skip_bad_rows a skip counted as ``reasoning_not_rendered``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.data.test_encode import supervised_runs
from tests.official import needs_official, official_render, official_template
from tunelab.config.args import DataArguments
from tunelab.data.encode import SupervisedEncoder
from tunelab.data.formats import renders_reasoning, template_messages
from tunelab.data.pipeline import build_datasets
from tunelab.data.templates import get_template
from tunelab.errors import DataError

TWO_ANSWERS = [
    {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
    {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2", "reasoning_content": "r2"},
]


def write_dataset(folder: Path, rows: list[dict[str, Any]]) -> str:
    folder.mkdir(exist_ok=True)
    (folder / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "dataset_info.json").write_text(json.dumps({"r": {"file_name": "data.jsonl", "formatting": "openai"}}))
    return str(folder)


def r1_tokenizer():
    # The embedded tokenizer lacks R1's <｜end▁of▁sentence｜>, which a run refuses (data/templates: end-of-turn check).
    from tests.data.test_template_spans import family_tokenizer  # noqa: PLC0415

    return family_tokenizer("deepseek_r1_distill")


def build(folder: str, tokenizer, template: str, **options: Any):
    args = DataArguments(dataset_dir=folder, dataset=["r"], template=template, cutoff_len=256, **options)
    return build_datasets(args, tokenizer, get_template(template, tokenizer), seed=0)


def trained(tokenizer, bundle) -> list[list[str]]:
    return [supervised_runs(tokenizer, row["input_ids"], row["labels"]) for row in bundle.train]


def test_which_templates_have_a_place_for_reasoning():
    assert [name for name in ("chatml", "deepseek_r1_distill", "llama3", "qwen2_5", "qwen3")
            if renders_reasoning(get_template(name))] == ["deepseek_r1_distill", "qwen3"]


def test_qwen3_trains_each_answer_with_its_reasoning(tmp_path, tiny_tokenizer):
    bundle = build(write_dataset(tmp_path / "d", [{"messages": TWO_ANSWERS}]), tiny_tokenizer, "qwen3")
    assert trained(tiny_tokenizer, bundle) == [
        ["<think>\nr1\n</think>\n\na1<|im_end|>"], ["<think>\nr2\n</think>\n\na2<|im_end|>"],
    ]
    assert bundle.report["sources"][0]["rows_with_reasoning"] == 1


def test_deepseek_r1_trains_reasoning_after_its_think_prompt(tmp_path):
    tokenizer = r1_tokenizer()
    bundle = build(write_dataset(tmp_path / "d", [{"messages": TWO_ANSWERS}]), tokenizer, "deepseek_r1_distill")
    eos = "<｜end▁of▁sentence｜>"
    assert trained(tokenizer, bundle) == [[f"r1\n</think>\n\na1{eos}"], [f"r2\n</think>\n\na2{eos}"]]
    starts = [next(i for i, label in enumerate(row["labels"]) if label != -100) for row in bundle.train]
    prompts = [tokenizer.decode(row["input_ids"][:start]) for row, start in zip(bundle.train, starts)]
    assert [prompt.split("<｜User｜>")[-1] for prompt in prompts] == ["q1<｜Assistant｜><think>\n", "q2<｜Assistant｜><think>\n"]


def test_a_template_without_reasoning_is_an_error_naming_the_row(tmp_path, tiny_tokenizer):
    plain = {"messages": TWO_ANSWERS[:1] + [{"role": "assistant", "content": "a"}]}
    folder = write_dataset(tmp_path / "d", [plain, {"messages": TWO_ANSWERS}])
    with pytest.raises(DataError) as info:
        build(folder, tiny_tokenizer, "chatml")
    assert str(info.value) == (
        f"dataset 'r' row 1 ({folder}/data.jsonl:2): answer 1 has reasoning, but chat template 'chatml' has no place for it (it does not read "
        "reasoning_content); use a template that does (deepseek_r1_distill, qwen3) or remove the reasoning; or set "
        "skip_bad_rows: true to skip such rows (counted per reason)"
    )
    bundle = build(folder, tiny_tokenizer, "chatml", skip_bad_rows=True)
    source = bundle.report["sources"][0]
    assert (source["rows"], source["skipped_by_reason"], len(bundle.train)) == (2, {"reasoning_not_rendered": 1}, 1)
    # with mask_history only the last answer trains: reasoning on an earlier answer is history, rendered as such
    earlier = [TWO_ANSWERS[0], TWO_ANSWERS[1], TWO_ANSWERS[2], {"role": "assistant", "content": "a2"}]
    bundle = build(write_dataset(tmp_path / "e", [{"messages": earlier}]), tiny_tokenizer, "chatml", mask_history=True)
    assert trained(tiny_tokenizer, bundle) == [["a2<|im_end|>"]]


def test_reasoning_where_the_template_writes_none_is_an_error(tmp_path, tiny_tokenizer):
    # DeepSeek-R1 writes an answer after tool outputs without <｜Assistant｜> or a think block: no place for reasoning.
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    turns = [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "1", "tool_call_id": "c1"},
        {"role": "assistant", "content": "It is 1.", "reasoning_content": "the tool said 1"},
    ]
    with pytest.raises(DataError, match=r"^dataset 'r' row 0 \(.*/d/data.jsonl:1\): the reasoning of answer 2 is not in what chat template "
                                        r"'deepseek_r1_distill' trains \(the template writes no reasoning at that point"):
        build(write_dataset(tmp_path / "d", [{"messages": turns}]), r1_tokenizer(), "deepseek_r1_distill")


def test_qwen3_examples_are_the_official_renders_at_each_answer():
    from tests.data.test_template_spans import family_tokenizer  # noqa: PLC0415

    tokenizer = family_tokenizer("qwen3")
    encoder = SupervisedEncoder(tokenizer=tokenizer, template=get_template("qwen3", tokenizer), cutoff_len=4096)
    row = {"messages": [{"tool_calls": "", "tool_call_id": "", "reasoning": m.get("reasoning_content", ""),
                         "role": m["role"], "content": m["content"]} for m in TWO_ANSWERS],
           "system": "", "tools": "", "chosen": "", "rejected": ""}
    out = encoder({key: [value] for key, value in row.items()})
    messages = template_messages(row)
    texts = [official_render("qwen3", messages[:cut]) for cut in (2, 4)]
    assert out["input_ids"] == [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    # at answer 1 the official render holds its reasoning; later renders drop it (history)
    assert "<think>\nr1\n</think>" in texts[0] and "r1" not in texts[1]


@needs_official
def test_deepseek_r1_reasoning_follows_the_official_generation_prompt():
    official = official_template("deepseek_r1_distill")
    ours = get_template("deepseek_r1_distill")
    tokens = {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}
    prompt = official.render(TWO_ANSWERS[:3], add_generation_prompt=True, **tokens)
    assert ours.render(TWO_ANSWERS, **tokens) != official.render(TWO_ANSWERS, **tokens)  # official drops r2
    assert ours.render(TWO_ANSWERS, **tokens) == prompt + "r2\n</think>\n\na2<｜end▁of▁sentence｜>"
    assert not renders_reasoning(official)  # the tokenizer's own template has no place for it: an error, never a drop
