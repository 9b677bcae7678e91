"""What a worker call costs beyond the engine's compute, against how long the engine computes.

The real TargetServicer and the router's TargetClient, in two processes on loopback, with a stand-in engine that
answers after `ms` milliseconds of sleeping (the CPU idle), spinning in Python (the GIL held) or running small
matmuls (torch). A call's wall time minus that compute is what the benchmark's round breakdown calls the worker
side (queue, thread hop) plus transport; if it grows with `ms` even while the worker sleeps, the growth is the
machine waking idle threads and processes, not gRPC or specpool's own work.

    python -m benchmarks.call_floor
"""
from __future__ import annotations

import asyncio
import multiprocessing
import statistics
import time

KINDS = ("sleep", "spin", "torch")
COMPUTE_MS = (0.0, 3.0, 15.0)


class StandInEngine:
    """A target engine whose every batch takes `ms` of the given kind of work and accepts all drafts."""

    def __init__(self, ms: float, kind: str):
        from engine.batching import BatchStats
        self.stats, self.ms, self.kind = BatchStats(), ms, kind

    def _work(self) -> None:
        end = time.perf_counter() + self.ms / 1e3
        if self.kind == "sleep":
            time.sleep(self.ms / 1e3)
        elif self.kind == "spin":
            while time.perf_counter() < end:
                pass
        else:
            import torch
            w, x = torch.randn(256, 256), torch.randn(8, 256)
            while time.perf_counter() < end:
                x = torch.tanh(x @ w)

    def verify_batch(self, requests: list, gone=None) -> list:
        from protos.specpool.v1 import worker_pb2
        self._work()
        return [worker_pb2.VerifyResponse(num_accepted=len(r.draft_token_ids), next_token_id=7) for r in requests]

    def release(self, session_id: int) -> bool:
        return True


def serve(queue, ms: float, kind: str) -> None:
    """The worker process: a TargetServicer over the stand-in engine (no inline calls: every call hops threads,
    as a long one does)."""
    async def main():
        import torch
        torch.set_num_threads(1)
        from engine.worker_server import start_server
        from protos.specpool.v1 import worker_pb2_grpc
        from target_worker.server import TargetServicer
        server, address = await start_server(worker_pb2_grpc.add_TargetWorkerServicer_to_server,
                                             TargetServicer(StandInEngine(ms, kind), 1, 16, 0, 0.0), "127.0.0.1")
        queue.put(address)
        await server.wait_for_termination()
    asyncio.run(main())


async def calls(address: str, n: int) -> tuple[float, float]:
    """Median ms beyond compute per call, and of that the worker side (handler time beyond compute)."""
    from protos.specpool.v1 import generation_pb2
    from router.worker_client import TargetClient
    target, sampling = TargetClient(address), generation_pb2.SamplingParams(top_p=1.0, seed=1)
    tokens, beyond, worker = list(range(20)), [], []
    for _ in range(n):
        started = time.perf_counter()
        verdict, _ = await target.verify(1, tokens, len(tokens) - 1, [5, 6, 7, 8], b"", sampling, 30.0)
        beyond.append(time.perf_counter() - started - verdict.compute_us / 1e6)
        worker.append((verdict.handler_us - verdict.compute_us) / 1e6)
        tokens.append(7)
    await target.close()
    return 1e3 * statistics.median(beyond[n // 10:]), 1e3 * statistics.median(worker[n // 10:])


async def measure(context) -> None:
    """Every (kind, compute) row, each against a fresh worker process, on one event loop (gRPC's poller stays with
    the loop it started on)."""
    print("| engine | compute ms | beyond compute ms | of which worker side ms |\n|---|---|---|---|")
    for kind in KINDS:
        for ms in COMPUTE_MS:
            queue = context.Queue()
            worker = context.Process(target=serve, args=(queue, ms, kind), daemon=True)
            worker.start()
            beyond, side = await calls(await asyncio.to_thread(queue.get), 300 if ms < 10 else 120)
            print(f"| {kind} | {ms:.0f} | {beyond:.2f} | {side:.2f} |", flush=True)
            worker.kill()
            worker.join()


def main() -> None:
    asyncio.run(measure(multiprocessing.get_context("spawn")))


if __name__ == "__main__":
    main()
