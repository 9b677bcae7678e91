"""Handed-off rounds: a round's drafts go from the draft worker straight to the target (speculation.hand_off).

A round whose drafts are not pre-drafted makes two calls in turn: the draft's answer goes to the router, and the
router sends the drafts on to the target. Handed off, the router sends both calls at once: the verify call
(VerifyRequest.handoff_id) waits on the target, and the draft worker hands its drafts to the target itself
(ProposeRequest.hand_to) as it answers the router, taking a one-way hop and the router's turn off the round's
critical path. Only rounds that pre-draft nothing beside their verify, or whose pre-draft is chained to the draft
call (speculation.chain_predrafts: the draft worker starts it right after the drafts), are handed off: a
pre-draft the router sends goes out when the draft's answer reaches it, so a verify started sooner would leave it
less time (on this machine, pre-drafts sized to fit beside the verify then carried fewer branches and hit less).
The router also
sends its copy of the drafts once the draft's answer reaches it, so a handoff that never arrives (a broken
draft -> target connection) costs the round one hop, not the call's deadline. The target verifies the first
copy of a handoff to arrive and drops the rest.

    sender = HandoffStream(stub.HandDrafts)     # one long-lived client stream per target
    sender.send(worker_pb2.DraftHandoff(session_id=7, handoff_id=12, draft_token_ids=[5, 9]))
    drafts = await waiting_room.take((7, 12))   # on the target: the handoff, once the first copy is in

Nothing here imports torch: the router sends its copies with HandoffStream too.
"""
from __future__ import annotations

import asyncio
import collections
import time
from typing import Callable

import grpc

from protos.specpool.v1 import worker_pb2_grpc

_CLOSING: set = set()       # channel closes in flight (the event loop keeps only weak references to tasks)


class HandoffStream:
    """One client-streaming HandDrafts call: send() queues a handoff, written in order. A call that ended (its
    target went away or restarted) is opened again by the next send, and what it had not taken yet goes on the
    new call; only a handoff being written as it broke is lost (the router's copy stands in for it). An ended
    call's request iterator may still be waiting (grpc.aio does not cancel it): it takes nothing more."""

    def __init__(self, open_call: Callable):
        self._open = open_call              # stub.HandDrafts
        self._pending: collections.deque = collections.deque()
        self._arrived = asyncio.Event()
        self._call = 0                      # the current call's number
        self._task: asyncio.Task | None = None

    def send(self, handoff) -> None:
        self._pending.append(handoff)
        self._arrived.set()
        if self._task is None or self._task.done():
            self._call += 1
            self._task = asyncio.ensure_future(self._run(self._call))

    async def _handoffs(self, call: int):
        while True:
            while not self._pending:
                self._arrived.clear()
                await self._arrived.wait()
            if call != self._call:
                return                      # an ended call's iterator: the handoff waits for the current call
            yield self._pending.popleft()

    async def _run(self, call: int) -> None:
        try:
            await self._open(self._handoffs(call))
        except (grpc.aio.AioRpcError, grpc.aio.UsageError):
            pass                            # the target is gone, or the channel closed: the next send opens anew

    def close(self) -> None:
        self._call += 1                     # no iterator takes anything more
        self._arrived.set()
        if self._task is not None:
            self._task.cancel()
            self._task = None


class WaitingRoom:
    """A target's handoffs by (session id, handoff id): each handed-off call takes its drafts here, waiting for
    them if they have not arrived. The first copy of a handoff counts. A handoff nobody waits for is forgotten
    once it is `max_age_s` old or `capacity` newer ones are in (a copy for a call withdrawn before it ran, a late
    copy); keys taken lately are remembered, so their late copies are dropped. `clock` is injectable for tests."""

    def __init__(self, capacity: int = 256, max_age_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self._handoffs: collections.OrderedDict[tuple[int, int], tuple[asyncio.Future, float]] = \
            collections.OrderedDict()
        self._taken: collections.OrderedDict[tuple[int, int], None] = collections.OrderedDict()
        self._capacity, self._max_age_s, self._clock = capacity, max_age_s, clock

    def _future(self, key: tuple[int, int]) -> asyncio.Future:
        if key not in self._handoffs:
            self._handoffs[key] = asyncio.get_running_loop().create_future(), self._clock()
        return self._handoffs[key][0]

    def _evict(self) -> None:
        """Forget the oldest handoffs that nobody waits for, while they are too old or too many."""
        now = self._clock()
        for key, (future, born) in list(self._handoffs.items()):
            if len(self._handoffs) <= self._capacity and now - born < self._max_age_s:
                return
            if future.done():
                del self._handoffs[key]

    def put(self, handoff) -> None:
        """A copy of a handoff arrived: the first one is kept, later ones dropped."""
        key = (handoff.session_id, handoff.handoff_id)
        if key in self._taken:
            return
        future = self._future(key)
        if not future.done():
            future.set_result(handoff)
            self._evict()

    async def take(self, key: tuple[int, int]):
        """The handoff `key`, once its first copy is in. Until done() it stays here: a call the target must
        repeat from position 0 (it lost the session) takes it again."""
        return await asyncio.shield(self._future(key))

    def done(self, key: tuple[int, int]) -> None:
        """The call handed `key` off is over: forget it, and drop its late copies."""
        self._handoffs.pop(key, None)
        self._taken[key] = None
        while len(self._taken) > 4 * self._capacity:
            self._taken.popitem(last=False)


class HandoffSenders:
    """A draft worker's HandoffStreams, one per target address it hands drafts to, each on a channel of its own
    (`channel(address)`); the least recently used are closed past `capacity` addresses (a target that restarted
    elsewhere is not handed to again)."""

    def __init__(self, channel: Callable[[str], grpc.aio.Channel], capacity: int = 64):
        self._channel, self._capacity = channel, capacity
        self._senders: collections.OrderedDict[str, tuple] = collections.OrderedDict()

    def send(self, address: str, handoff) -> None:
        if address not in self._senders:
            channel = self._channel(address)
            self._senders[address] = channel, HandoffStream(worker_pb2_grpc.TargetWorkerStub(channel).HandDrafts)
            while len(self._senders) > self._capacity:
                self._retire(*self._senders.popitem(last=False)[1])
        self._senders.move_to_end(address)
        self._senders[address][1].send(handoff)

    @staticmethod
    def _retire(channel: grpc.aio.Channel, stream: HandoffStream) -> None:
        stream.close()
        task = asyncio.ensure_future(channel.close())
        _CLOSING.add(task)
        task.add_done_callback(_CLOSING.discard)

    def close(self) -> None:
        while self._senders:
            self._retire(*self._senders.popitem()[1])
