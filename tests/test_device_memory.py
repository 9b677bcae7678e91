"""Running out of device memory is one request's failure, not the worker's (engine/device_memory.py): the call
answers RESOURCE_EXHAUSTED saying what to change, the client gets RESOURCE_EXHAUSTED with that message (counted
under it), and the worker stays in the pool, serving the next request. A draft out of memory for a request costs
its rounds their drafts, not the request. The engine's side (the row that does not fit fails alone) is in
tests/test_batching.py. A real router and public server over a fake target (tests/fake_workers.py)."""
import asyncio
import types

import grpc
import pytest
import torch

from engine.worker_server import CallFailed, engine_answer
from protos.specpool.v1 import generation_pb2
from router.drafting import draft_lost
from tests.fake_workers import plain, run


def test_an_engine_out_of_memory_answers_resource_exhausted_saying_what_to_change():
    async def call():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; 79.1 GiB total)\n"
                                     "If reserved but unallocated memory is large try setting ...")
    with pytest.raises(CallFailed) as info:
        asyncio.run(engine_answer(call()))
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.message.startswith("out of device memory for this request (CUDA out of memory. Tried to "
                                         "allocate 20.00 GiB (GPU 0; 79.1 GiB total)); fewer concurrent requests")


def test_a_request_the_target_has_no_memory_for_gets_resource_exhausted_and_the_target_serves_on():
    async def body(service):
        service.target.memory_tokens = 8
        long = generation_pb2.GenerateRequest(prompt_token_ids=[2] * 20, max_new_tokens=4)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await service.stub.Generate(long, timeout=30)
        after = await service.stub.Generate(plain(max_new_tokens=5), timeout=30)
        out_of_memory = {s.labels["pool"]: s.value for m in service.router.metrics.out_of_memory.collect()
                         for s in m.samples if s.name.endswith("_total")}
        return (info.value, list(after.token_ids), service.client.describe()["state"], service.requests_counted(),
                out_of_memory)
    error, tokens, state, counted, out_of_memory = run(body)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.details().startswith("the target: out of device memory for this request (CUDA out of memory.")
    assert len(tokens) == 5 and state == "ready"
    assert counted.get("RESOURCE_EXHAUSTED") == 1 and counted.get("OK") == 1
    assert out_of_memory == {"target": 1}


class Draft:
    failed = None

    def mark_failed(self, exc):
        self.failed = exc


def test_a_draft_out_of_memory_costs_the_round_its_drafts_and_keeps_the_worker():
    counted = []
    state = types.SimpleNamespace(draft_synced=3, timeout=lambda limit: limit, count_out_of_memory=counted.append)
    draft = Draft()
    error = grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                 details="out of device memory for this request")
    assert draft_lost(state, draft, error) is None
    assert draft.failed is None and state.draft_synced == 0 and counted == ["draft"]
