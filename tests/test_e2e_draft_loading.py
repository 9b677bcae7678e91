"""The router serves as soon as the target pool has loaded; the draft replicas join as they load (whole stack:
gRPC, Ray actors, the router).

A slow draft load is made with no test hook in the product: a Ray actor of the test holds every `draft_pool`
resource of the local instance, so the draft replica cannot be placed and its start() stays pending, as it would
while a draft's node comes up or its model loads. Freeing the resource lets it load.

- Until the draft is ready (Admin.GetStatus `workers`, metric specpool_worker_replicas: "loading"), requests are
  served, greedy output is identical to the target alone, and their rounds use n-gram proposals (method model:
  the fallback), not the draft model. Once it is ready, rounds use the draft model again.
- model+ngram at TP 1, one at a time and batched (the same service, reloaded), is identical to the target alone.
- A draft that fails to load after SERVING stays out ("failed", with its error, logged in one line) and requests
  are still served; Service.stop does not wait for a draft that is still loading, and leaves no draft actor.
"""
import asyncio
import contextlib
import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from protos.specpool.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, worker_pb2, worker_pb2_grpc
from router.worker_client import DraftClient, least_loaded
from tests.conftest import RunningService, service_config

NONE, MODEL, NGRAM = (generation_pb2.PROPOSAL_SOURCE_NONE, generation_pb2.PROPOSAL_SOURCE_MODEL,
                      generation_pb2.PROPOSAL_SOURCE_NGRAM)
PROMPTS = [list(b"abcabcabcabc"), [10, 20, 30, 40, 10, 20, 30, 40, 10, 20], [72, 101, 108, 108, 111]]
MAX_NEW = 40
DRAFT_POOL = 16                         # the ray_local fixture's draft_pool resources


class Holder:
    def ready(self) -> bool:
        return True


def hold_draft_pool(ray):
    """An actor holding every draft_pool resource: no draft replica can be placed until it is killed."""
    holder = ray.remote(Holder).options(num_cpus=0, resources={"draft_pool": DRAFT_POOL}).remote()
    ray.get(holder.ready.remote(), timeout=120)
    return holder


def release(ray, holder) -> None:
    with contextlib.suppress(Exception):
        ray.kill(holder, no_restart=True)


def config(pair, **draft) -> dict:
    return service_config(pair, router={"metrics_port": 0, "ready_timeout_s": 600.0},
                          draft={"ngram_min": 1, "ngram_max": 3, **draft})


def status(service) -> dict:
    with grpc.insecure_channel(service.admin_address) as channel:
        return json.loads(admin_pb2_grpc.AdminStub(channel).GetStatus(admin_pb2.GetStatusRequest()).stats_json)


def draft_states(service) -> list[str]:
    return [worker["state"] for worker in status(service)["workers"]["draft"]]


def replicas_metric(service, state: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{service.service.metrics_port}/metrics").read().decode()
    line = f'specpool_worker_replicas{{pool="draft",state="{state}"}} '
    return float(next(row for row in text.splitlines() if row.startswith(line)).split()[-1])


def wait_for_draft(service, state: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while draft_states(service) != [state]:
        assert time.monotonic() < deadline, f"the draft is {draft_states(service)}, not {state}"
        time.sleep(0.2)


def generate_all(service, prompts, k=None) -> list:
    def one(prompt):
        request = generation_pb2.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=MAX_NEW)
        if k is not None:
            request.speculation.k = k
        return service.stub.Generate(request)
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def check_identical(responses, prompts, reference_generate) -> set:
    """Each response is the target's own greedy output; returns the proposal sources of all their rounds."""
    sources = set()
    for prompt, response in zip(prompts, responses):
        assert list(response.token_ids) == reference_generate(prompt, MAX_NEW), prompt
        sources |= set(response.stats.source_per_round)
    return sources


class Releases(worker_pb2_grpc.DraftWorkerServicer):
    """A stand-in draft worker that answers Release, the first call a loaded client makes (WorkerClient.unreachable)."""

    async def Release(self, request, context):
        return worker_pb2.ReleaseResponse()


def test_a_loading_client_joins_once_loaded_and_one_that_fails_stays_out():
    """The client's states without Ray: loading (not healthy, not chosen while a ready replica exists), then ready
    at the address its load returned, once it answers a first call there; a failed load stays out, with the error,
    and is not recovered, and so does one that loaded where its channel cannot reach it (nothing listens there:
    over TLS, a certificate that does not name the address)."""
    def broken() -> str:
        raise RuntimeError("draft 1: no model")

    async def main():
        server = grpc.aio.server()
        worker_pb2_grpc.add_DraftWorkerServicer_to_server(Releases(), server)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        gate = threading.Event()
        joins = DraftClient(None, load=lambda: address if gate.wait(60) else "", name="draft 0")
        fails = DraftClient(None, recover=lambda: "127.0.0.1:9", load=broken, name="draft 1")
        unreachable = DraftClient(None, 5.0, load=lambda: {"address": "127.0.0.1:9", "cpus": [0]}, name="draft 2")
        await unreachable.wait_recovered(10)
        assert (unreachable.state, unreachable.healthy) == ("failed", False)
        assert unreachable.describe()["error"].startswith("draft 2 at 127.0.0.1:9 does not answer: UNAVAILABLE: ")
        assert (joins.state, joins.healthy, joins.address) == ("loading", False, "")
        await fails.wait_recovered(10)
        assert (fails.state, fails.healthy, fails.describe()["error"]) == ("failed", False, "draft 1: no model")
        fails.mark_failed()                                        # nothing to recover: it never loaded
        assert fails.state == "failed" and least_loaded([fails, joins]) is fails   # neither healthy: the first
        gate.set()
        await joins.wait_recovered(10)
        assert (joins.state, joins.healthy, joins.address) == ("ready", True, address)
        assert least_loaded([fails, joins]) is joins
        await fails.release(1)                                     # holds no session: nothing to call
        await asyncio.gather(joins.close(), fails.close(), unreachable.close())
        await server.stop(0)
    asyncio.run(main())


def test_a_draft_that_fails_to_load_after_serving_stays_out(ray_local, byte_pair, capfd, reference_generate):
    holder = hold_draft_pool(ray_local)
    # A draft device this machine cannot give: only the draft replica fails (the target holds the draft's LM head
    # on its own device).
    running = RunningService(config(byte_pair, device="cuda:99"), drafts_loaded=False)
    try:
        assert draft_states(running) == ["loading"]
        release(ray_local, holder)                               # now it loads, after SERVING, and fails
        wait_for_draft(running, "failed")
        worker = status(running)["workers"]["draft"][0]
        assert worker["error"].startswith("draft 0: ") and worker["address"] == "", worker
        assert "device 'cuda:99': this process sees no CUDA device (" in worker["error"], worker
        assert replicas_metric(running, "failed") == 1
        assert f"[specpool] draft 0 did not load and stays out of the pool (restart to retry): {worker['error']}\n" \
            in capfd.readouterr().out
        responses = generate_all(running, PROMPTS)
        assert NGRAM in check_identical(responses, PROMPTS, reference_generate)
    finally:
        release(ray_local, holder)
        running.stop()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a process that sees no GPU")
def test_a_pool_on_cuda_that_sees_no_gpu_is_refused_saying_why(monkeypatch):
    """As a Ray actor that asked for no GPU sees the node: CUDA_VISIBLE_DEVICES empty."""
    from engine.modeling import load_model
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(RuntimeError) as info:
        load_model("never-read", device="cuda")
    assert str(info.value) == ("device 'cuda': this process sees no CUDA device (CUDA_VISIBLE_DEVICES is empty: Ray "
                               "hides every GPU from an actor that asks for none; give the pool num_gpus > 0)")


def test_stop_while_the_draft_is_loading_leaves_no_draft_actor(ray_local, byte_pair):
    holder = hold_draft_pool(ray_local)
    try:
        running = RunningService(config(byte_pair), drafts_loaded=False)
        assert draft_states(running) == ["loading"]
        tag = running.service.pools.tag
        running.stop()                                           # returns: nothing waits for the draft's load
        with pytest.raises(ValueError):
            ray_local.get_actor(f"specpool-{tag}-draft-0")
    finally:
        release(ray_local, holder)
    deadline = time.monotonic() + 60                             # nothing left to take the freed resources
    while ray_local.available_resources().get("draft_pool", 0) < DRAFT_POOL and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray_local.available_resources().get("draft_pool", 0) == DRAFT_POOL


# ---- one service: its draft loads late, then joins ------------------------------------------------------

@pytest.fixture(scope="module")
def holder(ray_local):
    holder = hold_draft_pool(ray_local)
    yield holder
    release(ray_local, holder)


@pytest.fixture(scope="module")
def service(start_service, byte_pair, holder):
    return start_service(config(byte_pair), drafts_loaded=False)


def test_served_while_the_draft_loads_with_ngram_rounds_then_the_draft_joins(service, holder, ray_local,
                                                                           reference_generate):
    assert service.service.config.draft.method == "model"
    assert draft_states(service) == ["loading"] and replicas_metric(service, "loading") == 1
    before = generate_all(service, PROMPTS * 2)                  # 6 at once: batched on the target
    assert check_identical(before, PROMPTS * 2, reference_generate) == {NGRAM, NONE}   # never the draft model
    assert all(NGRAM in response.stats.source_per_round for response in before[:2])
    assert draft_states(service) == ["loading"]                # all of that was served before the draft loaded

    release(ray_local, holder)
    wait_for_draft(service, "ready")
    assert replicas_metric(service, "ready") == 1 and replicas_metric(service, "loading") == 0
    after = generate_all(service, PROMPTS * 2)
    assert MODEL in check_identical(after, PROMPTS * 2, reference_generate)
    assert all(MODEL in response.stats.source_per_round for response in after)


@pytest.mark.parametrize("k", [None, 2, 5])
def test_model_plus_ngram_at_tp1_batched_identical(service, holder, ray_local, reference_generate, k):
    """model+ngram at TP 1 (the loading service, once its draft has loaded, reloaded to model+ngram)."""
    release(ray_local, holder)
    wait_for_draft(service, "ready")
    service.reload_draft_method("model+ngram")
    try:
        alone = [generate_all(service, [prompt], k)[0] for prompt in PROMPTS]
        batched = generate_all(service, PROMPTS * 3, k)
    finally:
        service.reload_draft_method("model")
    sources = check_identical(alone, PROMPTS, reference_generate) | \
        check_identical(batched, PROMPTS * 3, reference_generate)
    # With a K of its own a request drafts by the model wherever no n-gram matches. The adaptive policy drafts by
    # the model only where its measured costs say it pays: under the whole suite's load it once held K = 0 for all
    # 12 requests (their rounds NGRAM and NONE only), so there only the n-gram source is certain.
    assert ({NGRAM} if k is None else {MODEL, NGRAM}) <= sources
