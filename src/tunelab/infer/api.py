"""`tunelab api`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) for one loaded ChatEngine.

Routes: `GET /health` (no key), `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/chat/completions`
(JSON, or Server-Sent Events with `stream: true`: `data: {chat.completion.chunk}` events, then `data: [DONE]`).

Concurrent requests share the model's forward passes (the engine's batch scheduler, up to `max_batch_size`
rows). Generation runs in the scheduler's thread, so the event loop keeps accepting connections and
noticing disconnects; a client that goes away mid-stream cancels its generation. Errors use OpenAI's body:
{"error": {message, type, param, code}}.

Limits that keep one request from holding the server: a body over `max_request_bytes` is 413 before it is read,
and a prompt with more characters than the context's tokens can spell is 400 (context_length_exceeded) before it
is tokenised (engine.py); other requests are served meanwhile.

Honoured: temperature (0: greedy; default 1 as OpenAI's), top_p, max_tokens / max_completion_tokens,
stop, seed, stream_options.include_usage, tools / tool_choice / parallel_tool_calls (the template renders
the tools; tool_calls.py parses the answer with the template's own call syntax), and the extensions top_k
and repetition_penalty (vLLM's names). Refused with 400 rather than ignored: n > 1, logprobs,
response_format other than text, non-zero presence / frequency penalties, tools with a template that has no
tool-call format.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from tunelab.data.templates.builtin import BUILTIN_NAMES
from tunelab.errors import ConfigError, ImageInputError, InferenceError, TemplateError
from tunelab.infer.engine import ChatEngine, Generation, SamplingOptions
from tunelab.infer.tool_calls import BUILTIN_FAMILIES, ToolCall, ToolCallStream, ToolSyntax

DEFAULT_MAX_BATCH_SIZE = 8
# Request bodies larger than this are refused (413) before they are read: ~2M tokens of text, far above the
# context of the models tunelab serves, yet small enough that parsing one costs well under a second.
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024

logger = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageUrl(BaseModel):
    model_config = ConfigDict(extra="ignore")  # e.g. detail
    url: str  # a data:image/...;base64, URI or a path on the server's machine (infer/images.py)


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageUrl


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # e.g. `name`
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart] | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call this result answers

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (null only in an assistant message with tool_calls)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def as_template_message(self, index: int) -> dict[str, Any]:
        """The message as chat templates read it: arguments as the JSON text sent, checked to hold an object (the
        engine gives call turns the shapes training gave them: data/formats.py template_shapes)."""
        if isinstance(self.content, list) and any(isinstance(part, ImagePart) for part in self.content):
            content: Any = [part.model_dump() for part in self.content]  # the engine opens the images (infer/images.py)
        else:
            content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.tool_calls:
            message["tool_calls"] = [
                {"type": "function", "id": call.id, "function": {
                    "name": call.function.name, "arguments": _arguments(call, f"messages.{index}.tool_calls.{j}"),
                }}
                for j, call in enumerate(self.tool_calls)
            ]
        if self.tool_call_id:
            message["tool_call_id"] = self.tool_call_id
        return message


def _arguments(call: ToolCallIn, where: str) -> str:
    try:
        arguments = json.loads(call.function.arguments) if call.function.arguments.strip() else {}
    except json.JSONDecodeError:
        arguments = None
    if not isinstance(arguments, dict):
        raise ApiError(400, f"{where}.function.arguments: expected a JSON object as text, got "
                       f"{call.function.arguments!r}", f"{where}.function.arguments")
    return call.function.arguments


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. strict: passed to the template as given
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDefinition(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # fields OpenAI has that change nothing here (user, metadata, ...)
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    top_k: int = Field(0, ge=0)
    repetition_penalty: float = Field(1.0, gt=0)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # Refused when used (see refuse_unsupported):
    logprobs: bool | None = None
    response_format: dict[str, Any] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    def refuse_unsupported(self) -> None:
        if self.n != 1:
            raise ApiError(400, f"n: this server returns one choice per request, got n={self.n}; "
                           "send n separate requests (with different seeds) instead", "n")
        if self.logprobs:
            raise ApiError(400, "logprobs: not supported by tunelab api", "logprobs")
        if self.response_format and self.response_format.get("type") != "text":
            raise ApiError(400, "response_format: only {\"type\": \"text\"} is supported", "response_format")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ApiError(400, f"{name}: not supported; use repetition_penalty (1: off) instead", name)

    def tool_use(self, engine: ChatEngine) -> ToolUse:
        """What the tools of this request change: the tools rendered, the syntax to parse, the answer's prefill."""
        if self.tool_choice is not None and not self.tools:
            raise ApiError(400, "tool_choice: only allowed when tools are given", "tool_choice")
        if not self.tools or self.tool_choice == "none":  # "none": the model is not shown the tools
            return ToolUse()
        syntax = engine.tool_syntax
        if syntax is None:
            with_tools = ", ".join(name for name in BUILTIN_NAMES if name in BUILTIN_FAMILIES)
            raise ApiError(400, f"tools: the chat template '{engine.template.name}' has no tool-call format (it does "
                           "not render tools, or writes calls in a syntax tunelab does not parse); train and serve "
                           f"with a template that has one ({with_tools})", "tools")
        tools = [tool.model_dump(exclude_none=True) for tool in self.tools]
        prefill = ""
        if self.tool_choice == "required":
            prefill = syntax.prefill(None)
        elif isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if name not in [tool["function"]["name"] for tool in tools]:
                raise ApiError(400, f"tool_choice: no tool named '{name}' in tools", "tool_choice")
            prefill = syntax.prefill(name)
            if prefill is None:
                raise ApiError(400, f"tool_choice: the chat template '{engine.template.name}' writes a call's "
                               "arguments before its name, so a named function cannot be forced; use 'required' "
                               "or 'auto'", "tool_choice")
        return ToolUse(tools, syntax, prefill, self.parallel_tool_calls)

    def sampling_options(self) -> SamplingOptions:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return SamplingOptions(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            max_new_tokens=self.max_completion_tokens or self.max_tokens,
            repetition_penalty=self.repetition_penalty, seed=self.seed, stop=tuple(stop),
        )


@dataclass(frozen=True)
class ToolUse:
    """A request's tools as the engine and the answer see them (empty: no tools, or tool_choice "none")."""

    tools: list[dict[str, Any]] | None = None  # rendered into the prompt by the template
    syntax: ToolSyntax | None = None  # parses the answer; None: the answer is all content
    prefill: str = ""  # the answer's forced start (tool_choice "required" or a named function)
    parallel: bool = True  # False: at most one call (the first) is returned


def create_app(
    engine: ChatEngine, api_key: str | None = None, max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    """The ASGI app serving `engine` under the model id `engine.name`; `api_key` required as a Bearer token if set.

    Up to `max_batch_size` concurrent requests share each forward pass of the model. A body over
    `max_request_bytes` is answered 413 (_BodyLimit).
    """
    if max_request_bytes < 1:
        raise ConfigError(f"--max-request-bytes: expected an integer >= 1, got {max_request_bytes}")
    app = FastAPI(title="tunelab api", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_BodyLimit, max_bytes=max_request_bytes)
    engine.max_batch_size = max_batch_size
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        param = ".".join(str(part) for part in first.get("loc", ())[1:]) or None  # drop the leading "body"
        return JSONResponse(ApiError(400, f"{param}: {first.get('msg')}", param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 413:
            return _too_large(max_request_bytes)
        return JSONResponse(ApiError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:  # logged by uvicorn with its traceback
        return JSONResponse(ApiError(500, f"generation failed: {exc}", kind="server_error").body(), status_code=500)

    def _check_key(request: Request) -> None:
        if api_key is None:
            return
        auth = request.headers.get("authorization", "")
        if not auth.lower().startswith("bearer "):
            raise ApiError(401, "You didn't provide an API key: send it as the header 'Authorization: Bearer KEY'.")
        if not secrets.compare_digest(auth[7:].strip().encode(), api_key.encode()):
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_check_key)])
    model_card = {"id": engine.name, "object": "model", "created": created, "owned_by": "tunelab"}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @v1.get("/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card]}

    @v1.get("/models/{model_id}")
    async def get_model(model_id: str) -> dict:
        _check_model(model_id)
        return model_card

    def _check_model(model_id: str) -> None:
        if model_id != engine.name:
            raise ApiError(404, f"The model '{model_id}' does not exist; this server serves '{engine.name}'",
                           "model", "model_not_found")

    async def _prepare(body: ChatCompletionRequest) -> tuple[Generation, ToolUse]:
        body.refuse_unsupported()
        _check_model(body.model)
        messages = [m.as_template_message(i) for i, m in enumerate(body.messages)]
        tool_use = body.tool_use(engine)
        options = body.sampling_options()
        try:
            generation = await run_in_threadpool(engine.generate, messages, options, tool_use.tools, tool_use.prefill)
        except (InferenceError, TemplateError) as exc:
            too_long = isinstance(exc, InferenceError) and not isinstance(exc, ImageInputError)
            code = "context_length_exceeded" if too_long else None
            raise ApiError(400, str(exc), "messages", code) from None
        return generation, tool_use

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        generation, tool_use = await _prepare(body)
        completion_id, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if not body.stream:
            await run_in_threadpool(_drain, generation)
            answer = _Answer(tool_use)
            content = answer.feed(tool_use.prefill + generation.text)
            rest, calls = answer.finish()
            content += rest
            # As OpenAI: content null beside calls when the answer holds nothing else.
            message: dict[str, Any] = {"role": "assistant", "content": (content or None) if calls else content}
            if calls:
                message["tool_calls"] = [call.as_openai() for call in calls]
            return {
                "id": completion_id, "object": "chat.completion", "created": now, "model": engine.name,
                "choices": [{
                    "index": 0, "message": message, "logprobs": None,
                    "finish_reason": "tool_calls" if calls else generation.finish_reason,
                }],
                "usage": _usage(generation),
            }
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return _EventStream(
            _events(generation, tool_use, completion_id, now, include_usage), media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def _events(generation: Generation, tool_use: ToolUse, completion_id: str, now: int, include_usage: bool):
        def chunk(delta: dict, finish_reason: str | None = None, usage: dict | None = None) -> str:
            data = {"id": completion_id, "object": "chat.completion.chunk", "created": now, "model": engine.name,
                    "choices": [] if usage else [
                        {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
            if usage:
                data["usage"] = usage
            return f"data: {json.dumps(data)}\n\n"

        pieces = iter(generation)
        answer = _Answer(tool_use)
        try:
            yield chunk({"role": "assistant", "content": ""})
            text = answer.feed(tool_use.prefill)
            while True:
                if text:
                    yield chunk({"content": text})
                if (piece := await run_in_threadpool(next, pieces, None)) is None:
                    break
                text = answer.feed(piece)
            rest, calls = answer.finish()
            if rest:
                yield chunk({"content": rest})
            for index, call in enumerate(calls):  # each call whole, once the answer is complete
                yield chunk({"tool_calls": [{"index": index, **call.as_openai()}]})
            yield chunk({}, "tool_calls" if calls else generation.finish_reason)
            if include_usage:
                yield chunk({}, usage=_usage(generation))
            yield "data: [DONE]\n\n"
        except Exception as exc:  # noqa: BLE001  (headers are sent: report in the stream, as OpenAI does)
            logger.exception("generation failed")
            yield f"data: {json.dumps(ApiError(500, str(exc), kind='server_error').body())}\n\n"
        finally:
            generation.cancel()  # also on a disconnect (cancellation): the scheduler drops the row at its next step

    app.include_router(v1)
    return app


def _too_large(max_bytes: int) -> JSONResponse:
    error = ApiError(413, f"the request body is larger than this server's limit of {max_bytes} bytes (tunelab api "
                     "--max-request-bytes); shorten the conversation", code="request_too_large")
    return JSONResponse(error.body(), status_code=413)


class _BodyLimit:
    """Refuses request bodies over `max_bytes` with 413 in OpenAI's error shape.

    A Content-Length over the limit is answered before the app runs, with nothing of the body read; a chunked
    body is counted as the route reads it and refused once it passes the limit (an HTTPException the route
    lets through to the handler above). Starlette's own limit (FastAPI's max_body_size) answers in plain text.
    """

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            return await _too_large(self.max_bytes)(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise HTTPException(413)
            return message

        await self.app(scope, counted, send)


class _EventStream(StreamingResponse):
    """Closes its event generator as soon as the response ends, also when the client went away mid-stream.

    Starlette stops iterating on a disconnect and leaves the generator suspended for the garbage collector,
    so its `finally` (cancel the generation) would run late, in some other task.
    """

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


class _Answer:
    """An answer's text → the content to send and the tool calls (ToolCallStream), or all content without tools."""

    def __init__(self, tool_use: ToolUse):
        self.stream = ToolCallStream(tool_use.syntax) if tool_use.syntax else None
        self.parallel = tool_use.parallel

    def feed(self, piece: str) -> str:
        return self.stream.feed(piece) if self.stream else piece

    def finish(self) -> tuple[str, list[ToolCall]]:
        if self.stream is None:
            return "", []
        rest, calls = self.stream.finish()
        return rest, calls if self.parallel else calls[:1]


def _drain(generation: Generation) -> None:
    for _ in generation:
        pass


def _usage(generation: Generation) -> dict[str, int]:
    return {
        "prompt_tokens": generation.prompt_tokens, "completion_tokens": generation.completion_tokens,
        "total_tokens": generation.prompt_tokens + generation.completion_tokens,
    }


def serve(
    engine: ChatEngine, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> None:
    """Run the server until Ctrl-C / SIGTERM (uvicorn shuts down gracefully, finishing open requests)."""
    if api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("Serving on %s without an API key: anyone who can reach this port can use the model.", host)
    app = create_app(engine, api_key, max_batch_size, max_request_bytes)
    uvicorn.run(app, host=host, port=port, log_level="info")
