"""Conversations for the real-tokenizer tests (test_real_tokenizers.py), written as openai-format dataset rows.

Each is a row as a user would write it in a JSON-lines file: `messages` (system, user, assistant with
`tool_calls` and `content: null`, tool results with `tool_call_id`, `reasoning_content` or an inline
<think> block) and `tools`. Together they cover: several exchanges, with and without a system prompt (and an
explicitly empty one); CJK, emoji with skin-tone and ZWJ sequences, combining marks; answers that start with
spaces or new lines, end with a space, or are empty; one tool call, parallel calls, two rounds of calls, a call
turn with text; reasoning in both spellings. ``TRUNCATION`` is the longer conversation truncation is swept on.
"""

from __future__ import annotations

import json
from typing import Any

SYSTEM = "You are a concise assistant."

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def call(call_id: str, city: str) -> dict[str, Any]:
    """An openai tool call: arguments as JSON text, as chat APIs send them."""
    return {"id": call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city}, ensure_ascii=False)}}


def user(content: str) -> dict[str, Any]:
    return {"role": "user", "content": content}


def answer(content: str | None, calls: list[dict[str, Any]] | None = None, reasoning: str | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message


def result(call_id: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def system(content: str) -> dict[str, Any]:
    return {"role": "system", "content": content}


CONVERSATIONS: dict[str, dict[str, Any]] = {
    "chat": {"messages": [
        system(SYSTEM),
        user("What is 12 + 30?"), answer("12 + 30 = 42."),
        user("Say hello in Chinese, Japanese and Korean."), answer("你好！こんにちは！안녕하세요！"),
        user("And with emoji?"), answer("Hello 👋🏽 world 🌍, and a family: 👩\u200d👩\u200d👧."),
    ]},
    "whitespace": {"messages": [
        user("  An indented question?\n"), answer("  Two leading spaces."),
        user("Next?"), answer("\nA new line first."),
        user("Last?"), answer("\n\nTwo new lines, then a trailing space "),
    ]},
    "combining": {"messages": [
        system(SYSTEM),
        user("Spell café with a combining accent."), answer("cafe\u0301 (e + U+0301), and n\u0303, a\u0308\u0301."),
    ]},
    "empty_system": {"messages": [system(""), user("Hi!"), answer("Hello.")]},
    "empty_answer": {"messages": [user("Say nothing at all."), answer("")]},
    "tool_single": {"tools": [WEATHER_TOOL], "messages": [
        user("What's the weather in Paris?"),
        answer(None, [call("call_1", "Paris")]),
        result("call_1", '{"temp": 20, "unit": "°C"}'),
        answer("It is 20 °C in Paris."),
    ]},
    "tool_parallel": {"tools": [WEATHER_TOOL], "messages": [
        system(SYSTEM),
        user("Weather in Paris and 東京?"),
        answer(None, [call("call_1", "Paris"), call("call_2", "東京")]),
        result("call_1", '{"temp": 20}'),
        result("call_2", '{"temp": 25}'),
        answer("Paris 20 °C, 東京 25 °C."),
    ]},
    "tool_two_rounds": {"tools": [WEATHER_TOOL], "messages": [
        user("Weather in Paris, then in Rome?"),
        answer(None, [call("call_1", "Paris")]),
        result("call_1", '{"temp": 20}'),
        answer(None, [call("call_2", "Rome")]),
        result("call_2", '{"temp": 25}'),
        answer("Paris 20 °C, Rome 25 °C."),
    ]},
    "tool_call_with_text": {"tools": [WEATHER_TOOL], "messages": [
        user("Is it warm in Paris?"),
        answer("Let me check.", [call("call_1", "Paris")]),
        result("call_1", '{"temp": 20}'),
        answer("Yes: 20 °C."),
    ]},
    "reasoning": {"messages": [
        user("2+2?"), answer("4", reasoning="Two plus two is four."),
        user("And 3+3?"), answer("6", reasoning="Three plus three is six."),
    ]},
    "reasoning_inline": {"messages": [
        user("2+2?"), answer("<think>\nTwo plus two is four.\n</think>\n\n4"),
    ]},
}

TRUNCATION = {"messages": [
    system(SYSTEM),
    user("Name three colours, please."), answer("Red, green and blue."),
    user("Translate 'thank you' into Japanese."), answer("ありがとうございます (arigatō gozaimasu)."),
    user("Summarise: " + " ".join(f"word{i}" for i in range(40))), answer("  A list of forty numbered words."),
    user("Which emoji means agreement?"), answer("👍🏽 — thumbs up."),
]}


def answers_of(row: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in row["messages"] if m["role"] == "assistant"]
