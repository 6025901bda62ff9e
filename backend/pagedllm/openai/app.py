"""The FastAPI application: OpenAI's routes, server-sent events, and every error in OpenAI's format.

Disconnects: a client that goes away cancels its Triton request at once, whether it was waiting for a whole
completion, for the first token of a stream, or reading a stream: the work is raced against the ASGI
`http.disconnect` message, and losing the race closes its connection to Triton, which cancels the request (see
triton_bridge.py).
A stream's HTTP status is decided by its first model response: an error before any token gets its own status
(400, 503, ...); an error after the first chunk can only go in the stream, as `data: {"error": {...}}` then
`[DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from pagedllm.openai.channel_bridge import ChannelBridge
from pagedllm.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    parse,
    validation_error,
)
from pagedllm.openai.responses import ChatResponse, CompletionResponse
from pagedllm.openai.sampling import CHAT_PARAMS, COMPLETION_PARAMS, chat_sampling, completion_sampling
from pagedllm.openai.triton_bridge import Delta, TritonBridge


def create_app(triton_url: str, model_name: str = "pagedllm", served_model_name: str | None = None,
               lora_separator: str | None = "_lora_", engine_channel: str | None = None) -> FastAPI:
    """`lora_separator`: a request for model `<served><separator><adapter>` runs that LoRA adapter (Triton's
    OpenAI front end's form); None: adapters are not reachable by model name. `engine_channel`: the model's
    channel socket, which requests then take instead of Triton's HTTP endpoint."""
    served = served_model_name or model_name
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # Made in the server's event loop (aiohttp's session and asyncio's streams belong to it).
        app.state.bridge = (ChannelBridge(engine_channel, triton_url, model_name) if engine_channel
                            else TritonBridge(triton_url, model_name))
        yield
        await app.state.bridge.close()

    app = FastAPI(title="pagedllm OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None)
    _add_error_handlers(app)

    def check_model(name: str) -> str | None:
        """The LoRA adapter `name` asks for (None: the base model); 404 for another model."""
        if name == served:
            return None
        prefix = served + (lora_separator or "\0")
        if lora_separator and name.startswith(prefix) and len(name) > len(prefix):
            return name[len(prefix):]
        raise OpenAIError(404, f"The model `{name}` does not exist (this server serves `{served}`).",
                          "model", "model_not_found")

    def with_adapter(sampling: dict, adapter: str | None) -> dict:
        return sampling if adapter is None else {**sampling, "lora_name": adapter}

    def model_card() -> dict:
        return {"id": served, "object": "model", "created": created, "owned_by": "pagedllm"}

    @app.get("/health")
    async def health(request: Request) -> Response:
        if await request.app.state.bridge.is_ready():
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not ready", "model": model_name}, status_code=503)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id != served:  # adapters are not listed (the front end does not know which the model serves)
            raise OpenAIError(404, f"The model `{model_id}` does not exist (this server serves `{served}`).",
                              "model", "model_not_found")
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = parse(CompletionRequest, await request.body())
        adapter = check_model(body.model)
        out = CompletionResponse(body.model, body.logprobs, _include_usage(body), n=body.n or 1)
        ranked = (body.best_of or 1) > (body.n or 1)  # the best samples are known at the end only
        deltas = request.app.state.bridge.generate(with_adapter(completion_sampling(body), adapter),
                                                   COMPLETION_PARAMS,
                                                   prompt=body.prompt[0], logprobs=body.logprobs is not None,
                                                   deltas=bool(body.stream) or not ranked)
        return await _respond(request, out, deltas, bool(body.stream))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = parse(ChatCompletionRequest, await request.body())
        adapter = check_model(body.model)
        out = ChatResponse(body.model, (body.top_logprobs or 0) if body.logprobs else None, _include_usage(body),
                           n=body.n or 1)
        deltas = request.app.state.bridge.generate(with_adapter(chat_sampling(body), adapter), CHAT_PARAMS,
                                                   messages=body.messages, logprobs=bool(body.logprobs))
        return await _respond(request, out, deltas, bool(body.stream))

    return app


def _include_usage(body) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)


async def _respond(request: Request, out, deltas: AsyncIterator[Delta], stream: bool) -> Response:
    if not stream:
        return await _until_disconnect(request, _collect(out, deltas))
    first = await _until_disconnect(request, _first(deltas))  # an error here raises: a status of its own
    if isinstance(first, Response):  # the client left while waiting
        return first
    return _EventStream(_events(out, first, deltas), media_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _collect(out, deltas: AsyncIterator[Delta]) -> Response:
    async with contextlib.aclosing(deltas):
        async for delta in deltas:
            out.add(delta)
    return JSONResponse(out.result())


async def _first(deltas: AsyncIterator[Delta]) -> Delta | None:
    try:
        return await anext(deltas)
    except StopAsyncIteration:
        return None


async def _events(out, first: Delta | None, deltas: AsyncIterator[Delta]) -> AsyncIterator[str]:
    async with contextlib.aclosing(deltas):
        try:
            for chunk in out.start_chunks():
                yield _event(chunk)
            if first is not None:
                for chunk in out.add(first):
                    yield _event(chunk)
            async for delta in deltas:
                for chunk in out.add(delta):
                    yield _event(chunk)
            for chunk in out.end_chunks():
                yield _event(chunk)
        except OpenAIError as e:
            yield _event(e.body())  # the status line is long gone: the error goes in the stream
        yield "data: [DONE]\n\n"


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class _EventStream(StreamingResponse):
    """A StreamingResponse that always watches for the client's disconnect (Starlette does so only below ASGI
    spec 2.4; above, a write fails first, which needs the next token) and always closes its generator, so the
    Triton request is cancelled as soon as the client is gone, even while no token comes."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tasks:

                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the client went away in the middle of a write
                        await self.stream_response(send)
                    tasks.cancel_scope.cancel()

                tasks.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tasks.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


async def _until_disconnect(request: Request, work) -> object:
    """The result of `work`, or (the client gone first) `work` cancelled and a 499 nobody will read."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return Response(status_code=499)


async def _disconnected(request: Request) -> None:
    # The body has been read: the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _add_error_handlers(app: FastAPI) -> None:
    def reply(e: OpenAIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, e: OpenAIError) -> JSONResponse:
        return reply(e)

    # FastAPI's own validation (path parameters): a 400 too, never a 422.
    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, e: RequestValidationError) -> JSONResponse:
        return reply(validation_error([{**err, "loc": tuple(err["loc"])[1:]} for err in e.errors()]))

    @app.exception_handler(HTTPException)  # unknown routes, wrong methods
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        return reply(OpenAIError(e.status_code, str(e.detail)))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception) -> JSONResponse:
        return reply(OpenAIError(500, f"internal error: {type(e).__name__}: {e}"))
