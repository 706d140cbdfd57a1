"""`tunelab api` cannot be held hostage: oversized bodies, over-long prompts and hang-ups, under concurrent load.

A real server (`tunelab api ADAPTER --max-request-bytes 16384` in a subprocess, uvicorn on loopback) and the chat
adapter the serving tests train; clients are threads using the official `openai` client, or raw sockets where a
client must misbehave (a Content-Length it never sends, a chunked body without end, a hang-up mid-stream).
"""

from __future__ import annotations

import json
import re
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import openai
import pytest
from transformers import AutoTokenizer

from tests.infer.chat_helpers import api_server, messages

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

LIMIT = 16384  # --max-request-bytes: small, so an oversized chunked body still fits the socket buffers here
HELLO = messages(None, [("Say hi", None)])
AGAIN = messages(None, [("Say hi", "Hi! 你好 🙂"), ("Again", None)])
ANSWERS = {"Say hi": "Hi! 你好 🙂", "Again": "Hi again!"}
TOO_LARGE = {"error": {
    "message": f"the request body is larger than this server's limit of {LIMIT} bytes (tunelab api "
               "--max-request-bytes); shorten the conversation",
    "type": "invalid_request_error", "param": None, "code": "request_too_large",
}}


@dataclass(frozen=True)
class Server:
    host: str
    port: int
    pid: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key="none", max_retries=0, timeout=120)

    def rss_mib(self) -> float:
        status = open(f"/proc/{self.pid}/status").read()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024


@pytest.fixture(scope="module")
def server(chat_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("api-limits") / "server.log"
    with api_server([str(chat_model.adapter), "--max-request-bytes", str(LIMIT)], log) as started:
        yield Server(*started)
    assert "Traceback" not in log.read_text(), log.read_text()


def _head(server: Server, headers: dict[str, str]) -> bytes:
    lines = ["POST /v1/chat/completions HTTP/1.1", f"Host: {server.host}:{server.port}",
             "Content-Type: application/json", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _response(sock: socket.socket) -> tuple[int, dict]:
    """Status and JSON body of a response with a Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split()[1]), json.loads(body)


def oversized_by_length(server: Server) -> tuple[int, dict]:
    """Content-Length says 50 MB and only 1 KB follows: answered at once, so nothing was waited for or read."""
    with socket.create_connection((server.host, server.port), timeout=60) as sock:
        sock.sendall(_head(server, {"Content-Length": str(50_000_000)}) + b'{"model": "adapter", ' + b" " * 1000)
        return _response(sock)


def oversized_chunked(server: Server) -> tuple[int, dict]:
    """No Content-Length: chunks that pass the limit, and no end chunk. Refused once the bytes read pass it."""
    with socket.create_connection((server.host, server.port), timeout=60) as sock:
        sock.sendall(_head(server, {"Transfer-Encoding": "chunked"}))
        piece = b" " * 4096
        for _ in range(LIMIT // len(piece) + 1):
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        return _response(sock)


def hang_up_mid_stream(server: Server) -> str:
    """A stream whose client leaves after the first event; returns that event's delta."""
    body = json.dumps({"model": "adapter", "messages": HELLO, "temperature": 0, "stream": True}).encode()
    with socket.create_connection((server.host, server.port), timeout=60) as sock:
        sock.sendall(_head(server, {"Content-Length": str(len(body))}) + body)
        data = b""
        while not re.search(rb"data: .*\n\n", data):
            chunk = sock.recv(4096)
            assert chunk, data
            data += chunk
    event = re.search(rb"data: (.*?)\n\n", data).group(1)
    return json.loads(event)["choices"][0]["delta"]


def too_long_prompt(server: Server) -> dict:
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().chat.completions.create(model="adapter", messages=messages(None, [("x" * 12_000, None)]))
    return caught.value.body


def answer(server: Server, chat: list[dict]) -> str:
    reply = server.client().chat.completions.create(model="adapter", messages=chat, temperature=0)
    return reply.choices[0].message.content


def streamed(server: Server, chat: list[dict]) -> str:
    stream = server.client().chat.completions.create(model="adapter", messages=chat, temperature=0, stream=True)
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream)


# (what a client does, what it must get)
ACTIONS = [
    ("answer", lambda s: answer(s, HELLO), ANSWERS["Say hi"]),
    ("stream", lambda s: streamed(s, AGAIN), ANSWERS["Again"]),
    ("hang up", hang_up_mid_stream, {"role": "assistant", "content": ""}),
    ("oversized, Content-Length", oversized_by_length, (413, TOO_LARGE)),
    ("oversized, chunked", oversized_chunked, (413, TOO_LARGE)),
    ("prompt over the context", lambda s: too_long_prompt(s)["code"], "context_length_exceeded"),
]


def test_oversized_bodies_are_413_in_openais_shape(server):
    assert oversized_by_length(server) == (413, TOO_LARGE)
    assert oversized_chunked(server) == (413, TOO_LARGE)


def test_a_prompt_longer_than_the_context_is_refused_before_tokenising(server, chat_model):
    """12,000 characters (under the body limit) are more tokens than 512 can hold: refused by their length."""
    longest = max(map(len, AutoTokenizer.from_pretrained(chat_model.adapter).get_vocab()))
    body = too_long_prompt(server)
    chars = int(re.fullmatch(r"the conversation is at least \d+ tokens \((\d+) characters\); adapter reads at most "
                             r"512: start a new conversation or shorten it", body["message"]).group(1))
    assert body["message"].startswith(f"the conversation is at least {-(-chars // longest)} tokens")
    assert (body["param"], body["code"], chars > 12_000) == ("messages", "context_length_exceeded", True)


def test_load_mixing_streams_hang_ups_and_oversized_bodies(server):
    """12 clients x 6 requests, every kind of ACTIONS at once: each answer is right, the server still serves, and
    its RSS ends within 64 MiB of where one round of each action left it (oversized bodies are never read)."""
    for _, act, _ in ACTIONS:  # warm up: the baseline includes whatever one request of each kind allocates
        act(server)
    baseline = server.rss_mib()
    clients, rounds = 12, len(ACTIONS)

    def client(index: int) -> list[tuple[str, bool]]:
        results = []
        for step in range(rounds):
            name, act, expected = ACTIONS[(index + step) % len(ACTIONS)]
            got = act(server)
            results.append((name, got == expected or got))
        return results

    with ThreadPoolExecutor(max_workers=clients) as pool:
        results = [result for client_results in pool.map(client, range(clients)) for result in client_results]
    assert results == [(ACTIONS[(i + s) % len(ACTIONS)][0], True) for i in range(clients) for s in range(rounds)]
    assert answer(server, HELLO) == ANSWERS["Say hi"]  # still serving
    after = server.rss_mib()
    print(f"RSS baseline {baseline:.1f} MiB, after the load {after:.1f} MiB")  # shown with -s
    assert after - baseline < 64, (baseline, after)
