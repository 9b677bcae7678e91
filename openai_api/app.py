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


def create_app(http: HttpConfig, get_router: Callable[[], Router | None]) -> FastAPI:
    """The app, answering 503 until `get_router()` returns the Router (the pools have loaded)."""
    app = FastAPI(title="specpool", docs_url=None, redoc_url=None, openapi_url=None)
    templates: dict = {}

    def router() -> Router:
        current = get_router()
        if current is None:
            raise ApiError(503, "specpool is still loading its worker pools", kind="service_unavailable")
        return current

    def model_name(current: Router) -> str:
        return http.model_name or Path(current.model_info["model_path"]).name

    def authorized(request: Request) -> None:
        if http.api_keys and request.headers.get("authorization", "") not in {f"Bearer {k}" for k in http.api_keys}:
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer <key>)", kind="authentication_error",
                           code="invalid_api_key")

    def chat_template(current: Router) -> ChatTemplate:
        if "template" not in templates:
            source = find_chat_template(http.chat_template, current.model_info["model_path"])
            templates["template"] = source and ChatTemplate(source, current.tokenizer.id_to_token(
                min(current.eos_ids)) if current.eos_ids else "")
        if templates["template"] is None:
            raise no_template_error(model_name(current))
        return templates["template"]

    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request, exc: RequestValidationError):
        error = exc.errors()[0]
        param = ".".join(str(part) for part in error["loc"] if part != "body" and not isinstance(part, int)) or None
        return JSONResponse(ApiError(400, f"{param}: {error['msg']}", param).body(), status_code=400)

    @app.get("/health")
    async def health():
        router()
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        current = router()
        return {"object": "list", "data": [{"id": model_name(current), "object": "model", "created": 0,
                                            "owned_by": "specpool"}]}

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, request: Request):
        current = router()
        check_model(body, model_name(current))
        generate = generate_request(body, completion_prompt(body), body.max_tokens, body.logprobs)
        return await answer(request, current, body, generate, Completions(_decoder(current)), "prompt",
                            model_name(current))

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat(body: ChatRequest, request: Request):
        current = router()
        check_model(body, model_name(current))
        prompt = chat_template(current).render(body.messages)
        max_tokens = body.max_completion_tokens or body.max_tokens or DEFAULT_CHAT_MAX_TOKENS
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        generate = generate_request(body, prompt, max_tokens, logprobs)
        return await answer(request, current, body, generate, ChatCompletions(_decoder(current)), "messages",
                            model_name(current))

    return app


def _decoder(router: Router) -> Callable[[int], str]:
    return lambda token_id: router.tokenizer.decode([token_id], skip_special_tokens=False)


def check_model(body: SamplingBody, served: str) -> None:
    if body.model != served:
        raise ApiError(404, f"The model `{body.model}` does not exist (this server serves `{served}`)", "model",
                       code="model_not_found")


def admit(router: Router, generate, n: int, prompt_param: str) -> list:
    try:
        return [router.admit(with_seed(generate, i)) for i in range(n)]
    except RequestError as exc:
        raise ApiError(400, str(exc), openai_param(exc.field, prompt_param)) from exc


async def answer(request: Request, router: Router, body: SamplingBody, generate, kind: Completions,
                 prompt_param: str, model: str) -> Response:
    states = admit(router, generate, body.n, prompt_param)
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
