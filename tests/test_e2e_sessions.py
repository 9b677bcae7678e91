"""Workers free a request's KV caches when it ends, and when the client cancels mid-stream."""
import time

import pytest
import ray

from protos.specpool.v1 import generation_pb2
from tests.conftest import service_config


@pytest.fixture(scope="module")
def service(start_service, byte_pair):
    return start_service(service_config(byte_pair, speculation={"k": 2}))


def active_sessions(service) -> list[int]:
    pools = service.service.pools
    actors = pools.draft_actors + [ranks[0] for ranks in pools.target_actors]
    return ray.get([actor.active_sessions.remote() for actor in actors])


def wait_for_no_sessions(service, timeout=10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (counts := active_sessions(service)) != [0, 0] and time.monotonic() < deadline:
        time.sleep(0.1)
    return counts


def test_sessions_freed_after_requests(service):
    for k in (0, 2):
        request = generation_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=8)
        request.speculation.k = k
        assert len(service.stub.Generate(request).token_ids) == 8
    assert wait_for_no_sessions(service) == [0, 0]


def test_sessions_freed_when_client_cancels(service):
    request = generation_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=400)
    stream = service.stub.GenerateStream(request)
    first = next(stream)
    assert len(first.token_ids) >= 1
    assert active_sessions(service) == [1, 1]          # both workers hold the session mid-request
    stream.cancel()
    assert wait_for_no_sessions(service) == [0, 0]


def test_workers_keep_what_they_loaded_out_of_the_collectors_scans(service):
    """engine.gc_pauses: each worker froze what it held once serving (the model, torch, transformers, Ray: tens of
    thousands of objects that a full collection would otherwise scan, stalling its calls), and counts its pauses."""
    pools = service.service.pools
    actors = pools.draft_actors + [ranks[0] for ranks in pools.target_actors]
    request = generation_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=8)
    assert len(service.stub.Generate(request).token_ids) == 8
    for pauses in ray.get([actor.gc_pauses.remote() for actor in actors]):
        assert pauses["frozen"] > 50_000
        assert set(pauses) == {"gen0", "gen1", "gen2", "frozen"} and pauses["gen0"]["count"] >= 0
