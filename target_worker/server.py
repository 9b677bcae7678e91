"""gRPC servicer of a target worker (specpool.v1.TargetWorker), served by TP rank 0.

Verify calls go through a Batcher: those that arrive together run as one batched forward (on every
TP rank), each row rejection-sampled on its own.
"""
from __future__ import annotations

from protos.specpool.v1 import worker_pb2, worker_pb2_grpc
from engine.batching import Batcher
from engine.worker_server import EngineRunner, answer, serve_stream
from target_worker.tensor_parallel import RELEASE, VERIFY_BATCH, lead


class TargetServicer(worker_pb2_grpc.TargetWorkerServicer):
    def __init__(self, engine, world_size: int, max_batch: int = 1, max_wait_s: float = 0.0):
        self._engine = engine
        self._world_size = world_size
        self._runner = EngineRunner()
        self._batcher = Batcher(self._verify_batch, max_batch, max_wait_s)

    async def _verify_batch(self, requests: list, gone=None) -> list:
        batch = worker_pb2.VerifyBatch(requests=requests)
        return await self._runner.run(lead, self._engine, VERIFY_BATCH, batch, self._world_size)

    async def Verify(self, request, context):
        return await answer(context, self._batcher.submit(request))

    async def VerifyStream(self, requests, context):
        async for response in serve_stream(requests, self._batcher.submit, worker_pb2.VerifyResponse):
            yield response

    async def Release(self, request, context):
        await self._runner.call(context, lead, self._engine, RELEASE, request, self._world_size)
        return worker_pb2.ReleaseResponse()
