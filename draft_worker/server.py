"""gRPC servicer of a draft worker (specpool.v1.DraftWorker)."""
from __future__ import annotations

from protos.specpool.v1 import worker_pb2, worker_pb2_grpc
from target_worker.grpc_server import EngineRunner


class DraftServicer(worker_pb2_grpc.DraftWorkerServicer):
    def __init__(self, engine):
        self._engine = engine
        self._runner = EngineRunner()

    async def Propose(self, request, context):
        return await self._runner.call(context, self._engine.propose, request)

    async def Release(self, request, context):
        await self._runner.call(context, self._engine.release, request.session_id)
        return worker_pb2.ReleaseResponse()
