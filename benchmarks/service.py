"""A specpool to measure, and the client that measures it: the service runs in this process on a background
event loop (as the tests run it); timed requests come from a separate client process, as real clients do, so
that client threads never compete with the router for this process's GIL.

    with running("deploy/local.yaml", batching=True) as service:     # any free port
        run = service.client(stream_one, "def main(", 32, None)      # None: the adaptive K policy
        print(run["tokens"] / run["seconds"], "tokens/s")

(`python -m benchmarks.speedup` and `python -m benchmarks.soak` run it this way.)
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import grpc
import yaml

from benchmarks.plan import PREDICTABLE
from protos.specpool.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc
from settings.schema import config_from_dict, read_yaml, with_model_paths_from


def log(message: str) -> None:
    print(f"[bench] {message}", flush=True)


def load_service_config(path: str | os.PathLike) -> dict:
    """The YAML at `path` as a dict, relative model paths read from the YAML's folder (as load_config does)."""
    return with_model_paths_from(read_yaml(path) or {}, Path(path).parent)


def bench_request(prompt: str, max_new: int, k: int | None, temperature: float,
                  prediction: str = "") -> generation_pb2.GenerateRequest:
    """A benchmark request: greedy, or seeded sampling at `temperature`; K = k (None: the adaptive policy); with
    the output predicted (GenerateRequest.prediction), if given."""
    request = generation_pb2.GenerateRequest(prompt=prompt, max_new_tokens=max_new, prediction=prediction)
    request.sampling.temperature = temperature
    if temperature:
        request.sampling.seed = 1
    if k is not None:
        request.speculation.k = k
    return request


def stats_fields(stats: generation_pb2.GenerationStats) -> dict:
    """A request's stats as stream_one and whole_one report them."""
    return {"draft": stats.draft_tokens, "accepted": stats.accepted_tokens, "rounds": stats.target_passes,
            "wire": stats.wire_bytes, "predraft_hits": stats.predraft_hits, "staged": stats.staged_rounds,
            "sources": list(stats.source_per_round),
            "k_per_round": list(stats.k_per_round), "cached_prompt_tokens": stats.cached_prompt_tokens,
            "accepted_prediction": stats.accepted_prediction_tokens,
            "prediction_dropped": int(stats.prediction_dropped_at > 0)}


def round_record(round_) -> dict:
    """One Round as plain data."""
    return {"k": round_.k, "accepted": round_.accepted, "source": round_.source, "predrafted": round_.predrafted,
            "predraft_sent": round_.predraft_sent, "timings": dataclasses.asdict(round_.timings),
            "wall": sum(round_.parts.values()), "parts": dict(round_.parts)}


@contextlib.contextmanager
def recorded(selector):
    """While inside, every round `selector` (the router's KSelector) observes is appended, as round_record gives it,
    to the list this yields; each decode-run step is a round of its own (K = 0, or its looked-up drafts)."""
    rounds: list = []
    observe = selector.observe

    def observe_and_record(state, round_):
        rounds.append(round_record(round_))
        observe(state, round_)
    selector.observe = observe_and_record
    try:
        yield rounds
    finally:
        selector.observe = observe


def stream_one(stub, prompt: str, max_new: int, k: int | None, temperature: float = 0.0, prediction: str = "") -> dict:
    """One GenerateStream request (k None: the adaptive policy), timed per chunk: seconds, tokens, time to
    first token, inter-token gaps (a chunk's gap shared by its tokens), the client's waits between chunks, the
    request's stats."""
    started, arrivals, chunks = time.perf_counter(), [], []
    for chunk in stub.GenerateStream(bench_request(prompt, max_new, k, temperature, prediction)):
        arrivals.append(time.perf_counter())
        chunks.append(chunk)
    gaps = [(b - a) / len(c.token_ids) for a, b, c in zip(arrivals, arrivals[1:], chunks[1:]) for _ in c.token_ids]
    return {"seconds": arrivals[-1] - started, "tokens": sum(len(c.token_ids) for c in chunks),
            "ttft": arrivals[0] - started, "itl": gaps, "waits": [b - a for a, b in zip(arrivals, arrivals[1:])],
            **stats_fields(chunks[-1].stats)}


def whole_one(stub, prompt: str, max_new: int, k: int | None, temperature: float = 0.0) -> dict:
    """stream_one's figures for a unary Generate request (the output read whole, as generate() returns it): no
    time to first token or inter-token gaps, one chunk."""
    started = time.perf_counter()
    response = stub.Generate(bench_request(prompt, max_new, k, temperature))
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "tokens": len(response.token_ids), "ttft": seconds, "itl": [], "waits": [],
            **stats_fields(response.stats)}


_STUBS: dict = {}


def client_call(address: str, fn, *args):
    """fn(stub, *args) in the client process, over one channel per address."""
    if address not in _STUBS:
        _STUBS[address] = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(address))
    return fn(_STUBS[address], *args)


class LoopThread:
    """An event loop on a daemon thread, beside the caller's (the service runs on it as `specpool serve` runs it
    on its own). close() ends it in order: the tasks still pending are cancelled and awaited, then the loop
    stops and is closed. A loop left running, or stopped with grpc.aio calls pending, goes on sharing gRPC's
    completion queue with every later loop of the process, so its leftovers would meet a later test's."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="service-loop", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float | None = None):
        """Run `coro` on the loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self, timeout: float = 10.0, close_loop: bool = True) -> None:
        """close_loop=False stops the loop but leaves it (and its default executor's threads) open. A local Ray
        instance started from one of those threads (ray.init under asyncio.to_thread) went down when the loop
        was closed (seen: the next service in the process could not reach Ray's GCS; Ray's processes end with
        the thread that spawned them), and a benchmark's next service reuses that instance."""
        try:
            self.run(_cancel_pending(), timeout)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout)
        if close_loop and not self.thread.is_alive():
            self.loop.close()


async def _cancel_pending() -> None:
    current = asyncio.current_task()
    pending = [task for task in asyncio.all_tasks() if task is not current]
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


class InProcessService:
    """specpool serve on a background event loop, from a config dict, with its client process."""

    def __init__(self, data: dict):
        from router.service import Service
        self.data = data
        self.background = LoopThread()
        self.service = self.background.run(Service(config_from_dict(data), keep_ray=True).start())
        # measure with the draft pool in, not while it loads (serve starts serving before that)
        self.background.run(self.service.drafts_loaded())
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.service.port}")
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.admin = admin_pb2_grpc.AdminStub(self.channel)
        self.clients = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        self.client(stream_one, PREDICTABLE[0], 8, None)   # warm-up, so that no row pays for first calls

    def client(self, fn, *args):
        """fn(stub, *args) run in the client process against this service."""
        return self.clients.submit(client_call, f"127.0.0.1:{self.service.port}", fn, *args).result()

    def stop(self) -> None:
        self.clients.shutdown()
        self.channel.close()
        self.background.run(self.service.stop(1.0))
        self.background.close(close_loop=False)     # Ray stays up for the next service (see LoopThread.close)


def running(config_path: str | os.PathLike, batching: bool = True):
    """A fresh specpool from the YAML at `config_path` on any free port (batching off: max_batch_size 1 for
    the draft and the target), stopped (its actors killed) on exit; Ray stays up for the next one."""
    return running_data(load_service_config(config_path), batching, str(config_path))


def reload_section(service, section: str, **values) -> None:
    """Hot-reload `section`.<key> = value on the running service (InProcessService), as Admin.Reload would; the
    service's config dict keeps them (a later reload keeps the settings of the one before)."""
    data = service.data
    data[section] = {**(data.get(section) or {}), **values}
    service.admin.Reload(admin_pb2.ReloadRequest(config_yaml=yaml.safe_dump(data)))


@contextlib.contextmanager
def running_data(data: dict, batching: bool = True, label: str = "a config dict"):
    """As running(), from a config dict. Its gRPC (and HTTP, if on) ports are any free ones, so that a benchmark
    runs beside a `specpool serve` of the same config; Admin (GetStatus) answers on the gRPC port."""
    http = data.get("http") or {}
    data = {**data, "router": {**(data.get("router") or {}), "port": 0, "admin_port": -1},
            "http": {**http, "port": 0 if http.get("port", -1) != -1 else -1}}
    if not batching:
        data.update({pool: {**(data.get(pool) or {}), "max_batch_size": 1} for pool in ("draft", "target")})
    log(f"starting specpool from {label}, batching {'on' if batching else 'off'}")
    service = InProcessService(data)
    try:
        yield service
    finally:
        service.stop()
