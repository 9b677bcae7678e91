"""Handed-off rounds: a round's drafts go from the draft worker straight to the target (speculation.hand_off).

A round whose drafts are not pre-drafted makes two calls in turn: the draft's answer goes to the router, and the
router sends the drafts on to the target. Handed off, the router sends both calls at once: the verify call
(VerifyRequest.handoff_id) waits on the target, and the draft worker hands its drafts to the target itself
(ProposeRequest.hand_to) as it answers the router, taking a one-way hop and the router's turn off the round's
critical path. Only rounds that pre-draft nothing beside their verify are handed off: the pre-draft goes out when
the draft's answer reaches the router, so a verify started sooner would leave it less time (on this machine,
pre-drafts sized to fit beside the verify then carried fewer branches and hit less). The router also sends its copy of the drafts once the draft's answer reaches it, so a handoff that
never arrives (a broken draft -> target connection) costs the round one hop, not the call's deadline. The target
verifies the first copy of a handoff to arrive and drops the rest.

    sender = HandoffStream(stub.HandDrafts)     # one long-lived client stream per target
    sender.send(worker_pb2.DraftHandoff(session_id=7, handoff_id=12, draft_token_ids=[5, 9]))
    drafts = await waiting_room.take((7, 12))   # on the target: the handoff, once the first copy is in

Nothing here imports torch: the router sends its copies with HandoffStream too.
"""
from __future__ import annotations

import asyncio
import collections
from typing import Callable

import grpc

from protos.specpool.v1 import worker_pb2_grpc


class HandoffStream:
    """One client-streaming HandDrafts call: send() queues a handoff, written in order. A call that ended (its
    target went away or restarted) is opened again by the next send; what it had not written is lost, and the
    router's copy stands in for it."""

    def __init__(self, open_call: Callable):
        self._open = open_call              # stub.HandDrafts
        self._queue: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None

    def send(self, handoff) -> None:
        if self._task is None or self._task.done():
            self._queue = asyncio.Queue()
            self._task = asyncio.ensure_future(self._run(self._queue))
        self._queue.put_nowait(handoff)

    async def _run(self, queue: asyncio.Queue) -> None:
        async def handoffs():
            while (handoff := await queue.get()) is not None:
                yield handoff
        try:
            await self._open(handoffs())
        except grpc.aio.AioRpcError:
            pass                            # the target is gone: the next send opens a new call

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None


class WaitingRoom:
    """A target's handoffs by (session id, handoff id): each handed-off call takes its drafts here, waiting for
    them if they have not arrived. The first copy of a handoff counts. Bounded: past `capacity` handoffs nobody
    waits for, the oldest are forgotten; keys taken lately are remembered, so their late copies are dropped."""

    def __init__(self, capacity: int = 256):
        self._handoffs: collections.OrderedDict[tuple[int, int], asyncio.Future] = collections.OrderedDict()
        self._taken: collections.OrderedDict[tuple[int, int], None] = collections.OrderedDict()
        self._capacity = capacity

    def _future(self, key: tuple[int, int]) -> asyncio.Future:
        future = self._handoffs.get(key)
        if future is None:
            future = self._handoffs[key] = asyncio.get_running_loop().create_future()
        return future

    def _evict(self) -> None:
        if len(self._handoffs) <= self._capacity:
            return
        unclaimed = [key for key, future in self._handoffs.items() if future.done()]
        for key in unclaimed[:max(len(unclaimed) - self._capacity, 0)]:
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

    def __init__(self, channel: Callable[[str], grpc.aio.Channel], capacity: int = 8):
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
        asyncio.ensure_future(channel.close())

    def close(self) -> None:
        while self._senders:
            self._retire(*self._senders.popitem()[1])
