"""gRPC servicer of a draft worker (specpool.v1.DraftWorker). Propose calls that arrive together
run their drafting steps as one batch (see engine/batching.py). A call with `hand_to` set also hands its
drafts straight to that target worker (engine/handoff.py), before answering the router."""
from __future__ import annotations

from typing import Callable

import grpc

from protos.specpool.v1 import worker_pb2, worker_pb2_grpc
from engine.batching import Batcher
from engine.handoff import HandoffSenders
from engine.worker_server import EngineRunner, answer, serve_stream


class DraftServicer(worker_pb2_grpc.DraftWorkerServicer):
    def __init__(self, engine, max_batch: int = 1, max_wait_s: float = 0.0, inline_max_s: float = 0.0,
                 channel: Callable[[str], grpc.aio.Channel] = grpc.aio.insecure_channel):
        self._engine = engine
        self._runner = EngineRunner(inline_max_s)
        self._batcher = Batcher(self._propose_batch, max_batch, max_wait_s)
        self._handoffs = HandoffSenders(channel)   # channel(address): to the targets drafts are handed to

    async def _propose_batch(self, requests: list, gone) -> list:
        return await self._runner.run(self._engine.propose_batch, requests, gone,
                                      inline=all(request.position for request in requests))

    async def _propose(self, request: worker_pb2.ProposeRequest) -> worker_pb2.ProposeResponse:
        response = await self._batcher.submit(request)
        if request.hand_to:
            self._handoffs.send(request.hand_to, worker_pb2.DraftHandoff(
                session_id=request.session_id, handoff_id=request.handoff_id,
                draft_token_ids=response.draft_token_ids, draft_hidden_states=response.draft_hidden_states))
        return response

    async def Propose(self, request, context):
        return await answer(context, self._propose(request))

    async def ProposeStream(self, requests, context):
        async for response in serve_stream(requests, lambda request, _: self._propose(request),
                                           worker_pb2.ProposeResponse):
            yield response

    async def Release(self, request, context):
        await self._runner.call(context, self._engine.release, request.session_id)
        return worker_pb2.ReleaseResponse()
