"""The router's gRPC clients for draft and target workers, and the session re-sync rule.

Each call sends only the committed tokens the worker does not hold yet (from `synced`). A worker
that answers NOT_FOUND has lost the session: the call is repeated once with position 0 and the
whole committed context (re-prefill).
"""
from __future__ import annotations

from typing import Awaitable, Callable

import grpc

from protos.specpool.v1 import generation_pb2, worker_pb2, worker_pb2_grpc

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024),
                   ("grpc.max_send_message_length", 64 * 1024 * 1024)]


async def synced_call(rpc: Callable[..., Awaitable], make_request: Callable, tokens: list[int],
                      synced: int, timeout: float):
    """Call `rpc(make_request(position, new_tokens, start))`; on NOT_FOUND re-prefill from 0.
    Returns (response, wire_bytes)."""
    position = synced
    while True:
        request = make_request(position, tokens[position:], position == 0)
        try:
            response = await rpc(request, timeout=timeout)
            return response, request.ByteSize() + response.ByteSize()
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND or position == 0:
                raise
            position = 0


class WorkerClient:
    """One worker replica's channel, plus the number of sessions the router has routed to it."""

    def __init__(self, address: str, stub_class, timeout: float):
        self.address = address
        self.timeout = timeout
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = stub_class(self.channel)
        self.outstanding = 0

    async def release(self, session_id: int) -> None:
        await self.stub.Release(worker_pb2.ReleaseRequest(session_id=session_id), timeout=self.timeout)

    async def close(self) -> None:
        await self.channel.close()


class DraftClient(WorkerClient):
    def __init__(self, address: str, timeout: float = 30.0):
        super().__init__(address, worker_pb2_grpc.DraftWorkerStub, timeout)

    async def propose(self, session_id: int, tokens: list[int], synced: int, k: int,
                      sampling: generation_pb2.SamplingParams, mode: int):
        def make(position, new, start):
            return worker_pb2.ProposeRequest(session_id=session_id, position=position, new_token_ids=new, k=k,
                                             sampling=sampling if start else None, mode=mode)
        return await synced_call(self.stub.Propose, make, tokens, synced, self.timeout)


class TargetClient(WorkerClient):
    def __init__(self, address: str, timeout: float = 30.0):
        super().__init__(address, worker_pb2_grpc.TargetWorkerStub, timeout)

    async def verify(self, session_id: int, tokens: list[int], synced: int, drafts: list[int],
                     hidden: bytes, sampling: generation_pb2.SamplingParams):
        def make(position, new, start):
            return worker_pb2.VerifyRequest(session_id=session_id, position=position, new_token_ids=new,
                                            draft_token_ids=drafts, draft_hidden_states=hidden,
                                            sampling=sampling if start else None)
        return await synced_call(self.stub.Verify, make, tokens, synced, self.timeout)


def least_loaded(clients: list[WorkerClient]) -> WorkerClient:
    """The replica with the fewest outstanding sessions (first one on ties)."""
    return min(clients, key=lambda client: client.outstanding)
