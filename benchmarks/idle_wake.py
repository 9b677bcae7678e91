"""What a wait costs the code that runs after it: why a call's cost beyond compute grows with the compute's length.

`benchmarks.call_floor` found that a worker call costs more beyond compute the longer the worker computes, even
while it sleeps. This takes that apart with no specpool code at all, in two tables:

1. A fixed piece of Python (a 2,000-step loop) timed back to back, and right after sleeping 0.5–50 ms.
2. A 64-byte round trip, beyond the server's own wait, for bare asyncio TCP and for bare grpc.aio (one
   bidirectional stream), the server waiting 0, 3 or 15 ms on a thread before it answers, as a worker's engine
   thread does.

Each runs twice: as is, and with /dev/cpu_dma_latency held at 0 (Linux PM QoS: an idle CPU polls instead of
halting, so a wake-up costs no exit from halt). That needs root; without it the second run is skipped, saying so.
If the cost after a wait stays with idle polling, it is not the halt but the code after the wait running slower
(cold caches and branch predictors, the host's scheduling of this virtual CPU): the machine's, not specpool's. On
the project's 2-vCPU guest the loop's back-to-back time also swings between about 55 and 110 µs from minute to
minute, so read the loop table's columns within one run, as trends (benchmarks/STUDIES.md, session 46).

    python -m benchmarks.idle_wake              # about 2 minutes here
"""
from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import statistics
import struct
import time

from benchmarks.call_floor import echo_server, echoes

IDLE_MS = (0.0, 0.5, 3.0, 15.0, 50.0)
WAIT_MS = (0.0, 3.0, 15.0)
LOOP_STEPS = 2000


@contextlib.contextmanager
def idle_polling(on: bool):
    """/dev/cpu_dma_latency held at 0 while inside, if `on` (PermissionError without root)."""
    if not on:
        yield
        return
    fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY)
    try:
        os.write(fd, struct.pack("i", 0))
        yield
    finally:
        os.close(fd)


def loop_us(idle_ms: float, n: int = 200) -> float:
    """Median µs of LOOP_STEPS Python steps, each run right after sleeping `idle_ms`."""
    times = []
    for _ in range(n):
        if idle_ms:
            time.sleep(idle_ms / 1e3)
        started, total = time.perf_counter(), 0
        for step in range(LOOP_STEPS):
            total += step
        times.append(time.perf_counter() - started)
    return 1e6 * statistics.median(times)


def tcp_server(queue, wait_s: float) -> None:
    async def handle(reader, writer):
        while data := await reader.readexactly(64):
            if wait_s:
                await asyncio.to_thread(time.sleep, wait_s)
            writer.write(data)
            await writer.drain()

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        queue.put(f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
        await server.serve_forever()
    asyncio.run(main())


def grpc_server(queue, wait_s: float) -> None:
    async def main():
        server = echo_server(wait_s)
        queue.put(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        await server.start()
        await server.wait_for_termination()
    asyncio.run(main())


async def tcp_echoes(address: str, n: int) -> float:
    """Median ms of a 64-byte message's round trip on one asyncio TCP connection (call_floor.echoes' twin)."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    times = []
    for _ in range(n):
        started = time.perf_counter()
        writer.write(b"x" * 64)
        await writer.drain()
        await reader.readexactly(64)
        times.append(time.perf_counter() - started)
    writer.close()
    return 1e3 * statistics.median(times[n // 10:])


async def trip_ms(context, server, echoes_ms, wait_ms: float) -> float:
    """Median ms of a round trip beyond the server's wait, against a fresh server process."""
    queue, n = context.Queue(), 400 if wait_ms < 10 else 150
    process = context.Process(target=server, args=(queue, wait_ms / 1e3), daemon=True)
    process.start()
    try:
        return await echoes_ms(await asyncio.to_thread(queue.get), n) - wait_ms
    finally:
        process.kill()
        process.join()


def polling_permitted() -> bool:
    try:
        os.close(os.open("/dev/cpu_dma_latency", os.O_WRONLY))
        return True
    except OSError as exc:
        print(f"(idle polling skipped: /dev/cpu_dma_latency needs root: {exc})", flush=True)
        return False


async def tables(context, modes: dict, repeats: int) -> tuple[dict, dict]:
    """({(mode, idle_ms): loop µs}, {(mode, transport, wait_ms): round trip ms beyond the wait}): medians over
    `repeats` passes, each pass every mode and row in turn, so the machine's drift falls on all alike."""
    loop_us(0.0)                                                   # warm-up
    loops: dict = {}
    trips: dict = {}
    for _ in range(repeats):
        for mode, polling in modes.items():
            with idle_polling(polling):
                for idle in IDLE_MS:
                    loops.setdefault((mode, idle), []).append(loop_us(idle, 100))
                for name, server, echoes_ms in (("asyncio TCP", tcp_server, tcp_echoes),
                                                ("grpc.aio", grpc_server, echoes)):
                    for wait_ms in WAIT_MS:
                        trips.setdefault((mode, name, wait_ms), []).append(
                            await trip_ms(context, server, echoes_ms, wait_ms))
    return ({key: statistics.median(v) for key, v in loops.items()},
            {key: statistics.median(v) for key, v in trips.items()})


def main(repeats: int = 3) -> None:
    modes = {"as is": False, **({"idle polling": True} if polling_permitted() else {})}
    loops, trips = asyncio.run(tables(multiprocessing.get_context("spawn"), modes, repeats))
    print("\n| Python loop after | " + " | ".join(f"{mode} µs" for mode in modes) + " |\n|---"
          + "|---" * len(modes) + "|")
    for idle in IDLE_MS:
        print(f"| {'back to back' if not idle else f'{idle:g} ms asleep'} | "
              + " | ".join(f"{loops[mode, idle]:.0f}" for mode in modes) + " |")
    print("\n| round trip, server waits | " + " | ".join(f"{mode} ms beyond the wait" for mode in modes)
          + " |\n|---" + "|---" * len(modes) + "|")
    for name in ("asyncio TCP", "grpc.aio"):
        for wait_ms in WAIT_MS:
            print(f"| {name}, {wait_ms:g} ms | "
                  + " | ".join(f"{trips[mode, name, wait_ms]:.2f}" for mode in modes) + " |")


if __name__ == "__main__":
    main()
