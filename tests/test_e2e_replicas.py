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


@pytest.fixture(scope="module")
def growing(start_service, byte_pair):
    config = service_config(byte_pair)
    return start_service(config), config


def test_reload_adds_replicas_while_serving(growing, reference_generate):
    import threading

    import grpc
    import yaml

    from protos.specpool.v1 import admin_pb2, admin_pb2_grpc
    service, config = growing
    request = generation_pb2.GenerateRequest(prompt_token_ids=PROMPTS[0], max_new_tokens=300)
    request.speculation.k = 2
    in_flight = {}
    thread = threading.Thread(target=lambda: in_flight.update(r=service.stub.Generate(request, timeout=300)))
    thread.start()
    bigger = {**config, "draft": {**config["draft"], "replicas": 2}, "target": {**config["target"], "replicas": 2}}
    with grpc.insecure_channel(service.admin_address) as channel:
        admin_pb2_grpc.AdminStub(channel).Reload(admin_pb2.ReloadRequest(config_yaml=yaml.safe_dump(bigger)),
                                                 timeout=300)
        with pytest.raises(grpc.RpcError) as info:                     # scaling down needs a restart
            admin_pb2_grpc.AdminStub(channel).Reload(admin_pb2.ReloadRequest(config_yaml=yaml.safe_dump(config)))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    thread.join(300)
    assert list(in_flight["r"].token_ids) == reference_generate(PROMPTS[0], 300)
    pools = service.service.pools
    assert len(pools.draft_actors) == 2 and len(pools.target_actors) == 2
    test_both_replicas_serve_and_outputs_match(service, reference_generate)
