"""How a request that a worker's failure ended is answered, for gRPC and HTTP alike: its status and detail."""
from __future__ import annotations

import grpc

from router.worker_client import GaveUp


def worker_failure(exc: grpc.aio.AioRpcError, expired: bool = False) -> tuple[str, str]:
    """The status (its name) and detail of a request that a worker call's failure ended, for gRPC and HTTP alike:
    DEADLINE_EXCEEDED if the client's deadline is what ended it (`expired`, or a GaveUp's own code), RESOURCE_EXHAUSTED
    if the target ran out of device memory for it (the worker serves on), else UNAVAILABLE. The detail says what
    happened: a request that gave up waiting for a failed worker names it and what it failed with (GaveUp)."""
    if isinstance(exc, GaveUp):       # its own code says whether the client's deadline is what it gave up at
        if expired or exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return "DEADLINE_EXCEEDED", f"deadline exceeded: {exc.details()}"
        return exc.code().name, exc.details()
    if expired and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:   # the call was cut at what the deadline left
        return "DEADLINE_EXCEEDED", "deadline exceeded: the client's deadline passed during a worker call"
    if expired:
        return "DEADLINE_EXCEEDED", f"deadline exceeded while waiting for a worker ({exc.details()})"
    if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return "RESOURCE_EXHAUSTED", f"the target: {exc.details()}"
    return "UNAVAILABLE", f"a worker failed: {exc.code().name}: {exc.details()}"
