"""`tunelab api` started as a real server on a loopback port, called with the official `openai` client."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import openai
import pytest

from tests.infer.chat_helpers import (
    WEATHER_ANSWER,
    WEATHER_QUESTION,
    WEATHER_RESULT,
    WEATHER_TOOL,
    api_server,
    build_tool_model,
    messages,
)
from tunelab.infer.engine import load_engine

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]
API_KEY = "sk-tunelab-test"


@dataclass(frozen=True)
class Server:
    url: str  # http://127.0.0.1:PORT/v1

    def client(self, api_key: str = API_KEY):
        return openai.OpenAI(base_url=self.url, api_key=api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def server(chat_model, tmp_path_factory):
    """`tunelab api ADAPTER --port 0 --api-key KEY` in a subprocess; the port is read from uvicorn's start line."""
    log = tmp_path_factory.mktemp("api") / "server.log"
    with api_server([str(chat_model.adapter), "--api-key", API_KEY], log) as (host, port, _):
        yield Server(f"http://{host}:{port}/v1")
    assert "Finished server process" in log.read_text()


def raw_request(url: str, body: dict | None = None, api_key: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {api_key}"} if api_key else {})
    data = json.dumps(body).encode() if body is not None else None
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


HELLO = messages(None, [("Say hi", None)])
AGAIN = messages(None, [("Say hi", "Hi! 你好 🙂"), ("Again", None)])


def test_models_and_health(server):
    assert [model.id for model in server.client().models.list()] == ["adapter"]
    assert server.client().models.retrieve("adapter").owned_by == "tunelab"
    assert raw_request(server.url.removesuffix("/v1") + "/health") == (200, {"status": "ok"})


@pytest.mark.parametrize("chat", [HELLO, AGAIN], ids=["one turn", "history"])
def test_greedy_completion_equals_model_generate(server, reference, chat):
    expected_ids = reference.generate(chat)
    response = server.client().chat.completions.create(model="adapter", messages=chat, temperature=0)
    assert response.object == "chat.completion" and response.model == "adapter"
    assert response.id.startswith("chatcmpl-")
    [choice] = response.choices
    assert (choice.message.role, choice.message.content, choice.finish_reason) == (
        "assistant", reference.answer(chat), "stop"
    )
    assert choice.message.content == {"Say hi": "Hi! 你好 🙂", "Again": "Hi again!"}[chat[-1]["content"]]
    usage = response.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(reference.prompt_ids(chat)), len(expected_ids))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_streaming_chunks_join_to_the_same_answer(server, reference):
    stream = server.client().chat.completions.create(
        model="adapter", messages=HELLO, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert {chunk.object for chunk in chunks} == {"chat.completion.chunk"}
    assert len({chunk.id for chunk in chunks}) == 1
    first, *middle, last, usage = chunks
    assert (first.choices[0].delta.role, first.choices[0].delta.content) == ("assistant", "")
    pieces = [chunk.choices[0].delta.content for chunk in middle]
    assert pieces == ["H", "i", "!", " ", "你", "好", " ", "🙂"]  # whole characters, never split bytes
    assert "".join(pieces) == reference.answer(HELLO)
    assert all(chunk.choices[0].finish_reason is None for chunk in [first, *middle])
    assert (last.choices[0].delta.content, last.choices[0].finish_reason) == (None, "stop")
    assert usage.choices == [] and (usage.usage.prompt_tokens, usage.usage.completion_tokens) == (
        len(reference.prompt_ids(HELLO)), len(reference.generate(HELLO))
    )


def test_raw_stream_is_server_sent_events_ending_with_done(server):
    request = urllib.request.Request(
        server.url + "/chat/completions",
        data=json.dumps({"model": "adapter", "messages": HELLO, "temperature": 0, "max_tokens": 2, "stream": True}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        events = response.read().decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    payloads = [json.loads(event.removeprefix("data: ")) for event in events[:-2]]
    assert [p["choices"][0]["delta"] for p in payloads] == [{"role": "assistant", "content": ""}, {"content": "H"}, {"content": "i"}, {}]
    assert [p["choices"][0]["finish_reason"] for p in payloads] == [None, None, None, "length"]


def test_max_tokens_stop_and_seed(server):
    client = server.client()
    cut = client.chat.completions.create(model="adapter", messages=HELLO, temperature=0, max_tokens=3)
    assert (cut.choices[0].message.content, cut.choices[0].finish_reason, cut.usage.completion_tokens) == ("Hi!", "length", 3)
    stopped = client.chat.completions.create(model="adapter", messages=HELLO, temperature=0, stop=["你好", "zz"])
    assert (stopped.choices[0].message.content, stopped.choices[0].finish_reason) == ("Hi! ", "stop")
    chat = messages(None, [("What is the capital of France?", None)])
    sampled = [
        client.chat.completions.create(
            model="adapter", messages=chat, temperature=1.3, top_p=0.95, max_tokens=12, seed=seed,
        ).choices[0].message.content
        for seed in (7, 7, 8)
    ]
    assert sampled[0] == sampled[1] != sampled[2]  # the seed makes a sample repeatable


def test_parallel_clients_get_their_own_answers(server):
    """Eight clients at once (the server batches up to 8 requests): each gets the greedy answer to its question."""
    chats = {"Hi! 你好 🙂": HELLO, "Hi again!": AGAIN, "1 2 3": messages("Be brief.", [("Count", None)])}
    expected = [answer for answer in chats for _ in range(3)][:8]

    def ask(answer: str) -> str:
        reply = server.client().chat.completions.create(model="adapter", messages=chats[answer], temperature=0)
        return reply.choices[0].message.content

    with ThreadPoolExecutor(max_workers=8) as pool:
        assert list(pool.map(ask, expected)) == expected


def test_api_key_is_required(server):
    with pytest.raises(openai.AuthenticationError) as caught:
        server.client(api_key="sk-wrong").models.list()
    assert caught.value.status_code == 401
    assert caught.value.body == {"message": "Incorrect API key provided.", "type": "invalid_request_error",
                                 "param": None, "code": "invalid_api_key"}
    status, body = raw_request(server.url + "/chat/completions", {"model": "adapter", "messages": HELLO})
    assert (status, body["error"]["type"], body["error"]["code"]) == (401, "invalid_request_error", None)
    assert body["error"]["message"].startswith("You didn't provide an API key")


def test_refused_requests_say_why(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as caught:  # the chatml template renders no tools
        client.chat.completions.create(model="adapter", messages=HELLO, tools=[WEATHER_TOOL])
    assert caught.value.body["param"] == "tools"
    assert caught.value.body["message"].startswith(
        "tools: the chat template 'chatml' has no tool-call format (it does not render tools, or writes calls in a "
        "syntax tunelab does not parse); train and serve with a template that has one (default, llama3_1, "
    )
    # tool_choice "none": the tools are not shown to the model, so any template serves the request
    plain = client.chat.completions.create(model="adapter", messages=HELLO, tools=[WEATHER_TOOL], tool_choice="none",
                                           temperature=0)
    assert (plain.choices[0].message.content, plain.choices[0].message.tool_calls) == ("Hi! 你好 🙂", None)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="adapter", messages=HELLO, n=2)
    assert caught.value.status_code == 400 and caught.value.body["param"] == "n"
    assert caught.value.body["message"].startswith("n: this server returns one choice per request, got n=2")
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=HELLO)
    assert caught.value.body["code"] == "model_not_found"
    assert caught.value.body["message"] == "The model 'gpt-4o' does not exist; this server serves 'adapter'"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="adapter", messages=HELLO, temperature=3)
    assert caught.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="adapter", messages=messages(None, [("Say hi " * 300, None)]))
    assert caught.value.body["code"] == "context_length_exceeded"
    assert re.fullmatch(r"the conversation is \d+ tokens; adapter reads at most 512: .*", caught.value.body["message"])


@contextmanager
def in_process_server(engine) -> Iterator[str]:
    """uvicorn serving `engine` in a thread of this process (no key); yields the base URL .../v1."""
    import uvicorn  # noqa: PLC0415

    from tunelab.infer.api import create_app  # noqa: PLC0415

    server = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    assert not thread.is_alive()


def test_a_client_leaving_mid_stream_cancels_its_generation(caplog):
    """The untrained tiny Llama: greedy, it writes newlines until max_tokens. A client that leaves after three
    chunks must stop that generation and free the server."""
    engine = load_engine("tiny")
    steps = []  # one entry per forward pass of the model
    engine.model.register_forward_hook(lambda *_: steps.append(1))
    with in_process_server(engine) as url:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
        stream = client.chat.completions.create(
            model="tiny-llama", messages=HELLO, temperature=0, max_tokens=480, stream=True
        )
        chunks = [next(stream) for _ in range(3)]
        stream.close()  # the client leaves
        assert [c.choices[0].delta.content for c in chunks] == ["", "\n", "\n"]
        # The next request is served at once: the abandoned generation stopped.
        after = client.chat.completions.create(model="tiny-llama", messages=HELLO, temperature=0, max_tokens=2)
        assert (after.choices[0].message.content, after.choices[0].finish_reason) == ("\n\n", "length")
        assert len(steps) < 480 // 2
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


# ---- tool calls: a model trained with the `default` template on one conversation that calls a weather tool ----


@pytest.fixture(scope="module")
def tool_client(tmp_path_factory):
    folder = build_tool_model(tmp_path_factory.mktemp("tools") / "tool-model")
    with in_process_server(load_engine(str(folder))) as url:
        yield openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)


def test_tool_call_round_trip(tool_client):
    chat = [{"role": "user", "content": WEATHER_QUESTION}]
    first = tool_client.chat.completions.create(model="tool-model", messages=chat, tools=[WEATHER_TOOL], temperature=0)
    [choice] = first.choices
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    [call] = choice.message.tool_calls
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", call.id)
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == ("function", "get_weather", {"city": "Paris"})
    # The client runs the tool and sends its result back with the call it answers.
    chat += [choice.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": WEATHER_RESULT}]
    second = tool_client.chat.completions.create(model="tool-model", messages=chat, tools=[WEATHER_TOOL], temperature=0)
    assert (second.choices[0].message.content, second.choices[0].finish_reason) == (" " + WEATHER_ANSWER, "stop")
    assert second.choices[0].message.tool_calls is None
    # A question that needs no tool gets a plain answer with the same tools on offer.
    hello = tool_client.chat.completions.create(model="tool-model", messages=[{"role": "user", "content": "Say hi"}],
                                                tools=[WEATHER_TOOL], temperature=0)
    assert (hello.choices[0].message.content, hello.choices[0].message.tool_calls, hello.choices[0].finish_reason) == (
        " Hi!", None, "stop"
    )


def test_streamed_tool_call(tool_client):
    stream = tool_client.chat.completions.create(
        model="tool-model", messages=[{"role": "user", "content": WEATHER_QUESTION}], tools=[WEATHER_TOOL],
        temperature=0, stream=True,
    )
    first, *middle, last = list(stream)
    assert first.choices[0].delta.role == "assistant"
    # No content: the call's text is held back and comes as one tool_calls delta once the answer is complete.
    [calls] = [chunk.choices[0].delta.tool_calls for chunk in middle]
    assert [(c.index, c.type, c.function.name, c.function.arguments) for c in calls] == [
        (0, "function", "get_weather", '{"city": "Paris"}')
    ]
    assert calls[0].id.startswith("call_")
    assert (last.choices[0].delta.content, last.choices[0].finish_reason) == (None, "tool_calls")


def test_tool_choice_forces_a_call(tool_client):
    chat = [{"role": "user", "content": WEATHER_QUESTION}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        reply = tool_client.chat.completions.create(model="tool-model", messages=chat, tools=[WEATHER_TOOL],
                                                    tool_choice=choice, temperature=0)
        [call] = reply.choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    with pytest.raises(openai.BadRequestError) as caught:
        tool_client.chat.completions.create(model="tool-model", messages=chat, tools=[WEATHER_TOOL], temperature=0,
                                            tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert (caught.value.body["param"], caught.value.body["message"]) == (
        "tool_choice", "tool_choice: no tool named 'get_time' in tools"
    )
    with pytest.raises(openai.BadRequestError) as caught:
        tool_client.chat.completions.create(model="tool-model", messages=chat, tool_choice="required")
    assert caught.value.body["message"] == "tool_choice: only allowed when tools are given"


def test_malformed_tool_messages_are_refused(tool_client):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "Paris"}}
    with pytest.raises(openai.BadRequestError) as caught:
        tool_client.chat.completions.create(model="tool-model", tools=[WEATHER_TOOL], messages=[
            {"role": "user", "content": WEATHER_QUESTION}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": WEATHER_RESULT},
        ])
    assert caught.value.body["message"] == (
        "messages.1.tool_calls.0.function.arguments: expected a JSON object as text, got 'Paris'"
    )
    with pytest.raises(openai.BadRequestError) as caught:
        tool_client.chat.completions.create(model="tool-model", tools=[WEATHER_TOOL], messages=[
            {"role": "user", "content": WEATHER_QUESTION}, {"role": "tool", "content": WEATHER_RESULT},
        ])
    assert caught.value.body["param"] == "messages.1"
    assert caught.value.body["message"].endswith("a tool message needs the tool_call_id of the call it answers")
