"""Faults injected while requests are in flight: the outcome is identical greedy tokens, or the
documented clean status, and no leaked session state."""
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import ray

from protos.specpool.v1 import generation_pb2
from settings.schema import config_from_dict
from tests.conftest import service_config

PROMPT = [4, 5, 6, 7]
NONE, MODEL, NGRAM = (generation_pb2.PROPOSAL_SOURCE_NONE, generation_pb2.PROPOSAL_SOURCE_MODEL,
                      generation_pb2.PROPOSAL_SOURCE_NGRAM)
LONG = 200


def greedy(max_new=LONG, k=3):
    request = generation_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=max_new)
    request.speculation.k = k
    return request


def stream_with_fault(service, request, fault, after_chunks=5):
    """Stream a request; run `fault()` once `after_chunks` chunks have arrived; return all chunks."""
    chunks = []
    for chunk in service.stub.GenerateStream(request, timeout=180):
        chunks.append(chunk)
        if len(chunks) == after_chunks:
            fault()
    return chunks


def tokens_of(chunks):
    return [t for c in chunks for t in c.token_ids]


def sigkill(actor):
    killer(actor)()


def killer(actor):
    """A fault that SIGKILLs `actor` at once when called (its pid asked of Ray beforehand, so that the request
    does not run on while Ray answers)."""
    pid = ray.get(actor.pid.remote())
    return lambda: os.kill(pid, signal.SIGKILL)


CPUS = sorted(os.sched_getaffinity(0))[:2] if hasattr(os, "sched_getaffinity") else []
PINNED = len(CPUS) == 2      # the ranks on a core each, the draft beside rank 0 (target.cpus, draft.cpus)


@pytest.fixture(scope="module")
def tp2(start_service, byte_pair):
    cpus = {"cpus": CPUS} if PINNED else {}
    return start_service(service_config(byte_pair, target={"tensor_parallel_size": 2, **cpus},
                                        draft={"cpus": CPUS[:1]} if PINNED else {},
                                        router={"target_recovery_s": 120.0}))


def pinned_cpus(service) -> list[list[set]]:
    """The CPU set of every thread of the draft and of each target rank, in that order."""
    pools = service.service.pools
    actors = pools.draft_actors + [rank for ranks in pools.target_actors for rank in ranks]
    return [[os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")]
            for pid in ray.get([actor.pid.remote() for actor in actors])]


def assert_pinned(service) -> None:
    """The draft on the first CPU, each rank on a CPU of its own (the pools' CPUs split between the ranks)."""
    threads = pinned_cpus(service)
    assert len(threads) == 3
    for cpu, sets in zip([CPUS[0], CPUS[0], CPUS[1]], threads):     # draft, rank 0, rank 1
        assert sets and all(s == {cpu} for s in sets), (cpu, sets)


@pytest.mark.skipif(not PINNED, reason="needs two CPUs and Linux's CPU affinity")
def test_every_thread_of_each_worker_runs_on_its_pinned_cpus(tp2):
    assert_pinned(tp2)


def test_every_worker_runs_at_the_configured_cpu_priority_not_rays_default_15(tp2):
    """ray.worker_niceness (0 by default) for the draft and each target rank: Ray's 15 let every other process
    on the machine pre-empt a forward."""
    assert worker_niceness(tp2) == [0, 0, 0]


def test_draft_killed_mid_request_gives_identical_tokens(tp2, reference_generate):
    draft = tp2.service.pools.draft_actors[0]
    chunks = stream_with_fault(tp2, greedy(), killer(draft))
    assert tokens_of(chunks) == reference_generate(PROMPT, LONG)
    sources = list(chunks[-1].stats.source_per_round)
    assert sources[:4] == [NONE] + [MODEL] * 3          # the first round is the target's prefill (prefill_first)
    after = sources[sources.index(NGRAM):]               # it went on with n-gram proposals (K = 0 where none matched)
    assert MODEL not in after[:5] and after.count(NGRAM) > after.count(NONE)
    deadline = time.monotonic() + 120                    # Ray restarts the draft; the draft model drafts again
    while time.monotonic() < deadline:
        response = tp2.stub.Generate(greedy(max_new=20))
        assert list(response.token_ids) == reference_generate(PROMPT, 20)
        if MODEL in response.stats.source_per_round:
            break
        time.sleep(1.0)
    assert MODEL in response.stats.source_per_round


@pytest.mark.parametrize("k", [3, 0], ids=["speculating", "decode-run"])
def test_target_rank_killed_mid_request_gives_identical_tokens(tp2, reference_generate, k):
    rank1 = tp2.service.pools.target_actors[0][1]
    chunks = stream_with_fault(tp2, greedy(k=k), killer(rank1))
    assert tokens_of(chunks) == reference_generate(PROMPT, LONG)
    after = tp2.stub.Generate(greedy(max_new=20))
    assert list(after.token_ids) == reference_generate(PROMPT, 20)


def itl_observed(service) -> float:
    """Output tokens the router has seen arrive after a request's first (its inter-token latency histogram)."""
    return next(s.value for m in service.service.router.metrics.itl.collect() for s in m.samples
                if s.name.endswith("_count"))


def test_target_rank_killed_while_a_run_read_whole_holds_answers_gives_identical_tokens(tp2, reference_generate):
    """A request read whole (Generate) lets the target hold its decode run's answers (unstreamed_answer_delay_ms):
    those it holds when rank 1 dies are lost with the group, and the router runs again from what it had received."""
    rank1 = tp2.service.pools.target_actors[0][1]
    before = tp2.reload(speculation={"unstreamed_answer_delay_ms": 30})    # several held messages per run
    try:
        seen = itl_observed(tp2)
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(tp2.stub.Generate, greedy(k=0), timeout=180)
            deadline = time.monotonic() + 60
            while itl_observed(tp2) == seen and time.monotonic() < deadline:    # a held message came: mid-run
                time.sleep(0.002)
            sigkill(rank1)
            response = future.result()
    finally:
        tp2.reload(**before)
    assert list(response.token_ids) == reference_generate(PROMPT, LONG)
    assert response.stats.target_calls >= 2           # the kill cut the run short, and it was sent again


def model_rounds_again(service, timeout=120.0) -> None:
    """Wait until the draft model drafts again (Ray restarted a killed draft worker)."""
    deadline = time.monotonic() + timeout
    while MODEL not in service.stub.Generate(greedy(max_new=12)).stats.source_per_round:
        assert time.monotonic() < deadline, "the draft worker did not come back"
        time.sleep(1.0)


@pytest.mark.parametrize("victim,chained", [("draft", False), ("target rank 1", False), ("draft", True)],
                         ids=["draft", "target-rank-1", "draft-chained"])
def test_handed_off_rounds_survive_a_killed_worker_with_identical_tokens(tp2, reference_generate, victim, chained):
    """speculation.hand_off, every round drafted on the critical path (in turn; `chained`: overlapped, with
    chain_predrafts, each such round's pre-draft chained to its draft call): a draft worker killed mid-request
    leaves its waiting verify call withdrawn (and its chained pre-draft lost) and the rounds go on by n-gram; a
    target rank killed mid-request fails the waiting call and the round runs again once the group is back. The
    tokens are the target's either way."""
    model_rounds_again(tp2)
    before = tp2.reload(speculation={"hand_off": True, **({"chain_predrafts": True, "overlap": True} if chained
                                                          else {"overlap": False})})
    try:
        pools = tp2.service.pools
        actor = pools.draft_actors[0] if victim == "draft" else pools.target_actors[0][1]
        killed = ray.get(actor.pid.remote())
        chunks = stream_with_fault(tp2, greedy(), killer(actor))
    finally:
        tp2.reload(**before)
    assert tokens_of(chunks) == reference_generate(PROMPT, LONG)
    stats = chunks[-1].stats
    assert stats.handed_off_rounds + stats.handoffs_from_router > 0
    assert ray.get(actor.pid.remote()) != killed              # it was killed mid-request, and Ray restarted it


@pytest.mark.skipif(not PINNED, reason="needs two CPUs and Linux's CPU affinity")
def test_workers_restarted_after_the_kills_above_are_pinned_again(tp2):
    model_rounds_again(tp2)                  # the draft killed last has loaded (and pinned itself) again
    assert_pinned(tp2)
    assert worker_cpus(tp2) == {"target 0": CPUS, "draft 0": CPUS[:1]}     # as their recoveries reported them
    assert set(worker_niceness(tp2)) == {0}     # restarted by the raylet, which gives every worker the niceness


def worker_niceness(service) -> list[int]:
    """The CPU priority (nice) of each worker process of a service: its draft, then each target rank."""
    pools = service.service.pools
    actors = pools.draft_actors + [rank for ranks in pools.target_actors for rank in ranks]
    return [os.getpriority(os.PRIO_PROCESS, pid) for pid in ray.get([actor.pid.remote() for actor in actors])]


def test_a_worker_niceness_the_instance_does_not_give_goes_in_each_actors_runtime_env(monkeypatch):
    """The local instance's raylet gives every worker the niceness it was started with (launch.init_local): actors
    need no runtime_env then. Another niceness, or a cluster (its raylets' environment is not ours), puts it in
    each actor's runtime_env, which reaches every worker, restarts too."""
    from router import launch
    config = config_from_dict(service_config(("d", "t")))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(launch, "_local_niceness", (launch.session(), 0))
    options = lambda: launch._worker_options(config, config.draft)  # noqa: E731
    assert "runtime_env" not in options()
    config.ray.worker_niceness = 3
    assert options()["runtime_env"] == {"env_vars": {"RAY_worker_niceness": "3"}}
    config.ray.worker_niceness, config.ray.address = 0, "10.0.0.1:6379"
    assert options()["runtime_env"] == {"env_vars": {"RAY_worker_niceness": "0"}}
    monkeypatch.setattr(launch, "_local_niceness", ("an earlier session", 0))
    config.ray.address = ""
    assert "runtime_env" in options()


@pytest.fixture(scope="module")
def small(start_service, byte_pair):
    auto = {"cpus": "auto"}        # as deploy/local.yaml has it
    return start_service(service_config(byte_pair, router={"max_active_requests": 1, "max_queued_requests": 1},
                                        draft=auto, target=auto, ray={"worker_niceness": 3}))


def test_a_niceness_other_than_the_instances_reaches_each_worker(small):
    """ray.worker_niceness 3 on an instance whose raylet gives 0: through each actor's runtime_env."""
    assert worker_niceness(small) == [3, 3]


@pytest.mark.skipif(not PINNED, reason="needs two CPUs and Linux's CPU affinity")
def test_auto_gives_the_target_then_the_draft_a_cpu_of_its_own(small):
    threads = pinned_cpus(small)                       # draft, then the target's one rank
    assert threads[1] and all(s == {CPUS[0]} for s in threads[1])
    assert threads[0] and all(s == {CPUS[1]} for s in threads[0])
    assert worker_cpus(small) == {"target 0": [CPUS[0]], "draft 0": [CPUS[1]]}     # what specpool status shows


def worker_cpus(service) -> dict:
    """Each worker's CPUs as Admin.GetStatus reports them (from its start: the draft's load, the target's launch,
    or either's recovery)."""
    workers = service.service.router.status()["workers"]
    return {worker["name"]: worker.get("cpus") for pool in ("target", "draft") for worker in workers[pool]}


def active_sessions(service):
    pools = service.service.pools
    actors = pools.draft_actors + [ranks[0] for ranks in pools.target_actors]
    return ray.get([a.active_sessions.remote() for a in actors])


def wait_no_sessions(service, timeout=15):
    deadline = time.monotonic() + timeout
    while (counts := active_sessions(service)) != [0, 0] and time.monotonic() < deadline:
        time.sleep(0.1)
    return counts


def test_deadline_expiry_is_clean(small):
    with pytest.raises(grpc.RpcError) as info:
        small.stub.Generate(greedy(max_new=900), timeout=0.5)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_no_sessions(small) == [0, 0]


def test_overload_is_refused_at_once(small, reference_generate):
    """One running, one queued; the rest get RESOURCE_EXHAUSTED immediately."""
    def call(_):
        started = time.monotonic()
        try:
            return list(small.stub.Generate(greedy(max_new=150)).token_ids), time.monotonic() - started
        except grpc.RpcError as exc:
            return exc.code(), time.monotonic() - started
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(call, range(6)))
    refused = [seconds for outcome, seconds in results if outcome == grpc.StatusCode.RESOURCE_EXHAUSTED]
    served = [(outcome, seconds) for outcome, seconds in results if isinstance(outcome, list)]
    assert len(refused) + len(served) == 6 and len(served) >= 2 and len(refused) >= 1
    assert all(tokens == reference_generate(PROMPT, 150) for tokens, _ in served)
    # A refusal that waited for a slot would take at least as long as the first request served.
    assert max(refused) < min(seconds for _, seconds in served)
    assert wait_no_sessions(small) == [0, 0]


def router_session_gauges(service) -> list[float]:
    registry = service.service.router.metrics.registry
    return [s.value for m in registry.collect() if m.name == "specpool_worker_active_sessions" for s in m.samples]


def test_cancel_mid_stream_frees_sessions(small):
    stream = small.stub.GenerateStream(greedy(max_new=900))
    next(stream)
    threading.Timer(0.2, stream.cancel).start()
    with pytest.raises(grpc.RpcError) as info:
        for _ in stream:
            pass
    assert info.value.code() == grpc.StatusCode.CANCELLED
    assert wait_no_sessions(small) == [0, 0]
    gauges = router_session_gauges(small)
    assert len(gauges) == 2 and gauges == [0.0, 0.0]
