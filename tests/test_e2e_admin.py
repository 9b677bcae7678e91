"""Operator control through the real service: hot reload changes the K in use without dropping an
in-flight request, an invalid reload is refused and the old K stays, metrics move as requests run."""
import threading
import time
import urllib.request

import grpc
import pytest
import yaml

from protos.specpool.v1 import admin_pb2, admin_pb2_grpc, generation_pb2
from tests.conftest import service_config

PROMPT = [9, 8, 7, 6]


@pytest.fixture(scope="module")
def config(byte_pair):
    return service_config(byte_pair, router={"metrics_port": 0},
                          speculation={"policy": "fixed", "k": 1, "warmup_rounds": 2})


@pytest.fixture(scope="module")
def service(start_service, config):
    return start_service(config)


@pytest.fixture(scope="module")
def admin(service):
    channel = grpc.insecure_channel(service.address)
    yield admin_pb2_grpc.AdminStub(channel)
    channel.close()


def reload(admin, config, **speculation):
    new = {**config, "speculation": {**config["speculation"], **speculation}}
    return admin.Reload(admin_pb2.ReloadRequest(config_yaml=yaml.safe_dump(new)))


def current_k(admin) -> int:
    return yaml.safe_load(admin.GetStatus(admin_pb2.GetStatusRequest()).config_yaml)["speculation"]["k"]


def test_hot_reload_changes_k_of_an_in_flight_request(service, admin, config, reference_generate):
    request = generation_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=300)
    chunks, started = [], threading.Event()

    def consume():
        for chunk in service.stub.GenerateStream(request):
            chunks.append(chunk)
            if len(chunks) == 20:
                started.set()
    thread = threading.Thread(target=consume)
    thread.start()
    assert started.wait(60)
    reload(admin, config, k=4)
    thread.join(120)
    try:
        tokens = [t for c in chunks for t in c.token_ids]
        assert tokens == reference_generate(PROMPT, 300)             # nothing dropped, nothing changed
        ks = list(chunks[-1].stats.k_per_round)
        assert ks[0] == 1 and 4 in ks and ks.index(4) >= 20          # K moved mid-request
        assert current_k(admin) == 4
    finally:
        reload(admin, config, k=1)


def test_invalid_reload_is_refused_and_old_k_stays(admin, config):
    with pytest.raises(grpc.RpcError) as info:
        reload(admin, config, k_min=5, k_max=3)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("speculation.k_max:")
    with pytest.raises(grpc.RpcError) as info:
        admin.Reload(admin_pb2.ReloadRequest(config_yaml=yaml.safe_dump({**config, "draft": {"replicas": 3}})))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert current_k(admin) == 1


def scrape(service) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{service.service.metrics_port}/metrics").read().decode()
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_metrics_counters_move(service):
    before = scrape(service)
    request = generation_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=16)
    request.speculation.k = 3
    response = service.stub.Generate(request)
    with pytest.raises(grpc.RpcError):
        service.stub.Generate(generation_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=0))
    time.sleep(0.2)
    after = scrape(service)

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)
    stats = response.stats
    assert delta("specpool_spec_decode_num_draft_tokens_total") == stats.draft_tokens
    assert delta("specpool_spec_decode_num_accepted_tokens_total") == stats.accepted_tokens
    assert delta("specpool_spec_decode_num_drafts_total") == sum(1 for k in stats.k_per_round if k)
    assert delta('specpool_requests_total{code="OK"}') == 1
    assert delta('specpool_requests_total{code="INVALID_ARGUMENT"}') == 1
    assert delta("specpool_time_to_first_token_seconds_count") == 1
    assert delta("specpool_e2e_request_latency_seconds_count") == 1
    assert "specpool_spec_decode_k" in after
