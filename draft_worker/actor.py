"""Ray actor for one draft replica: loads the draft model and serves specpool.v1.DraftWorker.

Module import pulls in no torch; the model loads inside the actor's own process.
"""
from __future__ import annotations

import asyncio
import os
import time

from engine.actor import EngineActor


def _build_engine(config: dict):
    import torch

    from draft_worker.proposer import DraftEngine
    from engine.model_pair import resolve_model
    from engine.pinning import pin_worker

    threads = pin_worker(config, "draft")
    if threads:
        torch.set_num_threads(threads)
    model = resolve_model(config["model"])
    started = time.monotonic()
    print(f"[specpool] draft: loading {model} ({config['dtype']}, {config['device']}) ...", flush=True)
    engine = DraftEngine(model, config["dtype"], config["device"], config["max_sessions"],
                         config["prefix_cache_tokens"], config["prefill_chunk_tokens"])
    print(f"[specpool] draft: loaded in {time.monotonic() - started:.1f}s", flush=True)
    return engine


class DraftWorker(EngineActor):
    """One draft replica. `start()` loads the model and returns {"address", "pid", "cpus"}."""

    def __init__(self, config: dict, tls: dict | None = None):
        self._config = config
        self._tls = tls or {}
        self._server = None
        self._engine = None
        self._info: dict = {}

    async def start(self, host: str | None = None) -> dict:
        """Load the model and serve; idempotent (a restarted actor is started again by the router)."""
        if self._server is not None:
            return self._info
        import ray

        from draft_worker.server import DraftServicer
        from protos.specpool.v1 import worker_pb2_grpc
        from settings.schema import TlsConfig
        from engine.worker_server import MESSAGE_OPTIONS, start_server
        from settings.tls import worker_channel, worker_server_credentials

        self._engine = await asyncio.to_thread(_build_engine, self._config)
        host = host or ray.util.get_node_ip_address()
        tls = TlsConfig(**self._tls)
        self._server, address = await start_server(
            worker_pb2_grpc.add_DraftWorkerServicer_to_server, DraftServicer(
                self._engine, self._config["max_batch_size"], self._config["batch_wait_ms"] / 1000,
                self._config["inline_ms"] / 1000,
                channel=lambda target: worker_channel(target, tls, MESSAGE_OPTIONS)), host,   # handoffs' channels
            credentials=worker_server_credentials(tls))
        self._info = {"address": address, "pid": os.getpid(), "cpus": self.cpus()}
        self._settle()
        return self._info
