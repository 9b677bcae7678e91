"""Ray actor for one rank of a target replica's tensor-parallel group.

All ranks load their shard with transformers' TP plan; rank 0 also serves specpool.v1.TargetWorker
and forwards each call to the other ranks (see tensor_parallel.py). Module import pulls in no torch.
"""
from __future__ import annotations

import asyncio
import os
import time

from engine.actor import EngineActor


def _build_engine(config: dict, draft: dict, rank: int, world_size: int, master: tuple[str, int], store=None):
    import torch

    from target_worker import tensor_parallel
    from engine.model_pair import resolve_model
    from target_worker.tp_support import check_tensor_parallel
    from target_worker.verifier import TargetEngine
    from engine.pinning import pin_worker

    threads = pin_worker(config, "target", rank, world_size)
    if threads:
        torch.set_num_threads(threads)
    model, draft_model = resolve_model(config["model"]), resolve_model(draft["model"])
    check_tensor_parallel(model, world_size)          # every rank, before the group forms: no rank waits in it
    if world_size > 1:
        tensor_parallel.init_group(rank, world_size, master[0], master[1], config["device"], store)
    started = time.monotonic()
    print(f"[specpool] target rank {rank}/{world_size}: loading {model} ({config['dtype']}, "
          f"{config['device']}) ...", flush=True)
    engine = TargetEngine(model, draft_model, config["dtype"], config["device"], draft["dtype"],
                          tp_plan="auto" if world_size > 1 else None, max_sessions=config["max_sessions"],
                          prefix_cache_tokens=config["prefix_cache_tokens"],
                          prefill_chunk_tokens=config["prefill_chunk_tokens"])
    print(f"[specpool] target rank {rank}: loaded in {time.monotonic() - started:.1f}s", flush=True)
    return engine


class TargetRank(EngineActor):
    """Rank `rank` of one target replica. Call rendezvous() on rank 0, then start() on every rank."""

    def __init__(self, config: dict, draft: dict, rank: int, world_size: int, tls: dict | None = None):
        self._config, self._draft, self._tls = config, draft, tls or {}
        self._rank, self._world_size = rank, world_size
        self._engine = None
        self._process = None                          # the engine's own process (target.engine_process)
        self._server = None
        self._store = None                            # rank 0's rendezvous store, from rendezvous() to start()

    def rendezvous(self, host: str | None = None) -> tuple[str, int]:
        """Rank 0: bind the group's store on a port the OS picks; returns the (host, port) the other ranks join."""
        import ray

        host = host or ray.util.get_node_ip_address()
        if self._world_size > 1:
            from target_worker import tensor_parallel
            self._store = tensor_parallel.host_store(host)
        return host, self._store.port if self._store else 0

    async def start(self, master: tuple[str, int], host: str | None = None) -> dict:
        import ray

        from protos.specpool.v1 import worker_pb2_grpc
        from target_worker import tensor_parallel
        from settings.schema import TlsConfig
        from engine.worker_server import start_server
        from settings.tls import worker_server_credentials
        from engine.model_pair import resolve_model
        from target_worker.server import TargetServicer

        in_process = self._config.get("engine_process") and self._world_size == 1
        engine, model, cpus = await (self._start_process(master) if in_process else self._load(master))
        info = {"pid": os.getpid(), "rank": self._rank, "cpus": cpus,
                "model_path": resolve_model(self._config["model"]), **model}
        if self._rank > 0:
            self._settle()
            tensor_parallel.start_follower(engine)
            return info
        self._server, address = await start_server(
            worker_pb2_grpc.add_TargetWorkerServicer_to_server,
            TargetServicer(engine, self._world_size, self._config["max_batch_size"],
                           self._config["batch_wait_ms"] / 1000, self._config["inline_ms"] / 1000),
            host or ray.util.get_node_ip_address(),
            credentials=worker_server_credentials(TlsConfig(**self._tls)))
        self._settle()
        return {**info, "address": address}

    async def _load(self, master: tuple[str, int]) -> tuple:
        """The engine on a thread of this process: (engine, its model_info, this process's CPUs)."""
        from engine.modeling import model_info

        self._engine = await asyncio.to_thread(
            _build_engine, self._config, self._draft, self._rank, self._world_size, master, self._store)
        return self._engine, model_info(self._engine.model), self.cpus()

    async def _start_process(self, master: tuple[str, int]) -> tuple:
        """The engine in a process of its own, pinned to this actor's CPUs; this process (gRPC) moves to the node's
        others, where there are any. A lost engine process ends this actor too, so that Ray restarts it. Returns
        (the EngineProcess, the engine's model_info, its CPUs)."""
        from target_worker.engine_process import EngineProcess
        from engine.pinning import pin_process

        self._process = EngineProcess(_build_engine, (self._config, self._draft, 0, 1, master),
                                      on_lost=lambda: os._exit(1))
        model = await self._process.started()
        engine_cpus = self._process.ask("cpus")
        others = sorted(set(self.cpus()) - set(engine_cpus))
        if others and len(engine_cpus) < len(self.cpus()):
            pin_process(others, "target.cpus")
            print(f"[specpool] target: engine process {self._process.pid} on CPU(s) "
                  f"{','.join(map(str, engine_cpus))}; gRPC on {','.join(map(str, others))}", flush=True)
        return self._process, model, engine_cpus

    def engine_pid(self) -> int:
        """The process the engine runs in: its own (target.engine_process), else this one."""
        return self._process.pid if self._process else os.getpid()

    def active_sessions(self) -> int:
        return self._process.ask("active_sessions") if self._process else super().active_sessions()

    def sessions_started(self) -> int:
        return self._process.ask("sessions_started") if self._process else super().sessions_started()

    def batch_stats(self) -> dict:
        return self._process.ask("batch_stats") if self._process else super().batch_stats()

    def gc_pauses(self) -> dict:
        return self._process.ask("gc_pauses") if self._process else super().gc_pauses()

    def cpu_seconds(self) -> float:
        """This worker's CPU seconds: the engine process's and this one's together."""
        return super().cpu_seconds() + (self._process.ask("cpu_seconds") if self._process else 0.0)
