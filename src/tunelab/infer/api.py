"""`tunelab api`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) for one loaded ChatEngine.

Routes: `GET /health` (no key), `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/chat/completions`
(JSON, or Server-Sent Events with `stream: true`: `data: {chat.completion.chunk}` events, then `data: [DONE]`).

One generation runs at a time (a lock; further requests wait their turn). Generation runs in a
worker thread, so the event loop keeps accepting connections and noticing disconnects; a client that goes
away mid-stream cancels its generation. Errors use OpenAI's body: {"error": {message, type, param, code}}.

Honoured: temperature (0: greedy; default 1 as OpenAI's), top_p, max_tokens / max_completion_tokens,
stop, seed, stream_options.include_usage, and the extensions top_k and repetition_penalty (vLLM's names).
Refused with 400 rather than ignored: n > 1, tools, logprobs, response_format other than text, non-zero
presence / frequency penalties.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
import uuid
from typing import Any, Literal

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from tunelab.errors import InferenceError, TemplateError
from tunelab.infer.engine import ChatEngine, Generation, SamplingOptions

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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # e.g. `name`
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def as_template_message(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


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
    # Refused when used (see refuse_unsupported):
    tools: list[Any] | None = None
    logprobs: bool | None = None
    response_format: dict[str, Any] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    def refuse_unsupported(self) -> None:
        if self.n != 1:
            raise ApiError(400, f"n: this server returns one choice per request, got n={self.n}; "
                           "send n separate requests (with different seeds) instead", "n")
        if self.tools:
            raise ApiError(400, "tools: function calling is not supported by tunelab api", "tools")
        if self.logprobs:
            raise ApiError(400, "logprobs: not supported by tunelab api", "logprobs")
        if self.response_format and self.response_format.get("type") != "text":
            raise ApiError(400, "response_format: only {\"type\": \"text\"} is supported", "response_format")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ApiError(400, f"{name}: not supported; use repetition_penalty (1: off) instead", name)

    def sampling_options(self) -> SamplingOptions:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return SamplingOptions(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            max_new_tokens=self.max_completion_tokens or self.max_tokens,
            repetition_penalty=self.repetition_penalty, seed=self.seed, stop=tuple(stop),
        )


def create_app(engine: ChatEngine, api_key: str | None = None) -> FastAPI:
    """The ASGI app serving `engine` under the model id `engine.name`; `api_key` required as a Bearer token if set."""
    app = FastAPI(title="tunelab api", docs_url=None, redoc_url=None, openapi_url=None)
    # One generation at a time: the model and tokenizer are shared. A semaphore, not a Lock, because a stream
    # cut by its client is finished by the request's task while a child task of it took the lock (_EventStream).
    lock = anyio.Semaphore(1)
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

    async def _prepare(body: ChatCompletionRequest) -> Generation:
        body.refuse_unsupported()
        _check_model(body.model)
        messages = [m.as_template_message() for m in body.messages]
        options = body.sampling_options()
        async with lock:  # the tokenizer too is used by one thread at a time
            try:
                return await run_in_threadpool(engine.generate, messages, options)
            except (InferenceError, TemplateError) as exc:
                code = "context_length_exceeded" if isinstance(exc, InferenceError) else None
                raise ApiError(400, str(exc), "messages", code) from None

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        generation = await _prepare(body)
        completion_id, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if not body.stream:
            async with lock:
                await run_in_threadpool(_drain, generation)
            return {
                "id": completion_id, "object": "chat.completion", "created": now, "model": engine.name,
                "choices": [{
                    "index": 0, "message": {"role": "assistant", "content": generation.text},
                    "logprobs": None, "finish_reason": generation.finish_reason,
                }],
                "usage": _usage(generation),
            }
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return _EventStream(
            _events(generation, completion_id, now, include_usage), media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def _events(generation: Generation, completion_id: str, now: int, include_usage: bool):
        def chunk(delta: dict, finish_reason: str | None = None, usage: dict | None = None) -> str:
            data = {"id": completion_id, "object": "chat.completion.chunk", "created": now, "model": engine.name,
                    "choices": [] if usage else [
                        {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
            if usage:
                data["usage"] = usage
            return f"data: {json.dumps(data)}\n\n"

        async with lock:
            pieces = iter(generation)
            try:
                yield chunk({"role": "assistant", "content": ""})
                while (piece := await run_in_threadpool(next, pieces, None)) is not None:
                    yield chunk({"content": piece})
                yield chunk({}, generation.finish_reason)
                if include_usage:
                    yield chunk({}, usage=_usage(generation))
                yield "data: [DONE]\n\n"
            except Exception as exc:  # noqa: BLE001  (headers are sent: report in the stream, as OpenAI does)
                logger.exception("generation failed")
                yield f"data: {json.dumps(ApiError(500, str(exc), kind='server_error').body())}\n\n"
            finally:
                # Also on a disconnect (cancellation): stop the worker and wait for it before the next request.
                generation.cancel()
                with anyio.CancelScope(shield=True):
                    await run_in_threadpool(generation.wait)

    app.include_router(v1)
    return app


class _EventStream(StreamingResponse):
    """Closes its event generator as soon as the response ends, also when the client went away mid-stream.

    Starlette stops iterating on a disconnect and leaves the generator suspended for the garbage collector,
    so its `finally` (cancel the generation, release the lock) would run late, in some other task.
    """

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def _drain(generation: Generation) -> None:
    for _ in generation:
        pass


def _usage(generation: Generation) -> dict[str, int]:
    return {
        "prompt_tokens": generation.prompt_tokens, "completion_tokens": generation.completion_tokens,
        "total_tokens": generation.prompt_tokens + generation.completion_tokens,
    }


def serve(engine: ChatEngine, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None) -> None:
    """Run the server until Ctrl-C / SIGTERM (uvicorn shuts down gracefully, finishing open requests)."""
    import uvicorn  # noqa: PLC0415

    if api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("Serving on %s without an API key: anyone who can reach this port can use the model.", host)
    uvicorn.run(create_app(engine, api_key), host=host, port=port, log_level="info")
