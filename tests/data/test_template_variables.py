"""Template variables (template_kwargs): which variables a template reads, and that the run's values reach every
render of the data path — the sft encoder (build_datasets), pairs, grpo/ppo prompts, streaming — and the cache key."""

from __future__ import annotations

import dataclasses

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from tests.fixture_paths import CHAT_TEMPLATE_FIXTURES
from tunelab.config.args import DataArguments
from tunelab.data.cache import dataset_inputs, fingerprint
from tunelab.data.encode import SupervisedEncoder
from tunelab.data.pairwise import preference_encoder
from tunelab.data.pipeline import build_datasets
from tunelab.data.prompts import PromptEncoder
from tunelab.data.streaming import supervised_stream
from tunelab.data.templates import check_template_kwargs, get_template, template_variables
from tunelab.data.templates.builtin import builtin_source
from tunelab.errors import TemplateError

NO_THINKING = {"enable_thinking": False}
EMPTY_THINK = "<think>\n\n</think>\n\n"
ROW = {"system": "", "tools": "", "messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]}


def supervised_text(tokenizer, example: dict) -> str:
    return tokenizer.decode([t for t, label in zip(example["input_ids"], example["labels"]) if label != -100])


def test_the_variables_each_builtin_reads():
    reads = {name: template_variables(name, builtin_source(name)) for name in ("chatml", "gemma3", "qwen2_5", "qwen3", "llama3_1")}
    assert reads == {
        "chatml": frozenset(),
        "gemma3": frozenset(),  # first_prefix / turns are set in branches: helpers, not options
        "qwen2_5": frozenset(),  # system is set on every path
        "qwen3": frozenset({"enable_thinking"}),
        "llama3_1": frozenset({"builtin_tools", "custom_tools", "date_string", "tools_in_user_message"}),
    }
    with pytest.raises(TemplateError, match="^template_kwargs: template 'qwen3' does not read 'thinking'; it reads enable_thinking$"):
        check_template_kwargs("qwen3", builtin_source("qwen3"), {"thinking": False})


def test_official_templates_read_the_same_variables():
    if not CHAT_TEMPLATE_FIXTURES.is_dir():
        pytest.skip(f"official chat templates not found at {CHAT_TEMPLATE_FIXTURES} (test data beside the checkout)")
    for name in ("qwen3", "llama3_1"):
        official = (CHAT_TEMPLATE_FIXTURES / f"{name}.jinja").read_text(encoding="utf-8")
        assert template_variables(name, official) == template_variables(name, builtin_source(name))


def test_qwen3_without_thinking_trains_the_official_render(tiny_tokenizer):
    if not CHAT_TEMPLATE_FIXTURES.is_dir():
        pytest.skip(f"official chat templates not found at {CHAT_TEMPLATE_FIXTURES} (test data beside the checkout)")
    official = (CHAT_TEMPLATE_FIXTURES / "qwen3.jinja").read_text(encoding="utf-8")
    expected = render_jinja_template([ROW["messages"]], chat_template=official, enable_thinking=False)[0][0]
    assert EMPTY_THINK + "4<|im_end|>" in expected
    template = get_template("qwen3", tiny_tokenizer)
    encoder = SupervisedEncoder(tiny_tokenizer, template, cutoff_len=256, template_vars=NO_THINKING)
    (example,) = encoder.encode_rows([ROW])[0]
    assert tiny_tokenizer.decode(example["input_ids"]) == expected  # the training text is the official render
    # thinking off: the empty think block is part of the prompt the model is given, so it does not train
    assert supervised_text(tiny_tokenizer, example) == "4<|im_end|>"
    (thinking,) = SupervisedEncoder(tiny_tokenizer, template, cutoff_len=256).encode_rows([ROW])[0]
    assert supervised_text(tiny_tokenizer, thinking) == EMPTY_THINK + "4<|im_end|>"


def test_build_datasets_pairs_and_prompts_use_template_kwargs(tiny_tokenizer):
    template = get_template("qwen3", tiny_tokenizer)
    args = DataArguments(template="qwen3", template_kwargs=NO_THINKING, dataset=["demo_sort"], max_samples=4, cutoff_len=256)
    bundle = build_datasets(args, tiny_tokenizer, template, seed=0)
    texts = [tiny_tokenizer.decode(ids) for ids in bundle.train["input_ids"]]
    assert all(f"<|im_start|>assistant\n{EMPTY_THINK}" in text for text in texts)
    assert not any("<think>" in supervised_text(tiny_tokenizer, e) for e in bundle.train)
    without = build_datasets(dataclasses.replace(args, template_kwargs=None), tiny_tokenizer, template, seed=0)
    assert all(supervised_text(tiny_tokenizer, e).startswith(EMPTY_THINK) for e in without.train)

    for stage in ("dpo", "kto"):
        assert preference_encoder(stage, tiny_tokenizer, template, args).encoder.template_vars == NO_THINKING
    prompt = PromptEncoder(tiny_tokenizer, template, NO_THINKING)(ROW)["prompt"]
    assert prompt.endswith("<|im_start|>assistant\n" + EMPTY_THINK)
    assert PromptEncoder(tiny_tokenizer, template)(ROW)["prompt"].endswith("<|im_start|>assistant\n")


def test_streaming_uses_template_kwargs(tiny_tokenizer):
    template = get_template("qwen3", tiny_tokenizer)
    args = DataArguments(template="qwen3", template_kwargs=NO_THINKING, dataset=["demo_sort"], cutoff_len=256, streaming=True)
    example = next(iter(supervised_stream(args, tiny_tokenizer, template, seed=0)))
    assert f"<|im_start|>assistant\n{EMPTY_THINK}" in tiny_tokenizer.decode(example["input_ids"])
    assert "<think>" not in supervised_text(tiny_tokenizer, example)


def test_different_template_kwargs_never_share_a_cache_entry(tiny_tokenizer):
    source = get_template("qwen3", tiny_tokenizer).jinja

    def key(template_kwargs):
        args = DataArguments(template="qwen3", template_kwargs=template_kwargs, dataset=["demo_sort"])
        return fingerprint(dataset_inputs(args, tiny_tokenizer, source, "sft", 0))

    assert key(NO_THINKING) == key({"enable_thinking": False})
    assert len({key(None), key(NO_THINKING), key({"enable_thinking": True})}) == 3


def test_aliases_render_llamafactorys_format():
    """What LlamaFactory's qwen and gemma templates write for these conversations (its string slots, worked out by
    hand): the aliases' built-ins write the same."""
    from tunelab.data.templates import resolve_template_name

    system, exchanges = {"role": "system", "content": "Be brief."}, [
        {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6"},
    ]
    expected = {
        ("qwen", False): "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
        "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n6<|im_end|>\n",
        ("qwen", True): "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n6<|im_end|>\n",
        ("gemma", True): "<bos><start_of_turn>user\nBe brief.\n\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"
        "4<end_of_turn>\n<start_of_turn>user\nAnd 3+3?<end_of_turn>\n<start_of_turn>model\n6<end_of_turn>\n",
    }
    for (alias, with_system), text in expected.items():
        name, _ = resolve_template_name(alias)
        messages = [system, *exchanges] if with_system else exchanges
        assert get_template(name).render(messages, bos_token="<bos>" if alias == "gemma" else "") == text
