"""Soak: N concurrent greedy streams for several minutes while a killer actor SIGKILLs a random
worker (draft or target rank) at an interval. Reports requests completed, failed by status,
outputs identical to a fault-free reference, and recovery times (longest stall of a stream).

    python -m benchmarks.soak --streams 4 --minutes 3 --kill-every 20 --out benchmarks/results
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import grpc
import ray
import yaml

from benchmarks.service import log, running
from router.launch import disconnect
from protos.specpool.v1 import generation_pb2

PROMPTS = [[3, 14, 15, 92], [65, 35, 89], [79, 32, 38, 46, 26], [43, 38, 32, 79, 50, 28]]


@dataclass
class SoakConfig:
    config: str = "deploy/local.yaml"
    out: str = "benchmarks/results"
    streams: int = 4
    minutes: float = 3.0
    kill_every: float = 20.0
    max_new_tokens: int = 64
    seed: int = 0


@ray.remote(num_cpus=0, max_concurrency=2)   # stop() must run while run() sleeps
class Killer:
    """Kills one random worker process every `interval` seconds, by PID; records when."""

    def __init__(self, workers: list, interval: float, seed: int):
        self._workers, self._interval, self._rng = workers, interval, random.Random(seed)
        self._stop, self.kills = False, []

    def run(self) -> list:
        while not self._stop:
            time.sleep(self._interval)
            if self._stop:
                break
            name, actor = self._rng.choice(self._workers)
            try:
                os.kill(ray.get(actor.pid.remote(), timeout=60), signal.SIGKILL)
                self.kills.append((time.time(), name))
            except Exception as exc:  # noqa: BLE001 - a worker still restarting: skip this turn
                self.kills.append((time.time(), f"{name} (skipped: {type(exc).__name__})"))
        return self.kills

    def stop(self) -> None:
        self._stop = True


def request_for(prompt: list[int], max_new: int) -> generation_pb2.GenerateRequest:
    request = generation_pb2.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=max_new)
    request.speculation.k = 3
    return request


def stream(stub, prompt, max_new) -> tuple[str, list[int], float]:
    """(status, tokens, longest gap between chunks in seconds)."""
    tokens, last, stall = [], time.monotonic(), 0.0
    try:
        for chunk in stub.GenerateStream(request_for(prompt, max_new), timeout=300):
            now = time.monotonic()
            stall, last = max(stall, now - last), now
            tokens += chunk.token_ids
        return "OK", tokens, stall
    except grpc.RpcError as exc:
        return exc.code().name, tokens, stall


def client_loop(stub, cfg: SoakConfig, deadline: float, index: int, results: list) -> None:
    i = index
    while time.monotonic() < deadline:
        prompt = PROMPTS[i % len(PROMPTS)]
        results.append((tuple(prompt), *stream(stub, prompt, cfg.max_new_tokens)))
        i += 1


def run(cfg: SoakConfig) -> dict:
    """The soak against a fresh specpool from the YAML at cfg.config (on any free port), summarized."""
    with running(cfg.config) as service:
        stub, pools = service.stub, service.service.pools
        reference = {tuple(p): list(stub.Generate(request_for(p, cfg.max_new_tokens)).token_ids) for p in PROMPTS}
        workers = [("draft", a) for a in pools.draft_actors] + [
            (f"target rank {r}", a) for ranks in pools.target_actors for r, a in enumerate(ranks)]
        killer = Killer.remote(workers, cfg.kill_every, cfg.seed)
        kills_ref = killer.run.remote()
        try:
            results = streams_until(stub, cfg, time.monotonic() + cfg.minutes * 60)
        finally:
            ray.get(killer.stop.remote())
        kills = ray.get(kills_ref)
    return summarize(results, reference, kills)


def streams_until(stub, cfg: SoakConfig, deadline: float) -> list:
    """cfg.streams client loops on threads until `deadline`: (prompt, status, tokens, stall) per request."""
    results = []
    threads = [threading.Thread(target=client_loop, args=(stub, cfg, deadline, i, results))
               for i in range(cfg.streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def summarize(results, reference, kills) -> dict:
    statuses = Counter(status for _, status, _, _ in results)
    ok = [(p, t, s) for p, status, t, s in results if status == "OK"]
    stalls = sorted(s for _, _, s in ok)
    return {"requests": len(results), "by_status": dict(statuses),
            "identical_to_reference": sum(t == reference[p] for p, t, _ in ok), "ok": len(ok),
            "kills": [name for _, name in kills],
            "stall_s": {"median": statistics.median(stalls) if stalls else 0.0,
                        "p99": stalls[int(0.99 * (len(stalls) - 1))] if stalls else 0.0,
                        "max": stalls[-1] if stalls else 0.0}}


def parse_args(argv: list[str] | None = None) -> SoakConfig:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in vars(SoakConfig()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    return SoakConfig(**vars(parser.parse_args(argv)))


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    log(f"soak: {cfg.streams} streams for {cfg.minutes} min, a kill every {cfg.kill_every}s")
    try:
        summary = run(cfg)
    finally:
        disconnect()        # the local Ray instance the service started, with its agents
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(summary, indent=2))
    print(yaml.safe_dump(summary, sort_keys=False))


if __name__ == "__main__":
    main()
