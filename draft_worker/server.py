"""gRPC servicer of a draft worker (specpool.v1.DraftWorker). Propose calls that arrive together
run their drafting steps as one batch (see engine/batching.py)."""
from __future__ import annotations

from protos.specpool.v1 import worker_pb2, worker_pb2_grpc
from engine.batching import Batcher
from engine.worker_server import EngineRunner, answer, serve_stream


class DraftServicer(worker_pb2_grpc.DraftWorkerServicer):
    def __init__(self, engine, max_batch: int = 1, max_wait_s: float = 0.0, inline_max_s: float = 0.0):
        self._engine = engine
        self._runner = EngineRunner(inline_max_s)
        self._batcher = Batcher(self._propose_batch, max_batch, max_wait_s)

    async def _propose_batch(self, requests: list, gone) -> list:
        return await self._runner.run(self._engine.propose_batch, requests, gone,
                                      inline=all(request.position for request in requests))

    async def Propose(self, request, context):
        return await answer(context, self._batcher.submit(request))

    async def ProposeStream(self, requests, context):
        async for response in serve_stream(requests, lambda request, _: self._batcher.submit(request),
                                           worker_pb2.ProposeResponse):
            yield response

    async def Release(self, request, context):
        await self._runner.call(context, self._engine.release, request.session_id)
        return worker_pb2.ReleaseResponse()
