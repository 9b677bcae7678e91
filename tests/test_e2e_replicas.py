"""Two draft and two target replicas: concurrent requests spread over both replicas of each pool
(least outstanding sessions), and every output equals the single-replica output."""
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray

from protos.specpool.v1 import generation_pb2
from tests.conftest import service_config

PROMPTS = [[1, 2, 3], [40, 50, 60, 70], [200, 100], [7] * 9]


@pytest.fixture(scope="module")
def service(start_service, byte_pair):
    return start_service(service_config(byte_pair, draft={"replicas": 2}, target={"replicas": 2}))


def test_both_replicas_serve_and_outputs_match(service, reference_generate):
    def call(prompt):
        request = generation_pb2.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=40)
        request.speculation.k = 3
        return list(service.stub.Generate(request).token_ids)
    requests = PROMPTS * 4
    with ThreadPoolExecutor(8) as pool:
        outputs = list(pool.map(call, requests))
    for prompt, tokens in zip(requests, outputs):
        assert tokens == reference_generate(prompt, 40)
    pools = service.service.pools
    drafts = ray.get([a.sessions_started.remote() for a in pools.draft_actors])
    targets = ray.get([ranks[0].sessions_started.remote() for ranks in pools.target_actors])
    assert len(drafts) == 2 and min(drafts) > 0, drafts
    assert len(targets) == 2 and min(targets) > 0, targets
