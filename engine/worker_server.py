"""What the draft and target gRPC servers share: running the engine off the event loop, mapping
engine errors to gRPC statuses, and starting a grpc.aio server on the worker's node."""
from __future__ import annotations

import asyncio
import functools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Awaitable, Callable

import grpc

from engine.device_memory import described, exhausted
from engine.sessions import SessionLost

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MESSAGE_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
SERVER_OPTIONS = [*MESSAGE_OPTIONS, ("grpc.so_reuseport", 0)]


def timed(fn: Callable, *args):
    """Call fn; stamp the time it took on its answer, or on each answer of a batch (compute_us), for the
    router's cost model."""
    started = time.perf_counter()
    result = fn(*args)
    elapsed_us = int((time.perf_counter() - started) * 1e6)
    for answer in result if isinstance(result, list) else [result]:
        if hasattr(answer, "compute_us"):
            answer.compute_us = elapsed_us
    return result


class CallFailed(Exception):
    """An engine call's error as the gRPC status it answers with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


async def engine_answer(call: Awaitable):
    """Await an engine call, turning its errors into gRPC statuses (CallFailed): a lost session is NOT_FOUND
    (the router re-prefills), a bad argument INVALID_ARGUMENT, running out of device memory RESOURCE_EXHAUSTED
    (engine.device_memory). The answer is stamped with the handler's time."""
    started = time.perf_counter()
    try:
        response = await call
    except SessionLost as exc:
        raise CallFailed(grpc.StatusCode.NOT_FOUND, str(exc)) from exc
    except ValueError as exc:
        raise CallFailed(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
    except Exception as exc:       # noqa: BLE001 - only running out of memory is answered here; the rest goes on
        if not exhausted(exc):
            raise
        raise CallFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, described(exc)) from exc
    if hasattr(response, "handler_us") and not response.handler_us:    # a decode run stamps each step itself
        response.handler_us = int((time.perf_counter() - started) * 1e6)
    return response


async def answer(context: grpc.aio.ServicerContext, call: Awaitable):
    """engine_answer for a unary call: a failure aborts the call with its status."""
    try:
        return await engine_answer(call)
    except CallFailed as exc:
        await context.abort(exc.code, exc.message)


async def serve_stream(requests, submit: Callable[[object, Callable], Awaitable], response_type) -> AsyncIterator:
    """Answer the calls of one router connection's stream (ProposeStream / VerifyStream): each request runs as
    `submit(request, emit)` would for a unary call, concurrently, so calls of many sessions batch as before;
    answers go out tagged with their call_id as they finish, a failure as its status; `cancel` withdraws a
    call. A call that answers more than once (a decode run) hands its earlier answers to `emit` as it goes; emit
    returns a future done once gRPC has taken that answer (a chained pre-draft starts then, not while it is sent)."""
    answers: asyncio.Queue = asyncio.Queue()
    calls: dict[int, asyncio.Task] = {}

    async def run(request) -> None:
        def emit(partial) -> asyncio.Future:
            partial.call_id = request.call_id
            taken = asyncio.get_running_loop().create_future()
            answers.put_nowait((partial, taken))
            return taken
        try:
            response = await engine_answer(submit(request, emit))
        except CallFailed as exc:
            response = failed(response_type, exc.code, exc.message)
        except Exception as exc:  # noqa: BLE001 - what a unary handler's crash answers, for this call only
            response = failed(response_type, grpc.StatusCode.UNKNOWN, f"Unexpected {type(exc)}: {exc}")
        response.call_id = request.call_id
        answers.put_nowait((response, None))

    async def read() -> None:
        try:
            async for request in requests:
                if request.cancel:
                    task = calls.pop(request.call_id, None)
                    task and task.cancel()
                    continue
                calls[request.call_id] = task = asyncio.ensure_future(run(request))
                task.add_done_callback(lambda _, call_id=request.call_id: calls.pop(call_id, None))
        finally:
            answers.put_nowait((None, None))
    reader = asyncio.ensure_future(read())
    try:
        while True:
            response, taken = await answers.get()
            if response is None:
                break
            yield response
            if taken is not None and not taken.done():
                taken.set_result(None)
    finally:
        reader.cancel()
        for task in list(calls.values()):
            task.cancel()


def failed(response_type, code: grpc.StatusCode, message: str):
    """A stream's answer to a call that failed: its status in the message, the stream staying up."""
    return response_type(status={"code": code.value[0], "message": message})


class EngineRunner:
    """Runs engine calls one at a time on a dedicated thread (the model is not thread-safe).

    A call marked `inline` (one with no session start, whose length is steady) runs on the event loop's own
    thread instead when the engine is idle and such calls have lately taken at most `inline_max_s`: it
    skips the hop to the engine thread and back (measured ~0.2 ms per call on this 2-core machine, a
    trivial engine's whole call 0.5 -> 0.3 ms), at the price of the loop waiting for it. Engine calls still
    never overlap: an inline call starts only while no call is on the engine thread, and none can start
    there until it returns. 0 turns it off."""

    def __init__(self, inline_max_s: float = 0.0, window: int = 16):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._running = 0                 # calls on the engine thread (or queued for it)
        self.inline_max_s = inline_max_s
        self._typical: float | None = None    # exponentially weighted seconds of an `inline` call
        self._weight = 1.0 / window

    async def run(self, fn: Callable, *args, inline: bool = False):
        work = functools.partial(self._learn if inline else timed, fn, *args)
        if inline and not self._running and self._typical is not None and self._typical <= self.inline_max_s:
            return work()
        self._running += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, work)
        finally:
            self._running -= 1

    def _learn(self, fn: Callable, *args):
        """timed(fn, *args), its time folded into what an inline call typically takes."""
        started = time.perf_counter()
        result = timed(fn, *args)
        seconds = time.perf_counter() - started
        self._typical = seconds if self._typical is None else self._typical + self._weight * (seconds - self._typical)
        return result

    async def call(self, context: grpc.aio.ServicerContext, fn: Callable, *args):
        return await answer(context, self.run(fn, *args))


async def start_server(add_servicer: Callable, servicer, host: str, port: int = 0,
                       credentials: grpc.ServerCredentials | None = None) -> tuple[grpc.aio.Server, str]:
    """Start a grpc.aio server for one servicer; returns it and its "host:port" address."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    add_servicer(servicer, server)
    bind = f"{host}:{port}"
    bound = server.add_secure_port(bind, credentials) if credentials else server.add_insecure_port(bind)
    await server.start()
    return server, f"{host}:{bound}"
