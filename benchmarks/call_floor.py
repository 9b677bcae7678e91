"""What a worker call costs beyond the engine's compute, against how long the engine computes.

The real TargetServicer and the router's TargetClient, in two processes on loopback, with a stand-in engine that
answers after `ms` milliseconds of sleeping (the CPU idle), spinning in Python (the GIL held) or running small
matmuls (torch). A call's wall time minus that compute is what the benchmark's round breakdown calls the worker
side (queue, thread hop) plus transport; if it grows with `ms` even while the worker sleeps, the growth is the
machine waking idle threads and processes, not gRPC or specpool's own work.

A second table takes a call with no compute apart by layer, each layer a server of its own, the layers' repeats
interleaved: gRPC alone (a bytes echo on one bidirectional stream), then the router's CallStream with the worker's
protobufs against a bare VerifyStream, then the worker's call dispatch (serve_stream), then the whole
TargetServicer (batcher, verdicts kept for staged calls) with the engine called inline, then with the hop to the
engine thread. Its first row is the floor that no gRPC call of this machine's goes under.

    python -m benchmarks.call_floor
"""
from __future__ import annotations

import asyncio
import multiprocessing
import statistics
import time

import grpc

KINDS = ("sleep", "spin", "torch")
COMPUTE_MS = (0.0, 3.0, 15.0)
LAYERS = ("gRPC alone: a bytes echo on one stream", "+ CallStream and protobufs: a bare VerifyStream",
          "+ the worker's call dispatch (serve_stream)", "+ TargetServicer, engine called inline",
          "+ the hop to the engine thread")
ECHO = "/specpool.bench.Echo/Echo"


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


def layer_servicer(layer: int, ms: float, kind: str):
    """The TargetWorker servicer of LAYERS[layer] (layer 0 is served by echo_server instead)."""
    from engine.worker_server import serve_stream
    from protos.specpool.v1 import worker_pb2, worker_pb2_grpc
    from target_worker.server import TargetServicer

    def verdict(request, call_id: int = 0):
        return worker_pb2.VerifyResponse(call_id=call_id, num_accepted=len(request.draft_token_ids), next_token_id=7)

    async def submit(request, emit):
        return verdict(request)

    class Bare(worker_pb2_grpc.TargetWorkerServicer):
        async def VerifyStream(self, requests, context):
            if layer == 1:
                async for request in requests:
                    yield verdict(request, request.call_id)
            else:
                async for response in serve_stream(requests, submit, worker_pb2.VerifyResponse):
                    yield response
    if layer < 3:
        return Bare()
    return TargetServicer(StandInEngine(ms, kind), 1, 16, 0, 1.0 if layer == 3 else 0.0)


def echo_server(wait_s: float = 0.0) -> grpc.aio.Server:
    """A grpc.aio server whose one method echoes each message of a bidirectional stream (after waiting `wait_s` on
    a thread, as a worker's engine thread computes; benchmarks.idle_wake)."""
    async def echo(requests, context):
        async for message in requests:
            if wait_s:
                await asyncio.to_thread(time.sleep, wait_s)
            yield message
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "specpool.bench.Echo", {"Echo": grpc.stream_stream_rpc_method_handler(echo)}),))
    return server


def serve(queue, ms: float, kind: str, layer: int = len(LAYERS) - 1) -> None:
    """The worker process: the servicer of LAYERS[layer]; by default a TargetServicer over the stand-in engine
    with no inline calls (every call hops threads, as a long one does)."""
    async def main():
        import torch
        torch.set_num_threads(1)
        from engine.worker_server import start_server
        from protos.specpool.v1 import worker_pb2_grpc
        if layer == 0:
            server = echo_server()
            address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
            await server.start()
        else:
            server, address = await start_server(worker_pb2_grpc.add_TargetWorkerServicer_to_server,
                                                 layer_servicer(layer, ms, kind), "127.0.0.1")
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


async def echoes(address: str, n: int) -> float:
    """Median ms of a 64-byte message's round trip on one grpc.aio bidirectional stream."""
    async with grpc.aio.insecure_channel(address) as channel:
        call, times = channel.stream_stream(ECHO)(), []
        for _ in range(n):
            started = time.perf_counter()
            await call.write(b"x" * 64)
            await call.read()
            times.append(time.perf_counter() - started)
        await call.done_writing()
    return 1e3 * statistics.median(times[n // 10:])


async def layer_call(context, layer: int, n: int = 1000) -> float:
    """Median ms of a call with no compute, against a fresh worker process serving LAYERS[layer]."""
    queue = context.Queue()
    worker = context.Process(target=serve, args=(queue, 0.0, "sleep", layer), daemon=True)
    worker.start()
    try:
        address = await asyncio.to_thread(queue.get)
        return await echoes(address, n) if layer == 0 else (await calls(address, n))[0]
    finally:
        worker.kill()
        worker.join()


async def by_layer(context, repeats: int = 3) -> None:
    """The LAYERS table: medians over `repeats` interleaved passes, each layer's cost over the one above it."""
    times: list[list[float]] = [[] for _ in LAYERS]
    for repeat in range(repeats):
        for layer in range(len(LAYERS)):
            times[layer].append(await layer_call(context, layer))
        print(f"  (layers, repeat {repeat + 1} of {repeats} done)", flush=True)
    medians = [statistics.median(t) for t in times]
    print("\n| layer (0 ms of compute) | ms per call | added ms |\n|---|---|---|")
    for name, ms, above in zip(LAYERS, medians, [0.0] + medians):
        print(f"| {name} | {ms:.2f} | {ms - above:+.2f} |", flush=True)


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


async def both(context) -> None:
    await measure(context)
    await by_layer(context)


def main() -> None:
    asyncio.run(both(multiprocessing.get_context("spawn")))


if __name__ == "__main__":
    main()
