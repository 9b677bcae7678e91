"""How long huge prompts stall everyone else (#12): one stream runs while `--senders` clients each send a
3.9 MB text prompt, and a health check with a 1 s deadline goes out meanwhile. Prints the stream's longest
and median gap between chunks and what the health check got.

    python -m benchmarks.prompt_stall --config deploy/local.yaml
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.service import log, running
from protos.specpool.v1 import generation_pb2
from router.launch import disconnect


def stream_gaps(stub, max_new: int) -> list[float]:
    request = generation_pb2.GenerateRequest(prompt="def main(", max_new_tokens=max_new)
    request.speculation.k = 1
    gaps, last = [], time.monotonic()
    for _ in stub.GenerateStream(request, timeout=300):
        now = time.monotonic()
        gaps.append(now - last)
        last = now
    return gaps[1:]                       # the first gap is the time to first token


def send_huge(stub, chars: int) -> str:
    try:
        stub.Generate(generation_pb2.GenerateRequest(prompt="x" * chars, max_new_tokens=4), timeout=60)
        return "OK"
    except grpc.RpcError as exc:
        return f"{exc.code().name}: {exc.details()[:60]}"


def health_check(channel) -> str:
    started = time.monotonic()
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
        return f"SERVING in {(time.monotonic() - started) * 1000:.0f} ms"
    except grpc.RpcError as exc:
        return f"{exc.code().name} after {(time.monotonic() - started) * 1000:.0f} ms"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="deploy/local.yaml")
    parser.add_argument("--senders", type=int, default=3)
    parser.add_argument("--chars", type=int, default=3_900_000)
    parser.add_argument("--max-new-tokens", type=int, default=600)
    args = parser.parse_args(argv)
    try:
        with running(args.config) as service:
            result = {}
            streamer = threading.Thread(target=lambda: result.setdefault(
                "gaps", stream_gaps(service.stub, args.max_new_tokens)))
            streamer.start()
            time.sleep(1.0)
            senders = [threading.Thread(target=lambda: log(send_huge(service.stub, args.chars)))
                       for _ in range(args.senders)]
            for sender in senders:
                sender.start()
            health = health_check(service.channel)
            for thread in senders + [streamer]:
                thread.join()
            gaps = result["gaps"]
            print(f"stream of {len(gaps) + 1} chunks beside {args.senders} prompts of {args.chars} characters: "
                  f"longest gap {max(gaps) * 1000:.0f} ms, median {statistics.median(gaps) * 1000:.1f} ms; "
                  f"health check (1 s deadline): {health}", flush=True)
    finally:
        disconnect()


if __name__ == "__main__":
    main()
