"""What a target worker runs where its engine is: a batch of verify calls, decode runs' steps back to back, releases.

TargetServicer (target_worker/server.py) drives these through one of two engine sides, alike to it:
- EngineThread: the engine on a thread of the gRPC process (the default);
- EngineProcess (target_worker/engine_process.py): the engine in a process of its own (`target.engine_process`).

Runs stepping on the engine hand back between steps when the gRPC side needs the engine (a call waits, a release
waits, a run was withdrawn). They learn it from Signals, counters the gRPC side keeps in shared memory, so an
engine process reads them as a thread does.

    signals = Signals()
    side = EngineThread(engine, world_size=1, signals=signals)
    answers = await side.verify_batch(worker_pb2.VerifyBatch(requests=[...]), inline=True)
"""
from __future__ import annotations

import time
from multiprocessing.sharedctypes import RawArray

from protos.specpool.v1 import worker_pb2
from engine.batching import only_answer
from engine.worker_server import EngineRunner, timed
from target_worker.tensor_parallel import RELEASE, VERIFY_BATCH, lead

class Signals:
    """Counters the gRPC side writes and the engine's loops read between steps: calls waiting in the Batcher,
    releases waiting, decode runs in progress, runs withdrawn so far. A RawArray, so that an engine process
    shares them (handed to it when it starts); one writer, so no lock."""

    def __init__(self, shared=None):
        self.shared = shared if shared is not None else RawArray("q", 4)

    waiting, releasing, runs, withdrawn = (property(lambda self, i=i: self.shared[i],
                                                    lambda self, n, i=i: self.shared.__setitem__(i, n))
                                           for i in range(4))

    @property
    def alone(self) -> bool:
        """Whether one decode run is all the worker has to do."""
        return self.runs == 1 and not self.waiting


def advanced(run, response, started: float, queued: int) -> Exception | None:
    """A step of EngineSteps.together taken by its run (None), or the exception its row raised or its run met (that
    run's failure, not its neighbours')."""
    if isinstance(response, Exception):
        return response
    response.queue_depth = queued
    try:
        run.advance(response, started)
    except Exception as exc:  # noqa: BLE001 - handed to this run's caller alone
        return exc
    return None


class EngineSteps:
    """The engine's calls, run where the engine is (its thread, or its process): each blocks until done."""

    def __init__(self, engine, world_size: int, signals: Signals):
        self.engine, self.world_size, self.signals = engine, world_size, signals

    def verify_batch(self, batch: worker_pb2.VerifyBatch) -> list:
        return timed(lead, self.engine, VERIFY_BATCH, batch, self.world_size)

    def release(self, request: worker_pb2.ReleaseRequest) -> worker_pb2.ReleaseResponse:
        return lead(self.engine, RELEASE, request, self.world_size)

    def together(self, runs: list, withdrawn: int) -> list:
        """Several plain runs' steps back to back, each step one batched forward of them all, with no event-loop or
        thread hop between steps, until a run ends or fails, a run is withdrawn (the withdrawals counted pass
        `withdrawn`, the count when the call was made), or another call (a release too) waits. Each row's result:
        None (its run advanced here) or the exception its row raised."""
        while True:
            started = time.perf_counter()
            responses = self.verify_batch(worker_pb2.VerifyBatch(requests=[run.request for run in runs]))
            queued = max(self.signals.waiting - len(runs), 0)                    # as the Batcher stamps it
            results = [advanced(run, response, started, queued) for run, response in zip(runs, responses)]
            if any(results) or any(run.last is not None for run in runs) or self.signals.withdrawn != withdrawn \
                    or self.signals.waiting > len(runs) or self.signals.releasing:
                return results

    def alone(self, run, withdrawn: int) -> None:
        """One run's steps back to back until it ends, a run is withdrawn (as in together) or another call waits."""
        while run.last is None and self.signals.withdrawn == withdrawn and self.signals.alone:
            started = time.perf_counter()
            batch = worker_pb2.VerifyBatch(requests=[run.request])
            run.advance(only_answer(self.verify_batch(batch)), started)


class EngineThread:
    """The engine on a dedicated thread of the gRPC process (engine.worker_server.EngineRunner): a call finding it
    idle may run inline on the event loop instead (`inline_max_s`)."""

    def __init__(self, engine, world_size: int, signals: Signals, inline_max_s: float = 0.0):
        self.steps = EngineSteps(engine, world_size, signals)
        self._runner = EngineRunner(inline_max_s)

    async def verify_batch(self, batch: worker_pb2.VerifyBatch, inline: bool = False) -> list:
        return await self._runner.run(lead, self.steps.engine, VERIFY_BATCH, batch, self.steps.world_size,
                                      inline=inline)

    async def release(self, request: worker_pb2.ReleaseRequest):
        return await self._runner.run(self.steps.release, request)

    async def together(self, runs: list) -> list:
        return await self._runner.run(self.steps.together, runs, self.steps.signals.withdrawn)

    async def alone(self, run) -> None:
        await self._runner.run(self.steps.alone, run, self.steps.signals.withdrawn)
