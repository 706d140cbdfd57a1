"""Tool calls: each template's call syntax read from its own render, exact parses of answers, and streaming splits."""

from __future__ import annotations

import re

import pytest

from tests.fixture_paths import CHAT_TEMPLATE_FIXTURES
from tunelab.data.templates import TEMPLATE_NAMES, Template, get_template
from tunelab.infer.tool_calls import (
    BUILTIN_FAMILIES,
    ToolCallStream,
    ToolSyntax,
    parse_hermes,
    parse_llama3_json,
    parse_mistral,
    tool_syntax,
)

BOS, EOS = "<s>", "</s>"


def syntax_of(name: str) -> ToolSyntax | None:
    return tool_syntax(get_template(name), BOS, EOS)


def test_builtin_templates_have_the_syntax_of_their_family():
    assert {name: getattr(syntax_of(name), "family", None) for name in TEMPLATE_NAMES} == {
        name: BUILTIN_FAMILIES.get(name) for name in TEMPLATE_NAMES
    }
    # What an answer with calls starts with, read from each template's own render of a probe call.
    assert syntax_of("qwen2_5") == ToolSyntax("hermes", "<tool_call>", ('<tool_call>\n{"name": "', '", "arguments": '))
    assert syntax_of("qwen3").call_opening == "<think>\n\n</think>\n\n<tool_call>"  # the empty think block first
    assert syntax_of("default") == ToolSyntax("hermes", " \n<tool_call>", (' \n<tool_call>{"name": "', '", "arguments": '))
    assert syntax_of("llama3_1") == ToolSyntax("llama3_json", "{", ('{"name": "', '", "parameters": '))
    assert syntax_of("mistral_v0_3").prefill("get_weather") == ' [TOOL_CALLS] [{"name": "get_weather", "arguments": '
    assert syntax_of("mistral_nemo").prefill(None) == "[TOOL_CALLS]"


@pytest.mark.parametrize("name", sorted(BUILTIN_FAMILIES))
def test_a_models_own_template_is_probed_without_the_table(name):
    own = Template.from_jinja("model", get_template(name).jinja, bos_token=BOS, eos_token=EOS)
    assert tool_syntax(own, BOS, EOS) == syntax_of(name)


def test_official_templates_are_probed_to_their_family():
    if not CHAT_TEMPLATE_FIXTURES.is_dir():
        pytest.skip(f"official chat templates not found at {CHAT_TEMPLATE_FIXTURES} (../shared beside the checkout)")
    families = {}
    for path in sorted(CHAT_TEMPLATE_FIXTURES.glob("*.jinja")):
        template = Template.from_jinja("model", path.read_text(encoding="utf-8"), bos_token=BOS, eos_token=EOS)
        families[path.stem] = getattr(tool_syntax(template, BOS, EOS), "family", None)
    assert {family: name for family, name in families.items() if name} == {
        "llama3_1": "llama3_json", "mistral_nemo": "mistral", "mistral_v0_3": "mistral",
        "qwen2_5": "hermes", "qwen3": "hermes",
    }


WEATHER = ("get_weather", {"city": "Paris"})


def test_hermes_answers():
    two_calls = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    assert parse_hermes(two_calls) == ("Let me check.", [WEATHER, ("get_time", {})])
    # Arguments as JSON text, and a last block the model ended without its closing tag.
    assert parse_hermes('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}') == ("", [("f", {"a": 1})])
    assert parse_hermes("no call here") is None
    for broken in (
        '<tool_call>{"name": "f", "arguments": {',  # cut by max_tokens
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "f", "arguments": {}} and more</tool_call>',
    ):
        assert parse_hermes(broken) is None, broken


def test_hermes_reads_untagged_calls_as_llama_cpp_does():
    # Qwen2.5-Coder-0.5B-Instruct answers with the object alone, without <tool_call> (seen in its greedy answers);
    # llama.cpp's Hermes parser, where such models are deployed, makes the opening tag optional.
    bare = '{"name": "python", "arguments": {"code": "440818 * 52535"}}'
    assert parse_hermes(bare) == ("", [("python", {"code": "440818 * 52535"})])
    assert parse_hermes(f"  {bare}\n{bare}\n")[1] == [("python", {"code": "440818 * 52535"})] * 2
    fenced = '```json\n{\n  "name": "python",\n  "arguments": {"code": "26 ** 184 % 9973"}\n}\n```'  # also seen
    assert parse_hermes(fenced) == ("", [("python", {"code": "26 ** 184 % 9973"})])
    for not_a_call in (
        '```python\nprint(1)\n```',
        f"```json\n{bare}\n``` and text",
        '{"answer": 42}',  # no name
        '{"name": "Bob", "age": 42}',  # no arguments: a JSON answer, not a call
        f"Sure: {bare}",  # untagged calls are the whole answer or nothing
        f"{bare} and then some text",
        '{"name": "python", "arguments": {"code": ',  # cut by max_tokens
    ):
        assert parse_hermes(not_a_call) is None, not_a_call


def test_llama3_json_answers():
    assert parse_llama3_json(' {"name": "get_weather", "parameters": {"city": "Paris"}}\n') == ("", [WEATHER])
    assert parse_llama3_json('<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris"}}') == ("", [WEATHER])
    assert parse_llama3_json('The call is {"name": "get_weather", "parameters": {}}') is None
    assert parse_llama3_json('{"name": "get_weather", "parameters": {}} and text') is None
    assert parse_llama3_json('{"answer": 42}') is None


def test_mistral_answers():
    text = 'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "g", "arguments": {}}]'
    assert parse_mistral(text) == ("Sure.", [WEATHER, ("g", {})])
    assert parse_mistral('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcdefghi"}]') == (
        "", [WEATHER]
    )
    assert parse_mistral('[TOOL_CALLS] [{"name": "g", "arguments": {}}, {"arguments": {}}]') is None
    assert parse_mistral("[TOOL_CALLS] [") is None


def test_call_ids_and_wire_format():
    content, calls = syntax_of("qwen2_5").parse('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>')
    assert content == "" and len(calls) == 1
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", calls[0].id)
    assert calls[0].as_openai() == {"id": calls[0].id, "type": "function",
                                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    # Mistral-Nemo's template accepts only ids of 9 letters and digits.
    _, calls = syntax_of("mistral_nemo").parse('[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]')
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", call.id) for call in calls) and calls[0].id != calls[1].id


def split(syntax: ToolSyntax, pieces: list[str]) -> tuple[list[str], str, list[tuple[str, dict]]]:
    stream = ToolCallStream(syntax)
    out = [stream.feed(piece) for piece in pieces]
    rest, calls = stream.finish()
    return out, rest, [(call.name, call.arguments) for call in calls]


@pytest.mark.parametrize("name, answer", [
    ("qwen2_5", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    ("qwen2_5", "A plain answer, < and <tool but no call.\n"),
    ("qwen2_5", '<tool_call>\n{"name": "get_weather", "argu'),
    ("qwen2_5", ' {"name": "get_weather", "arguments": {"city": "Paris"}}'),
    ("qwen2_5", '{"name": "get_weather", "argu'),
    ("qwen2_5", '{"a": 1} is JSON'),
    ("qwen2_5", '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```'),
    ("qwen2_5", "```python\nprint(1)\n```"),
    ("qwen2_5", "`x` is code"),
    ("llama3_1", '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
    ("llama3_1", "  Hello {world}"),
    ("mistral_v0_3", 'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
])
def test_streamed_answers_split_as_whole_ones(name, answer):
    syntax = syntax_of(name)
    whole_out, whole_rest, whole_calls = split(syntax, [answer])
    pieces_out, pieces_rest, pieces_calls = split(syntax, list(answer))  # one character at a time
    assert "".join(pieces_out) + pieces_rest == "".join(whole_out) + whole_rest
    assert pieces_calls == whole_calls
    parsed = syntax.parse(answer)
    if parsed:  # the same calls and content as the whole-answer parser
        assert whole_calls == [(call.name, call.arguments) for call in parsed[1]]
        assert "".join(whole_out) + whole_rest == parsed[0]
    else:  # no well-formed call: everything is content, nothing lost
        assert (whole_calls, "".join(whole_out) + whole_rest) == ([], answer)


def test_content_streams_until_a_call_opens():
    hermes = syntax_of("qwen2_5")
    out, rest, calls = split(hermes, ["Let me", " check.", " <tool", "_call>", '{"name": "g", "arguments": {}}', "</tool_call>"])
    # " <tool" could begin the opening: held; the whitespace before a call is not content.
    assert (out, rest, calls) == (["Let me", " check.", "", "", "", ""], "", [("g", {})])
    out, rest, calls = split(hermes, ["Say", " <tool", "box>", " here"])
    assert (out, rest, calls) == (["Say", "", " <toolbox>", " here"], "", [])
    # An untagged call is the whole answer: "{" first holds it; any other first character rules it out.
    assert split(hermes, ["{", '"name": "g", ', '"arguments": {}}']) == (["", "", ""], "", [("g", {})])
    assert split(hermes, [" ", "x {", '"name": "g", "arguments": {}}']) == (["", " x {", '"name": "g", "arguments": {}}'], "", [])
    # Llama-3.1: a call is the whole answer, so a first character other than "{" rules it out.
    out, rest, calls = split(syntax_of("llama3_1"), [" ", "Hi", " there", "{"])
    assert (out, rest, calls) == (["", " Hi", " there", "{"], "", [])
