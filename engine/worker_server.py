"""What the draft and target gRPC servers share: running the engine off the event loop, mapping
engine errors to gRPC statuses, and starting a grpc.aio server on the worker's node."""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable

import grpc

from engine.sessions import SessionLost

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
SERVER_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                  ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                  ("grpc.so_reuseport", 0)]


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


async def answer(context: grpc.aio.ServicerContext, call: Awaitable):
    """Await an engine call, turning its errors into gRPC statuses: a lost session is NOT_FOUND (the
    router re-prefills), a bad argument INVALID_ARGUMENT. The answer is stamped with the handler's time."""
    started = time.perf_counter()
    try:
        response = await call
        if hasattr(response, "handler_us"):
            response.handler_us = int((time.perf_counter() - started) * 1e6)
        return response
    except SessionLost as exc:
        await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
    except ValueError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


class EngineRunner:
    """Runs engine calls one at a time on a dedicated thread (the model is not thread-safe)."""

    def __init__(self):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    async def run(self, fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, timed, fn, *args)

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
