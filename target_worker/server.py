"""gRPC servicer of a target worker (specpool.v1.TargetWorker), served by TP rank 0."""
from __future__ import annotations

from protos.specpool.v1 import worker_pb2, worker_pb2_grpc
from target_worker.grpc_server import EngineRunner
from target_worker.tensor_parallel import RELEASE, VERIFY, lead


class TargetServicer(worker_pb2_grpc.TargetWorkerServicer):
    def __init__(self, engine, world_size: int):
        self._engine = engine
        self._world_size = world_size
        self._runner = EngineRunner()

    async def Verify(self, request, context):
        return await self._runner.call(context, lead, self._engine, VERIFY, request, self._world_size)

    async def Release(self, request, context):
        await self._runner.call(context, lead, self._engine, RELEASE, request, self._world_size)
        return worker_pb2.ReleaseResponse()
