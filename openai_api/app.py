"""The FastAPI app: routes, bearer-key auth, OpenAI error shapes, and the bridge to the Router (the same
admission control, validation, metrics and speculative loop as gRPC). Each of a request's n choices is one
router request; a client that goes away cancels them, which frees the workers' caches as a gRPC cancel does.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from pathlib import Path
from typing import AsyncIterator, Callable

import grpc
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from openai_api.chat import ChatTemplate, find_chat_template, no_template_error
from openai_api.protocol import (DEFAULT_CHAT_MAX_TOKENS, ApiError, ChatRequest, CompletionRequest, SamplingBody,
                                 completion_prompt, generate_request, openai_param, with_seed)
from openai_api.responses import FINISH, ChatCompletions, Completions, envelope, spec_stats, usage
from router.server import Overloaded, Router
from router.stopping import output_chunks
from router.validation import RequestError
from settings.schema import HttpConfig

GRPC_CODES = {400: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE"}


class Api:
    """The routes' shared state: the config, the Router once the pools are ready, the chat template."""

    def __init__(self, http: HttpConfig, get_router: Callable[[], Router | None]):
        self.http, self._get_router = http, get_router
        self._templates: dict = {}

    def router(self) -> Router:
        current = self._get_router()
        if current is None:
            raise ApiError(503, "specpool is still loading its worker pools", kind="service_unavailable")
        return current

    def model_name(self, router: Router) -> str:
        return self.http.model_name or Path(router.model_info["model_path"]).name

    def authorize(self, request: Request) -> None:
        keys = self.http.api_keys
        if keys and request.headers.get("authorization", "") not in {f"Bearer {key}" for key in keys}:
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer <key>)", kind="authentication_error",
                           code="invalid_api_key")

    def chat_template(self, router: Router) -> ChatTemplate:
        if "template" not in self._templates:
            source = find_chat_template(self.http.chat_template, router.model_info["model_path"])
            eos = router.tokenizer.id_to_token(min(router.eos_ids)) if router.eos_ids else ""
            self._templates["template"] = source and ChatTemplate(source, eos)
        if self._templates["template"] is None:
            raise no_template_error(self.model_name(router))
        return self._templates["template"]

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        router = self.router()
        model = check_model(body, self.model_name(router))
        generate = generate_request(body, completion_prompt(body), body.max_tokens, body.logprobs)
        return await answer(request, router, body, generate, Completions(_decoder(router)), "prompt", model)

    async def chat(self, body: ChatRequest, request: Request) -> Response:
        router = self.router()
        model = check_model(body, self.model_name(router))
        prompt = self.chat_template(router).render(body.messages)
        max_tokens = body.max_completion_tokens or body.max_tokens or DEFAULT_CHAT_MAX_TOKENS
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        generate = generate_request(body, prompt, max_tokens, logprobs)
        return await answer(request, router, body, generate, ChatCompletions(_decoder(router)), "messages", model)

    async def models(self) -> dict:
        name = self.model_name(self.router())
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "specpool"}]}

    async def health(self) -> dict:
        self.router()
        return {"status": "ok"}


async def api_error(request: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
    """A body that does not parse: 400 naming the first parameter at fault, in OpenAI's shape."""
    error = exc.errors()[0]
    param = ".".join(str(part) for part in error["loc"] if part != "body" and not isinstance(part, int)) or None
    return JSONResponse(ApiError(400, f"{param}: {error['msg']}", param).body(), status_code=400)


def create_app(http: HttpConfig, get_router: Callable[[], Router | None]) -> FastAPI:
    """The app, answering 503 until `get_router()` returns the Router (the pools have loaded)."""
    api = Api(http, get_router)
    app = FastAPI(title="specpool", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, invalid_body)
    authorized = [Depends(api.authorize)]
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/v1/models", api.models, methods=["GET"], dependencies=authorized)
    app.add_api_route("/v1/completions", api.completions, methods=["POST"], dependencies=authorized)
    app.add_api_route("/v1/chat/completions", api.chat, methods=["POST"], dependencies=authorized)
    return app


def _decoder(router: Router) -> Callable[[int], str]:
    return lambda token_id: router.tokenizer.decode([token_id], skip_special_tokens=False)


def check_model(body: SamplingBody, served: str) -> str:
    if body.model != served:
        raise ApiError(404, f"The model `{body.model}` does not exist (this server serves `{served}`)", "model",
                       code="model_not_found")
    return served


async def admit(router: Router, generate, n: int, prompt_param: str, streamed: bool) -> list:
    try:
        return [await router.admit(with_seed(generate, i), streamed) for i in range(n)]
    except RequestError as exc:
        count(router, "INVALID_ARGUMENT", time.perf_counter())
        raise ApiError(400, str(exc), openai_param(exc.field, prompt_param)) from exc


async def answer(request: Request, router: Router, body: SamplingBody, generate, kind: Completions,
                 prompt_param: str, model: str) -> Response:
    states = await admit(router, generate, body.n, prompt_param, body.stream)
    request_id, started = uuid.uuid4().hex, time.perf_counter()
    chunks = choice_chunks(router, states)
    if body.stream:
        first = await until_disconnected(request, tracked(router, next_chunk(chunks), started, final=False))
        return StreamingResponse(sse(router, states, chunks, first, kind, request_id, model, body.include_usage,
                                     started),
                                 media_type="text/event-stream")
    texts, entries = [[] for _ in states], [[] for _ in states]

    async def collect():
        async for index, chunk in chunks:
            texts[index].append(chunk.text)
            entries[index].extend(chunk.logprobs)
    await until_disconnected(request, tracked(router, collect(), started))
    logprobs = [e if generate.HasField("logprobs") else None for e in entries]
    choices = [kind.choice(i, "".join(texts[i]), logprobs[i], FINISH.get(s.finish_reason)) for i, s in enumerate(states)]
    return JSONResponse({**envelope(kind, request_id, model, choices), "usage": usage(states),
                         "specpool": spec_stats(states)})


async def choice_chunks(router: Router, states: list) -> AsyncIterator[tuple]:
    """(choice index, Chunk) of the n choices as they come, generated concurrently. Closing this cancels
    every choice still running (and so frees its workers' caches)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, state) -> None:
        try:
            async with contextlib.aclosing(output_chunks(router.run(state), state, router.tokenizer)) as chunks:
                async for chunk in chunks:
                    await queue.put((index, chunk, None))
            await queue.put((index, None, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((index, None, exc))
    tasks = [asyncio.create_task(pump(i, state)) for i, state in enumerate(states)]
    try:
        running = len(tasks)
        while running:
            index, chunk, error = await queue.get()
            if error is not None:
                raise error
            if chunk is None:
                running -= 1
            else:
                yield index, chunk
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def next_chunk(chunks) -> tuple:
    """The next (index, Chunk), or (None, None) at the end. (anext's default argument trips a CPython 3.11
    bug, SystemError, when the generator ends after awaiting in its finally block.)"""
    try:
        return await anext(chunks)
    except StopAsyncIteration:
        return None, None


def failure(exc: BaseException) -> tuple[str, ApiError | None]:
    """The gRPC code a failed request is counted under, and the API error it answers (None: re-raise)."""
    if isinstance(exc, Overloaded):
        return "RESOURCE_EXHAUSTED", ApiError(429, str(exc), kind="rate_limit_exceeded")
    if isinstance(exc, grpc.aio.AioRpcError):
        return "UNAVAILABLE", ApiError(503, f"a worker failed: {exc.code().name}: {exc.details()}",
                                       kind="service_unavailable")
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return "CANCELLED", None
    return "UNKNOWN", None


def count(router: Router, code: str, started: float) -> None:
    """specpool_requests_total by the gRPC code the request would have had; latency of those that succeed."""
    router.metrics.requests.labels(code).inc()
    if code == "OK":
        router.metrics.e2e.observe(time.perf_counter() - started)


async def tracked(router: Router, awaitable, started: float, final: bool = True):
    """Await a request's work, turning router errors into API errors (429 overload, 503 worker failure) and
    counting the request once it is over (`final`), or if this fails."""
    code = "OK"
    try:
        return await awaitable
    except BaseException as exc:
        code, error = failure(exc)
        if error is not None:
            raise error from exc
        raise
    finally:
        if final or code != "OK":
            count(router, code, started)


async def until_disconnected(request: Request, awaitable, poll_s: float = 0.2):
    """Await `awaitable`, cancelling it if the client disconnects meanwhile (a plain HTTP response is not
    cancelled by the server when its client goes away)."""
    task = asyncio.ensure_future(awaitable)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=poll_s)
            if not task.done() and await request.is_disconnected():
                task.cancel()
        return await task
    finally:
        task.cancel()


def event(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def sse(router: Router, states: list, chunks, first: tuple, kind: Completions, request_id: str, model: str,
              include_usage: bool, started: float) -> AsyncIterator[str]:
    """Server-sent events: a chunk per piece of output of each choice, then usage if asked, then [DONE]. A
    failure after the first chunk is sent as an error event (the status line has gone)."""
    usage_field = {"usage": None} if include_usage else {}

    def chunk_event(choice: dict) -> str:
        return event({**envelope(kind, request_id, model, [choice], chunk=True), **usage_field})
    code = "OK"
    try:
        async with contextlib.aclosing(chunks):
            for index in range(len(states)):
                for opening in kind.opening(index):
                    yield chunk_event(opening)
            index, chunk = first
            while chunk is not None:
                logprobs = chunk.logprobs if states[index].top_logprobs is not None else None
                yield chunk_event(kind.chunk_choice(index, chunk.text, logprobs, FINISH.get(chunk.finish_reason)))
                index, chunk = await next_chunk(chunks)
    except BaseException as exc:
        code, error = failure(exc)
        if error is None:
            raise
        yield event(error.body())
    finally:
        count(router, code, started)
    if include_usage:
        yield event({**envelope(kind, request_id, model, [], chunk=True), "usage": usage(states),
                     "specpool": spec_stats(states)})
    yield event("[DONE]")
