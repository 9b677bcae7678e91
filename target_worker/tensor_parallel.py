"""The target's tensor-parallel group: one process per rank, sharded by transformers' own TP plan.

Rank 0 serves gRPC. Before it runs a call on its engine (a whole batch of verify calls, or a release)
it broadcasts the serialized request (protobuf bytes, never pickle) over a gloo control group, and ranks 1..N-1 run the same call on
their shard in the same order, so the model's collectives line up and every rank's KV caches
stay identical. Only rank 0's result goes back to the router.
"""
from __future__ import annotations

import os
import threading

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from protos.specpool.v1 import worker_pb2
from engine.sessions import SessionLost

VERIFY_BATCH, RELEASE = 1, 2
_REQUEST_TYPES = {VERIFY_BATCH: worker_pb2.VerifyBatch, RELEASE: worker_pb2.ReleaseRequest}
_control_group = None


def host_store(host: str):
    """The group's rendezvous store, bound by rank 0 to a port the OS picks and held until the group forms, so no
    other process can take the port between choosing it and binding it. Its `.port` goes to the other ranks."""
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=default_pg_timeout)


def init_group(rank: int, world_size: int, master_addr: str, master_port: int, device: str, store=None) -> None:
    """Join the TP process group (NCCL on CUDA, gloo on CPU) plus a gloo group for control messages. `store`: the
    one host_store() bound, on the rank that holds it; every other rank connects to (master_addr, master_port)."""
    global _control_group
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0",
                      MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
    if store is None:
        store = dist.TCPStore(master_addr, master_port, is_master=False, timeout=default_pg_timeout)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    _control_group = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD


def _broadcast(kind: int, payload: bytes) -> None:
    header = torch.tensor([kind, len(payload)], dtype=torch.int64)
    dist.broadcast(header, src=0, group=_control_group)
    dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=_control_group)


def _receive() -> tuple[int, bytes]:
    header = torch.empty(2, dtype=torch.int64)
    dist.broadcast(header, src=0, group=_control_group)
    body = torch.empty(int(header[1]), dtype=torch.uint8)
    dist.broadcast(body, src=0, group=_control_group)
    return int(header[0]), body.numpy().tobytes()


def _run(engine, kind: int, request):
    if kind == VERIFY_BATCH:
        return engine.verify_batch(list(request.requests))
    engine.release(request.session_id)
    return worker_pb2.ReleaseResponse()


def lead(engine, kind: int, request, world_size: int):
    """Rank 0: have every rank run this call, then run it here and return the result. A collective
    that fails means a peer is gone: exit, so that Ray restarts this rank too."""
    if world_size == 1:
        return _run(engine, kind, request)
    try:
        _broadcast(kind, request.SerializeToString())
        return _run(engine, kind, request)
    except (SessionLost, ValueError):
        raise
    except Exception as exc:  # noqa: BLE001 - a broken collective: leave no half-alive group
        print(f"[specpool] target rank 0 lost its group ({exc!r}); exiting", flush=True)
        os._exit(1)


def follow(engine) -> None:
    """Ranks 1..N-1: run rank 0's calls forever. If the group breaks (a peer died), exit the
    process so that Ray restarts the whole rank instead of leaving a half-alive group."""
    try:
        while True:
            kind, payload = _receive()
            request = _REQUEST_TYPES[kind].FromString(payload)
            try:
                _run(engine, kind, request)
            except (SessionLost, ValueError):
                pass                      # rank 0 hits the same error and reports it
    except Exception as exc:              # noqa: BLE001 - any collective failure ends this rank
        print(f"[specpool] target rank lost its group ({exc!r}); exiting", flush=True)
        os._exit(1)


def start_follower(engine) -> threading.Thread:
    thread = threading.Thread(target=follow, args=(engine,), name="tp-follower", daemon=True)
    thread.start()
    return thread
