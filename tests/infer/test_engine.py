"""The inference engine: folders it loads, answers equal to plain model.generate, streaming that never splits a character."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from transformers import AutoTokenizer

from tests.infer.chat_helpers import messages
from tunelab.assets import TINY_MODEL_DIR
from tunelab.data.templates import get_template
from tunelab.errors import ConfigError, InferenceError, ModelError
from tunelab.infer.engine import ChatEngine, IncrementalDecoder, SamplingOptions, load_engine, resolve_folders

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingOptions(temperature=0, max_new_tokens=48)

CHATS = {
    "one turn": messages(None, [("Say hi", None)]),
    "history": messages(None, [("Say hi", "Hi! 你好 🙂"), ("Again", None)]),
    "system": messages("Be brief.", [("Count", None)]),
    "untrained": messages(None, [("What is the capital of France?", None)]),
}


@pytest.fixture(scope="module")
def engine(chat_model):
    return load_engine(str(chat_model.adapter))


@pytest.fixture(scope="module")
def merged_engine(chat_model):
    return load_engine(str(chat_model.merged))


@pytest.mark.slow  # over 2 s on the 2-core AVX2 reference: out of test-fast
def test_folders_model_adapter_and_neither(chat_model, tmp_path):
    assert resolve_folders(str(chat_model.merged)) == (str(chat_model.merged), None)
    assert resolve_folders(str(chat_model.adapter)) == (str(TINY_MODEL_DIR), str(chat_model.adapter))
    assert resolve_folders(str(chat_model.adapter), "tiny") == (str(TINY_MODEL_DIR), str(chat_model.adapter))
    assert resolve_folders("tiny") == (str(TINY_MODEL_DIR), None)
    with pytest.raises(ModelError, match=f"^{tmp_path} is neither a model folder .* nor a LoRA adapter folder"):
        resolve_folders(str(tmp_path))
    with pytest.raises(ModelError, match="no such folder"):
        resolve_folders(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="^--model: .* is a whole model .*; drop --model"):
        resolve_folders(str(chat_model.merged), "tiny")


def test_a_folder_without_chat_template_needs_template_option(tiny_llama_dir):
    with pytest.raises(ConfigError, match=r"has no chat_template .*; pass --template NAME, one of .*chatml"):
        load_engine(str(tiny_llama_dir))
    assert load_engine(str(tiny_llama_dir), template="chatml").template.name == "chatml"


def test_engine_reads_the_saved_template_and_stop_ids(engine, reference):
    assert engine.name == "adapter" and engine.template.name == "chatml"
    assert engine.stop_ids == sorted(reference.generation_config.eos_token_id) == [2, 4]  # </s>, <|im_end|>
    assert engine.context_length == 512


@pytest.mark.parametrize("chat", CHATS.values(), ids=CHATS.keys())
@pytest.mark.parametrize("folder", ["adapter", "merged"])
def test_greedy_answer_equals_model_generate(request, reference, chat, folder):
    engine = request.getfixturevalue("engine" if folder == "adapter" else "merged_engine")
    expected_ids = reference.generate(chat)
    generation = engine.generate(chat, GREEDY)
    pieces = list(generation)
    assert engine.prompt_ids(chat) == reference.prompt_ids(chat)
    assert generation.text == "".join(pieces) == reference.answer(chat)
    if "\ufffd" not in generation.text:  # an untrained model may emit invalid UTF-8, which decodes to U+FFFD
        assert all("\ufffd" not in piece for piece in pieces)
    assert generation.prompt_tokens == len(reference.prompt_ids(chat))
    assert generation.completion_tokens == len(expected_ids)
    assert generation.finish_reason == ("stop" if expected_ids[-1] in engine.stop_ids else "length")


def test_the_memorised_answers(engine):
    answers = {name: engine.complete(chat, GREEDY).text for name, chat in CHATS.items() if name != "untrained"}
    assert answers == {"one turn": "Hi! 你好 🙂", "history": "Hi again!", "system": "1 2 3"}
    generation = engine.generate(CHATS["one turn"], GREEDY)
    # "你" and "好" are three byte-tokens each, "🙂" four: each character arrives whole, once complete.
    assert list(generation) == ["H", "i", "!", " ", "你", "好", " ", "🙂"]
    assert (generation.completion_tokens, generation.finish_reason) == (16, "stop")


def test_max_new_tokens_ends_with_length(engine, reference):
    generation = engine.complete(CHATS["one turn"], SamplingOptions(temperature=0, max_new_tokens=3))
    assert (generation.text, generation.finish_reason, generation.completion_tokens) == ("Hi!", "length", 3)
    # Cut inside "你" (3 byte-tokens): the incomplete character comes out as U+FFFD at the very end, as decode gives it.
    generation = engine.complete(CHATS["one turn"], SamplingOptions(temperature=0, max_new_tokens=5))
    assert generation.text == reference.tokenizer.decode(reference.generate(CHATS["one turn"])[:5]) == "Hi! \ufffd"


def test_stop_strings_cut_the_answer_even_across_tokens(engine):
    generation = engine.complete(CHATS["one turn"], SamplingOptions(temperature=0, stop=("你好",)))
    assert (generation.text, generation.finish_reason) == ("Hi! ", "stop")
    # "!" and " " could begin "! x": held back until "你" rules it out, then given out together.
    pieces = list(engine.generate(CHATS["one turn"], SamplingOptions(temperature=0, stop=("! x",))))
    assert pieces == ["H", "i", "! 你", "好", " ", "🙂"]


def test_prompt_longer_than_the_context(engine):
    chat = messages(None, [("Say hi " * 300, None)])
    with pytest.raises(InferenceError, match=r"^the conversation is \d+ tokens; adapter reads at most 512"):
        engine.generate(chat, GREEDY)


def test_a_prompt_too_long_to_fit_is_refused_by_its_length(engine):
    """10 million characters: no 512 tokens of this vocabulary spell that much, so the prompt is refused by its
    length, never tokenised (it would hold the tokenizer, shared by every request, for seconds)."""
    longest = max(map(len, engine.tokenizer.get_vocab()))
    assert engine.longest_token_chars == longest
    with pytest.raises(InferenceError) as caught:
        engine.generate(messages(None, [("x" * 10_000_000, None)]), GREEDY)
    chars = int(re.fullmatch(r"the conversation is at least \d+ tokens \((\d+) characters\); adapter reads at most 512: "
                             r"start a new conversation or shorten it", str(caught.value)).group(1))
    assert str(caught.value).startswith(f"the conversation is at least {-(-chars // longest)} tokens")
    # just under the bound the prompt is tokenised, and refused by its count
    under = "x" * (longest * 512 - (chars - 10_000_000) - 1)
    with pytest.raises(InferenceError, match=r"^the conversation is \d+ tokens; adapter reads at most 512"):
        engine.generate(messages(None, [(under, None)]), GREEDY)


@pytest.mark.parametrize("top_k", [0, 40])
def test_seeded_sampling_is_repeatable(engine, top_k):
    """Compared within one compute path: which token a draw lands on is not portable across CPU models."""
    chat = CHATS["untrained"]
    options = SamplingOptions(temperature=1.3, top_p=0.95, top_k=top_k, max_new_tokens=12, seed=7)
    first, again = engine.complete(chat, options), engine.complete(chat, options)
    assert (again.text, again.finish_reason, again.completion_tokens) == (
        first.text, first.finish_reason, first.completion_tokens
    )
    # "length" only when the limit was reached; "stop" (an end-of-turn token) can come at any count up to it.
    assert first.finish_reason in ("stop", "length") and first.completion_tokens <= 12
    assert first.finish_reason == "stop" or first.completion_tokens == 12
    # the seed is used: other seeds do not all repeat this draw (one alone may, where the model is confident)
    assert any(engine.complete(chat, replace(options, seed=seed)).text != first.text for seed in range(8, 13))


@pytest.mark.parametrize("keep_one", [{"top_k": 1}, {"top_p": 1e-9}], ids=["top_k=1", "top_p~0"])
def test_sampling_that_keeps_one_token_is_greedy(engine, keep_one):
    for chat in CHATS.values():
        sampled = engine.complete(chat, SamplingOptions(temperature=1.3, max_new_tokens=48, **keep_one))
        assert sampled.text == engine.complete(chat, GREEDY).text


def test_tools_are_rendered_into_the_prompt(engine):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    qwen = get_template("qwen2_5")
    engine_with_tools = ChatEngine(engine.model, engine.tokenizer, qwen, "qwen-tools")
    chat = CHATS["one turn"]
    prompt = qwen.prompt(chat, [tool], bos_token="<s>", eos_token="</s>") + "<tool_call>"
    generation = engine_with_tools.generate(chat, GREEDY, tools=[tool], prefill="<tool_call>")
    assert generation.prompt_ids == engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert generation.prefill == "<tool_call>" and "get_weather" in prompt
    # chatml renders no tools: the engine says so
    assert engine.tool_syntax is None and engine_with_tools.tool_syntax.family == "hermes"


@pytest.mark.parametrize("name", ["qwen3", "qwen2_5", "deepseek_r1_distill"])
def test_a_call_sent_back_is_rendered_as_training_rendered_it(engine, name):
    # What an OpenAI client sends back: content null and the arguments as JSON text (without tojson's spaces).
    # Qwen3 trains that text as written, Qwen2.5 the object it holds, DeepSeek-R1 text with content null.
    import datasets  # noqa: PLC0415

    from tunelab.data.formats import template_messages, to_canonical  # noqa: PLC0415
    from tunelab.data.registry import DatasetSpec  # noqa: PLC0415

    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz":"Europe/Oslo"}'}}
    chat = [{"role": "user", "content": "Time in Oslo?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    rows = datasets.Dataset.from_list([{"messages": [*chat, {"role": "assistant", "content": "Noon."}]}])
    (row,), _ = to_canonical(rows, DatasetSpec(name="d", formatting="openai"))
    template = get_template(name)
    trained = template.prompt(template_messages(row, template)[:3], None, bos_token="<s>", eos_token="</s>")
    served = ChatEngine(engine.model, engine.tokenizer, template, name).prompt_ids(chat)
    assert served == engine.tokenizer(trained, add_special_tokens=False)["input_ids"]
    assert ('{"tz":"Europe/Oslo"}' in trained) == (name != "qwen2_5")


def test_incremental_decoder_never_splits_a_character(engine):
    text = "naïve 中文 🙂 ok"
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text.split())  # byte-level pieces: the multi-byte characters span several ids
    decoder = IncrementalDecoder(engine.tokenizer)
    pieces = [decoder.push(token_id) for token_id in ids]
    assert "".join(pieces) + decoder.flush() == text
    assert [p for p in pieces if p] == ["na", "ï", "ve", " ", "中", "文", " ", "🙂", " ", "ok"]


def test_a_special_tool_call_opening_is_kept_in_the_text(engine):
    """Mistral's [TOOL_CALLS] is a special token: decoding drops it, unless the answer may hold tool calls."""
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    tokenizer.add_tokens(["[TOOL_CALLS]"], special_tokens=True)
    mistral = ChatEngine(engine.model, tokenizer, get_template("mistral_v0_3"), "mistral")
    [opening] = tokenizer("[TOOL_CALLS]", add_special_tokens=False)["input_ids"]
    assert mistral._opening_tokens == {opening: "[TOOL_CALLS]"}
    assert engine._opening_tokens == {}  # chatml: no tool-call syntax
    ids = tokenizer(' [TOOL_CALLS] [{"name": "f"}]', add_special_tokens=False)["input_ids"]
    dropped = tokenizer.decode(ids, skip_special_tokens=True)
    assert "[TOOL_CALLS]" not in dropped
    for keep, expected in (({}, dropped), ({opening: "[TOOL_CALLS]"}, ' [TOOL_CALLS] [{"name": "f"}]')):
        decoder = IncrementalDecoder(tokenizer, keep=keep)
        assert "".join(decoder.push(token_id) for token_id in ids) + decoder.flush() == expected


def test_an_incomplete_checkpoint_is_refused(chat_model, tmp_path):
    import shutil  # noqa: PLC0415

    from safetensors.torch import load_file, save_file  # noqa: PLC0415

    folder = shutil.copytree(chat_model.merged, tmp_path / "broken")
    weights = load_file(folder / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelError, match=r"the weights lack model\.norm\.weight \(1 in all\); the checkpoint is incomplete"):
        load_engine(str(folder))
