"""Byte-identity of every built-in template with its family's official Hugging Face chat template.

The official texts are test data in ../shared/fixtures/chat_templates (beside the repo; CI has it, so these
tests run there and skip with the reason shown elsewhere); each is rendered with the same engine and compared
with ours over many conversation shapes, including tool use and the family-specific variables. Where the
official template refuses a conversation, ours must refuse it too.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from tests.fixture_paths import CHAT_TEMPLATE_FIXTURES
from tests.official import FAMILY as OFFICIAL
from tests.official import needs_official, special_tokens
from tests.official import official_template as official
from tunelab.data.templates import Template, get_template
from tunelab.errors import TemplateError

pytestmark = needs_official
FIXTURES = CHAT_TEMPLATE_FIXTURES

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
EXCHANGES = [
    ("Hello! Who are you?", "I am an AI assistant. How can I help you today?"),
    ("  What is 2+2?\n", "\n2+2 equals 4.  "),
    ("Say something in 中文 & JSON {\"a\": 1}", "好的：{\"a\": 1}"),
    ("Multi\nline\n\nquestion", "Multi\nline answer\n"),
]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {"id": "call12345", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


def conversation(turns: int, system: bool, answered: bool) -> list[dict[str, Any]]:
    messages = [SYSTEM] if system else []
    for question, answer in EXCHANGES[:turns]:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return messages if answered else messages[:-1]


def render_or_error(template: Template, messages: list[dict[str, Any]], **kwargs: Any) -> str | type:
    try:
        return template.render(messages, **kwargs)
    except TemplateError:
        return TemplateError


def assert_same(name: str, messages: list[dict[str, Any]], **kwargs: Any) -> None:
    kwargs = {**special_tokens(name), **kwargs}
    expected = render_or_error(official(name), messages, **kwargs)
    assert render_or_error(get_template(name), messages, **kwargs) == expected


SHAPES = list(itertools.product([1, 2, 3, 4], [False, True], [False, True], [False, True]))


@pytest.mark.parametrize("name", sorted(OFFICIAL))
@pytest.mark.parametrize(("turns", "system", "answered", "add_generation_prompt"), SHAPES)
def test_matches_official(name: str, turns: int, system: bool, answered: bool, add_generation_prompt: bool) -> None:
    assert_same(name, conversation(turns, system, answered), add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("name", sorted(OFFICIAL))
def test_matches_the_fixture_sample(name: str) -> None:
    # The stored sample guards the comparison itself: the official render must be what the collector saw.
    samples = json.loads((FIXTURES / "SAMPLES.json").read_text(encoding="utf-8"))[OFFICIAL[name]]
    sample = next(s for s in samples if s["error"] is None and s["case"].startswith("conv4_nosys"))
    messages = conversation(2, system=False, answered=True)
    messages[2:] = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "2+2 equals 4."}]
    kwargs = {**special_tokens(name), "add_generation_prompt": sample["add_generation_prompt"]}
    assert official(name).render(messages, **kwargs) == sample["output"]
    assert get_template(name).render(messages, **kwargs) == sample["output"]


@pytest.mark.parametrize("name", sorted(OFFICIAL))
@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
        [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "assistant", "content": "c"},
        ],
        [SYSTEM, {"role": "assistant", "content": "first"}],
        [{"role": "system", "content": ""}, {"role": "user", "content": "empty system"}],
        [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}],
        [
            {"role": "user", "content": "same"},
            {"role": "assistant", "content": "x"},
            {"role": "user", "content": "same"},
        ],
    ],
    ids=["user-user", "assistant-assistant", "assistant-first", "empty-system", "empty-content", "repeated-user"],
)
def test_matches_official_on_odd_conversations(name: str, messages: list[dict[str, Any]]) -> None:
    for add_generation_prompt in (False, True):
        assert_same(name, messages, add_generation_prompt=add_generation_prompt)


def test_refusals_match_official() -> None:
    # gemma2 refuses a system turn, llama2/gemma refuse broken alternation: ours must refuse the same way.
    with_system = conversation(1, system=True, answered=True)
    assert render_or_error(official("gemma2"), with_system) is TemplateError
    with pytest.raises(TemplateError, match="System role not supported"):
        get_template("gemma2").render(with_system)
    double_user = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    for name in ("llama2", "gemma2", "gemma3", "mistral_nemo"):
        with pytest.raises(TemplateError, match="roles must alternate"):
            get_template(name).render(double_user)


# --- tool use -----------------------------------------------------------------------------------------


def tool_conversation(system: bool, content: Any = "", arguments: Any = None) -> list[dict[str, Any]]:
    call = {**CALL, "function": {**CALL["function"], "arguments": arguments or CALL["function"]["arguments"]}}
    messages = [SYSTEM] if system else []
    return [
        *messages,
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": content, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call12345", "name": "get_weather", "content": '{"temp": 20}'},
        {"role": "assistant", "content": "It is 20 degrees in Paris."},
        {"role": "user", "content": "And in Rome?"},
    ]


TOOL_FAMILIES = ["qwen2_5", "qwen3", "llama3_1", "mistral_v0_3", "mistral_nemo"]


@pytest.mark.parametrize("name", TOOL_FAMILIES)
@pytest.mark.parametrize("system", [False, True])
@pytest.mark.parametrize("cut", [2, 3, 4, 5])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_tool_use_matches_official(name: str, system: bool, cut: int, add_generation_prompt: bool) -> None:
    messages = tool_conversation(system)[: cut + system]
    for tools in (None, [WEATHER_TOOL], [WEATHER_TOOL, {**WEATHER_TOOL, "function": {"name": "noop"}}]):
        assert_same(name, messages, tools=tools, add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("name", ["qwen2_5", "qwen3"])
def test_qwen_tool_variants_match_official(name: str) -> None:
    bare_call = {"name": "get_weather", "arguments": '{"city": "Paris"}'}  # no "function" wrapper, string args
    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking both.", "tool_calls": [CALL, {**CALL, "function": bare_call}]},
        {"role": "tool", "content": "20"},
        {"role": "tool", "content": "25"},
        {"role": "system", "content": "mid-conversation system"},
        {"role": "assistant", "content": "Paris 20, Rome 25."},
    ]
    for cut in range(2, len(messages) + 1):
        for add_generation_prompt in (False, True):
            assert_same(name, messages[:cut], tools=[WEATHER_TOOL], add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"date_string": "01 Jan 2025"},
        {"tools_in_user_message": False},
        {"builtin_tools": ["brave_search", "code_interpreter", "get_weather"]},
        {"custom_tools": [WEATHER_TOOL]},
    ],
    ids=["plain", "date", "tools-in-system", "builtin", "custom"],
)
@pytest.mark.parametrize("tools", [None, [WEATHER_TOOL]])
def test_llama3_1_variables_match_official(kwargs: dict[str, Any], tools: Any) -> None:
    tool_output = [{"role": "tool", "content": "plain text"}, {"role": "ipython", "content": {"temp": 20}}]
    for messages in (tool_conversation(True), tool_conversation(False), tool_conversation(False)[:3] + tool_output):
        for add_generation_prompt in (False, True):
            assert_same("llama3_1", messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)


def test_llama3_1_refusals_match_official() -> None:
    two_calls = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [CALL, CALL]}]
    assert_same("llama3_1", two_calls)
    assert_same("llama3_1", [SYSTEM], tools=[WEATHER_TOOL])
    with pytest.raises(TemplateError, match="single tool-calls"):
        get_template("llama3_1").render(two_calls)


def test_mistral_nemo_tool_ids_match_official() -> None:
    messages = tool_conversation(False)
    messages[1] = {**messages[1], "tool_calls": [{**CALL, "id": "short"}]}
    assert_same("mistral_nemo", messages)
    wrapped = tool_conversation(False)
    wrapped[2] = {"role": "tool_results", "tool_call_id": "call12345", "content": {"content": "20"}}
    assert_same("mistral_nemo", wrapped)


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nanswer"}],
        [
            {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "<think>r1</think>a1"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "a2", "reasoning_content": "\nr2\n"},
        ],
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "user", "content": "<tool_response>\n20\n</tool_response>"},
            {"role": "assistant", "content": "<think>\nsaw it\n</think>\n\nIt is 20."},
        ],
    ],
    ids=["think-in-content", "reasoning-field", "tool-response-as-user"],
)
@pytest.mark.parametrize("enable_thinking", [None, True, False])
def test_qwen3_reasoning_matches_official(messages: list[dict[str, Any]], enable_thinking: bool | None) -> None:
    extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    for cut in range(1, len(messages) + 1):
        for add_generation_prompt in (False, True):
            assert_same("qwen3", messages[:cut], add_generation_prompt=add_generation_prompt, **extra)


def test_deepseek_r1_distill_tools_and_reasoning_match_official() -> None:
    call = {**CALL, "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        {"role": "system", "content": "sys one"},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call, call]},
        {"role": "tool", "content": "20"},
        {"role": "tool", "content": "21"},
        {"role": "assistant", "content": "It is 20."},
        {"role": "user", "content": "Again?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "22"},
        {"role": "system", "content": "sys two (the last system message wins)"},
        {"role": "user", "content": "Why?"},
        {"role": "assistant", "content": "<think>\nbecause\n</think>\n\nBecause."},
    ]
    for cut in range(1, len(messages) + 1):
        for add_generation_prompt in (False, True):
            assert_same("deepseek_r1_distill", messages[:cut], add_generation_prompt=add_generation_prompt)


def test_gemma3_content_parts_match_official() -> None:
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "System as parts."}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "  What is this?  "}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
    ]
    for cut in (2, 3):
        for add_generation_prompt in (False, True):
            assert_same("gemma3", messages[:cut], add_generation_prompt=add_generation_prompt)
    assert_same("gemma3", [{"role": "user", "content": 42}])


def test_glm4_tools_and_metadata_match_official() -> None:
    tools = [
        WEATHER_TOOL,
        {"type": "python"},
        {"type": "simple_browser"},
        {"type": "cogview"},
        {"type": "unknown"},
    ]
    messages = [
        {"role": "system", "content": "", "tools": tools},
        {"role": "user", "content": "天气如何？"},
        {"role": "assistant", "metadata": "get_weather", "content": '{"city": "Paris"}'},
        {"role": "observation", "content": '{"temp": 20}'},
        {"role": "assistant", "content": "20 度。"},
    ]
    for cut in range(1, len(messages) + 1):
        for add_generation_prompt in (False, True):
            assert_same("glm4", messages[:cut], add_generation_prompt=add_generation_prompt)
    with_content = [{**messages[0], "content": "Also a system text."}, *messages[1:]]
    assert_same("glm4", with_content)
