"""Staged rounds: the next round's verify, started by the target itself the moment its verdict is known.

With overlap, the router pre-drafts round r+1 for the likeliest verdicts of round r while the target verifies r.
When the pre-draft is back before the verdict, the router sends it to the target as a staged call
(VerifyRequest.staged: a candidate per guessed verdict). The target keeps each verify's verdict here, keyed by
(session, committed tokens before its drafts); a staged call waits for the verdict of its round, and the candidate
that guessed it becomes the call the router would have sent on seeing the verdict, so on a hit the next round
costs no router round trip at all. Drafts are only proposals: which ones the target verifies next never changes
the distribution of what it commits.

    key = round_key(request)              # (session id, position + new tokens): where its drafts start

A staged call names a round the target has started (or just answered): the router stages round r+2 only after it
has seen verdict r, and by then the target has started round r+1. One for a round it does not know answers
`missed`, and the router then sends its verify as usual.
"""
from __future__ import annotations

import asyncio
from collections import OrderedDict

from protos.specpool.v1 import worker_pb2


def round_key(request: worker_pb2.VerifyRequest) -> tuple[int, int]:
    """The round a verify call runs: its session and the committed tokens the session holds before its drafts
    (the same for a call re-sent from position 0 after the session was lost)."""
    return request.session_id, request.position + len(request.new_token_ids)


def follow_up(staged: worker_pb2.VerifyRequest,
              verdict: worker_pb2.VerifyResponse | None) -> worker_pb2.VerifyRequest | None:
    """The verify a staged call makes after `verdict` (None: its round failed or is unknown): the candidate that
    guessed the verdict, as the router would have sent it; None when no candidate did."""
    if verdict is None or verdict.missed:
        return None
    for candidate in staged.staged.candidates:
        if (candidate.num_accepted, candidate.next_token_id) == (verdict.num_accepted, verdict.next_token_id):
            follow = worker_pb2.VerifyRequest(
                session_id=staged.session_id, position=staged.position + candidate.num_accepted,
                new_token_ids=[candidate.next_token_id], draft_token_ids=candidate.draft_token_ids,
                draft_hidden_states=candidate.draft_hidden_states, call_id=staged.call_id)
            if staged.HasField("top_logprobs"):
                follow.top_logprobs = staged.top_logprobs
            follow.staged.SetInParent()        # marks it staged (never run inline: its verdict goes out first)
            return follow
    return None


class Verdicts:
    """The verdicts of recent verify calls by round_key, for the staged call that follows each (at most one:
    taking a verdict forgets it). Bounded: the oldest are forgotten past `capacity` (a staged call that comes
    later answers `missed`)."""

    def __init__(self, capacity: int = 1024):
        self._futures: OrderedDict[tuple[int, int], asyncio.Future] = OrderedDict()
        self._capacity = capacity

    def expect(self, key: tuple[int, int]) -> asyncio.Future:
        """A future for the verdict of the round `key`, set by the call that verifies it (None: it failed)."""
        future = asyncio.get_running_loop().create_future()
        self._futures.pop(key, None)
        self._futures[key] = future
        while len(self._futures) > self._capacity:
            self._futures.popitem(last=False)[1].cancel()
        return future

    async def take(self, key: tuple[int, int]) -> worker_pb2.VerifyResponse | None:
        """The verdict of round `key` once it is known; None for a round that failed or that nobody verifies."""
        future = self._futures.pop(key, None)
        if future is None:
            return None
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if future.cancelled():             # forgotten (capacity), not this caller cancelled
                return None
            raise


def deliver(future: asyncio.Future, verdict: worker_pb2.VerifyResponse | None) -> None:
    """Hand a round's verdict (None: the call failed) to the staged call waiting for it, if any."""
    if not future.done():
        future.set_result(verdict)
