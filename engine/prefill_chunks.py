"""Chunked prefill (`*.prefill_chunk_tokens`): a call with more new tokens than a chunk (a long prompt) runs as
several forwards of at most that many tokens, each its own trip through the worker's Batcher, so that the calls
waiting meanwhile (other requests' rounds and decode steps) run between them instead of after the whole prompt.
No torch here.

The engine computes a chunk and answers Prefilled with the call for the rest; the servicer submits that call again
(whole; a target's decode run in DecodeRun.advance) until a chunk is the last and the call gets its answer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Awaitable, Callable

from engine.prefix_cache import lookup_stats
from protos.specpool.v1 import generation_pb2

if TYPE_CHECKING:
    from engine.sessions import Session, SessionStore


@dataclass
class Prefilled:
    """The answer to a call whose new tokens were more than a chunk: the worker now holds their first chunk, and
    `rest` is the call (VerifyRequest or ProposeRequest) for the others, from the position after the chunk.
    `prefix_cache`: what a session start found in the prefix cache, for its last answer."""
    rest: object
    prefix_cache: generation_pb2.PrefixCacheStats | None = None


def chunk_ends(rows: list, requests: list, found: dict, chunk: int) -> dict:
    """{index: where its forward ends among its new tokens} for the rows [(index, session)] with more new tokens
    than `chunk` past the `found` ones the prefix cache gave them (0: none is chunked)."""
    return {i: found[i] + chunk for i, _ in rows if chunk and len(requests[i].new_token_ids) - found[i] > chunk}


def rest_of(request, held: int):
    """The call for what the worker does not hold yet of `request`'s new tokens, now that it holds `held` tokens."""
    rest = type(request)()
    rest.CopyFrom(request)
    del rest.new_token_ids[:held - request.position]
    rest.position = held
    rest.ClearField("sampling")               # sampling travels only with position 0
    return rest


def prefilled(store: SessionStore, request, session: Session, found: int) -> Prefilled:
    """A chunked row's answer, once its chunk is in the session's cache: the call for the rest. The session is
    mid-prefill (Session.chunked), held again if its own batch evicted it, and settled up to what it holds."""
    session.chunked, session.settled = True, session.length
    store.hold(request.session_id, session)
    start = lookup_stats(request, found) if request.position == 0 else None
    return Prefilled(rest_of(request, session.length), start)


async def whole(submit: Callable[[object], Awaitable], request):
    """A call's answer through `submit` (a Batcher's), its chunks one after another."""
    answer, start = await submit(request), None
    while isinstance(answer, Prefilled):
        start = start or answer.prefix_cache
        answer = await submit(answer.rest)
    if start is not None:
        answer.prefix_cache.CopyFrom(start)
    return answer
