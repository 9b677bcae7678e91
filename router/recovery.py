"""A request's wait for its failed target to be restarted, bounded by router.target_recovery_s and the client's
deadline (recover_target), and the error of a request that stopped waiting (gave_up)."""
from __future__ import annotations

import asyncio
import time

import grpc

from router.request_state import WORKER_DOWN, RequestState
from router.worker_client import GaveUp, TargetClient


async def recover_target(state: RequestState, target: TargetClient, exc: grpc.aio.AioRpcError,
                         give_up: float | None, recovery_s: float) -> float:
    """After a target call failed with `exc`: wait for the target to be back (its cache is gone: the next call
    re-prefills) and return the time to give up at; re-raise `exc` when the failure is not the worker being
    down or the client's deadline has passed already, and raise GaveUp once the time to give up (recovery_s after
    the first failure, or the client's deadline) has come while the target was down."""
    now = time.monotonic()
    give_up = give_up if give_up is not None else now + recovery_s
    left = min(state.timeout(recovery_s), give_up - now)
    if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:       # out of device memory: the request's, not the target's
        state.count_out_of_memory("target")
    if exc.code() not in WORKER_DOWN or state.timeout(1.0) <= 0:
        raise exc
    target.mark_failed(exc)
    state.target_synced = 0
    try:
        if left <= 0:
            raise asyncio.TimeoutError
        await target.wait_recovered(left)
    except asyncio.TimeoutError:
        raise gave_up(state, target, recovery_s) from None
    return give_up


def gave_up(state: RequestState, target: TargetClient, recovery_s: float) -> GaveUp:
    """The error of a request that stopped waiting for its target: DEADLINE_EXCEEDED if the client's deadline came
    first, else UNAVAILABLE naming the recovery bound (logged once per outage). Either says what the target failed
    with, not the stale transport error of the request's last call."""
    cause = f"it failed with: {target.last_error or 'unknown error'}"
    if state.timeout(1.0) <= 0:
        return GaveUp(grpc.StatusCode.DEADLINE_EXCEEDED, f"{target.name} was down and had not recovered ({cause})")
    target.give_up(recovery_s)
    return GaveUp(grpc.StatusCode.UNAVAILABLE,
                  f"{target.name} did not recover within router.target_recovery_s = {recovery_s:g} s ({cause})")
