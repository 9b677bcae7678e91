"""What the router tells the operator and the client when its target fails, stalls or is overloaded: health,
the session gauge, the final status counted, the error detail, the log lines. Fake targets (tests/fake_workers.py),
no Ray, no model."""
import asyncio
import sys
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.failures import worker_failure
from router.server import Overloaded, Shedding
from router.worker_client import GaveUp, TargetClient, WorkerClient, rpc_error
from tests.fake_workers import ClosedPipe, plain, run

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


GENERATION = "specpool.v1.Generation"


async def health(service, name: str = "") -> int:
    """Health of the server ("") or of a service it names."""
    stub = health_pb2_grpc.HealthStub(service.channel)
    return (await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)).status


async def until(predicate, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def health_becomes(service, status: int, timeout: float = 10.0, name: str = "") -> int:
    """The health status once it reads `status`, or the last one read after `timeout` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while (now := await health(service, name)) != status and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
    return now


async def rest_of(stream) -> list:
    """The stream's remaining chunks (read() to its end: a stream once read() cannot be iterated)."""
    chunks = []
    while (chunk := await stream.read()) is not grpc.aio.EOF:
        chunks.append(chunk)
    return chunks


async def kill_mid_stream(service, stream):
    """Read one chunk of `stream`, then kill the target and wait until the router has marked it down."""
    await stream.read()
    await service.target.kill()
    await until(lambda: service.client.state == "down")


def session_series(service) -> dict:
    return {s.labels["address"]: s.value for m in service.router.metrics.worker_sessions.collect()
            for s in m.samples}


def test_a_session_on_a_worker_whose_address_changes_leaves_no_phantom_series():
    async def body(service):
        old = service.target.address
        stream = service.stub.GenerateStream(plain(1000))
        await kill_mid_stream(service, stream)
        assert session_series(service) == {old: 1.0}
        service.restarter.allow()
        await until(lambda: service.client.state == "ready")
        during = session_series(service)
        chunks = await rest_of(stream)
        return old, service.client.address, during, session_series(service), chunks[-1].finish_reason
    old, new, during, after, finish = run(body)
    assert old != new and finish
    assert during == {new: 1.0}            # moved with the worker, not left behind on its old address
    assert after == {new: 0.0}


def test_a_target_whose_failure_cannot_be_logged_is_still_recovered(monkeypatch):
    """serve's stdout reader gone: the failure's log line raised BrokenPipeError before the state changed, and the
    target stayed "ready" with no recovery."""
    async def body(service):
        stream = service.stub.GenerateStream(plain(1000))
        first = await stream.read()
        monkeypatch.setattr(sys, "stdout", ClosedPipe())
        await service.target.kill()
        await until(lambda: service.client.state == "down")
        service.restarter.allow()
        await until(lambda: service.client.state == "ready")
        return len(first.token_ids) + sum(len(chunk.token_ids) for chunk in await rest_of(stream))
    assert run(body) == 1000


def scripted_recover(*calls):
    """A worker's recover() whose n-th call does as `calls[n]` says: an exception is raised (the worker is still
    gone), an Event is waited for before returning a new address, None returns a new address at once."""
    made = []

    def recover() -> str:
        step = calls[len(made)]
        made.append(step)
        if isinstance(step, Exception):
            raise step
        if step is not None:
            step.wait(10)
        return f"127.0.0.1:{40000 + len(made)}"
    return recover


def test_a_recovery_that_fails_fast_logs_still_down_once_not_every_retry(capsys, monkeypatch):
    """recover() failing at once was logged every RETRY_PAUSE_S (0.5 s) for the whole outage."""
    monkeypatch.setattr(WorkerClient, "RETRY_PAUSE_S", 0.01)

    async def body():
        client = TargetClient("127.0.0.1:40000", recover=scripted_recover(*[RuntimeError("the actor is not back yet")] * 19, None),
                              name="target 0")
        client.mark_failed(rpc_error(grpc.StatusCode.UNAVAILABLE, "gone"))
        await client.wait_recovered(10)
        state = client.state
        await client.close()
        return state
    assert asyncio.run(body()) == "ready"
    assert capsys.readouterr().out.count("target 0 still down: RuntimeError") == 1


def test_a_failure_right_after_a_recovery_keeps_its_own_recovery():
    """A failure while the recovery that had just ended closed the old channel started a new recovery, which the
    ending one then erased: the worker stayed down and nobody could wait for it."""
    gate = threading.Event()

    async def body():
        client = TargetClient("127.0.0.1:40000", recover=scripted_recover(None, gate), name="target 0")
        fails = rpc_error(grpc.StatusCode.UNAVAILABLE, "gone")
        client.listeners.append(lambda worker: worker.state == "ready" and not gate.is_set() and worker.mark_failed(fails))
        client.mark_failed(fails)
        await until(lambda: client.address == "127.0.0.1:40001" and client.state == "down")
        await asyncio.sleep(0.1)                         # the first recovery's end
        waiting = asyncio.ensure_future(client.wait_recovered(10))
        await asyncio.sleep(0.1)
        waited = not waiting.done()
        gate.set()
        await waiting
        state = client.state
        await client.close()
        return waited, state
    assert asyncio.run(body()) == (True, "ready")


def test_status_names_each_worker_and_says_since_when_and_why_a_down_one_is_down():
    async def body(service):
        stream = service.stub.GenerateStream(plain(1000))
        await kill_mid_stream(service, stream)
        down = service.router.status()
        service.restarter.allow()
        await until(lambda: service.client.state == "ready")
        await rest_of(stream)
        return down, service.router.status()
    down, back = run(body)
    worker = down["workers"]["target"][0]
    assert (worker["name"], worker["state"], down["outstanding_sessions"]) == ("target 0", "down", {"draft": [],
                                                                                                    "target": [1]})
    assert worker["last_error"].startswith("UNAVAILABLE: ") and 0 <= worker["down_for_s"] < 10
    assert len(worker["down_since"]) == len("2026-11-25 14:16:02")
    assert back["workers"]["target"][0]["state"] == "ready" and "down_since" not in back["workers"]["target"][0]
    assert back["outstanding_sessions"] == {"draft": [], "target": [0]} and back["queued_requests"] == 0


def test_health_is_not_serving_while_every_target_is_down_and_serving_once_one_is_back():
    async def body(service):
        stream = service.stub.GenerateStream(plain(1000))
        await kill_mid_stream(service, stream)
        down = (await health(service), await health(service, GENERATION))   # a probe may name the service
        from openai_api.app import Api
        from openai_api.protocol import ApiError
        from settings.schema import HttpConfig
        with pytest.raises(ApiError) as http:
            await Api(HttpConfig(), lambda: service.router).health()
        service.restarter.allow()
        await until(lambda: service.client.state == "ready")
        back = (await health_becomes(service, SERVING),   # the health update runs as its own task
                await health_becomes(service, SERVING, name=GENERATION))
        tokens = sum(len(chunk.token_ids) for chunk in await rest_of(stream))
        return down, http.value.status, back, tokens
    down, http_status, back, tokens = run(body)
    assert (down, http_status, back) == ((NOT_SERVING,) * 2, 503, (SERVING,) * 2)
    assert tokens >= 999                                # the request in flight waited and finished


def test_a_target_back_during_the_drain_is_not_logged_as_health_serving(capsys):
    """Health stays NOT_SERVING from the shutdown on; the log said 'health SERVING' when a target came back."""
    async def body(service):
        stream = service.stub.GenerateStream(plain(1000))
        await kill_mid_stream(service, stream)
        service.router.draining = True
        service.restarter.allow()
        await until(lambda: service.client.state == "ready")
        await rest_of(stream)
    run(body)
    log = capsys.readouterr().out
    assert "health SERVING" not in log and "a target replica is ready again (health stays NOT_SERVING" in log


async def stalled_stream_cancelled_just_before_its_deadline(service, timeout: float, early: float) -> None:
    """A stream with deadline `timeout` whose target stalls after its fourth chunk, cancelled by its client `early`
    seconds before the deadline: as a client whose deadline fires on its side first cancels the call (`specpool
    generate --stream`), its cancel reaching the router a few ms before the router's copy of the deadline."""
    loop = asyncio.get_running_loop()
    service.target.stalled, started = False, loop.time()
    call = service.stub.GenerateStream(plain(1000), timeout=timeout)
    for _ in range(4):
        await call.read()
    service.target.stalled = True
    await asyncio.sleep(started + timeout - early - loop.time())
    call.cancel()


def test_a_stream_cancelled_by_its_clients_expiring_deadline_on_a_stalled_target_counts_as_deadline_exceeded():
    """The router counted such a stream CANCELLED: the client's cancel reached it with 6.5 ms of the router's copy of
    the deadline left (a SIGSTOPped target, demo pair)."""
    async def body(service):
        for _ in range(3):
            await stalled_stream_cancelled_just_before_its_deadline(service, 0.6, early=0.03)
        await until(lambda: sum(service.requests_counted().values()) >= 3, timeout=30)   # the handlers' ends
        return service.requests_counted()
    assert run(body) == {"DEADLINE_EXCEEDED": 3.0}


class Ended:
    """A handler's context as grpc.aio leaves it when the call ended under it."""

    def __init__(self, remaining):
        self.remaining = remaining

    def time_remaining(self):
        return self.remaining


@pytest.mark.parametrize("remaining, code", [(0.0, "DEADLINE_EXCEEDED"), (0.0065, "DEADLINE_EXCEEDED"),
                                             (2.0, "CANCELLED"), (None, "CANCELLED")])
def test_a_call_cancelled_by_its_clients_expiring_deadline_counts_as_deadline_exceeded(remaining, code):
    """The client's deadline fires on its side first and it cancels the call: that cancel reached the router with
    6.5 ms of the router's copy of the deadline left (a SIGSTOPped target, demo pair), and was counted CANCELLED."""
    from router.server import _ended
    assert _ended(Ended(remaining)) == code


def test_a_request_that_gives_up_says_which_target_did_not_recover_and_what_it_failed_with(capsys):
    async def body(service):
        stream = service.stub.GenerateStream(plain(1000))
        await kill_mid_stream(service, stream)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await rest_of(stream)
        service.restarter.allow()
        await until(lambda: service.client.state == "ready")
        return error.value
    error = run(body, target_recovery_s=0.5)
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert error.details().startswith("target 0 did not recover within router.target_recovery_s = 0.5 s "
                                      "(it failed with: UNAVAILABLE: ")
    log = capsys.readouterr().out
    assert "target 0 failed (UNAVAILABLE: " in log and "tearing its group down and restarting it" in log
    assert log.count("requests waiting for target 0 give up") == 1
    assert "target 0 is back, at 127.0.0.1:" in log and "1 request(s) gave up meanwhile" in log


def test_a_long_run_waits_the_full_recovery_bound_again_for_a_second_outage(capsys):
    """A decode run's deadline to give up was set by its first outage and never reset: a second failure more than
    router.target_recovery_s later gave up at once, saying the target 'did not recover within 0.5 s'."""
    async def body(service):
        stream = service.stub.GenerateStream(plain(1024))          # one run of 1024 steps of >= 1 ms
        await kill_mid_stream(service, stream)
        service.restarter.allow()
        await until(lambda: service.client.state == "ready")
        await stream.read()                              # the run goes on after the first recovery
        await asyncio.sleep(0.6)                         # past the first outage's bound, not yet at the run's end
        await service.restarter.started[-1].kill()       # its recovery is allowed already: back at once
        chunks = await rest_of(stream)
        return len(service.restarter.started), chunks[-1].finish_reason
    restarts, finish = run(body, target_recovery_s=0.5, speculation={"decode_steps": 1024})
    assert restarts == 2 and finish
    assert "give up" not in capsys.readouterr().out


@pytest.mark.parametrize("error, expired, code, detail", [
    (GaveUp(grpc.StatusCode.DEADLINE_EXCEEDED, "target 0 was down and had not recovered (it failed with: X)"), True,
     "DEADLINE_EXCEEDED", "deadline exceeded: target 0 was down and had not recovered (it failed with: X)"),
    (GaveUp(grpc.StatusCode.DEADLINE_EXCEEDED, "target 0 was down and had not recovered (it failed with: X)"), False,
     "DEADLINE_EXCEEDED", "deadline exceeded: target 0 was down and had not recovered (it failed with: X)"),
    (rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "no answer within 0.00519s"), True,      # what the deadline left
     "DEADLINE_EXCEEDED", "deadline exceeded: the client's deadline passed during a worker call"),
    (rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused"), True,
     "DEADLINE_EXCEEDED", "deadline exceeded while waiting for a worker (connection refused)"),
    (GaveUp(grpc.StatusCode.UNAVAILABLE, "target 0 did not recover within router.target_recovery_s = 60 s (...)"),
     False, "UNAVAILABLE", "target 0 did not recover within router.target_recovery_s = 60 s (...)"),
    (rpc_error(grpc.StatusCode.INTERNAL, "boom"), False, "UNAVAILABLE", "a worker failed: INTERNAL: boom")])
def test_a_failed_requests_detail_matches_its_status(error, expired, code, detail):
    """A request whose deadline passed while its target was down got DEADLINE_EXCEEDED "a worker failed: ...";
    one that gave up after router.target_recovery_s, the stale transport error of its last call."""
    assert worker_failure(error, expired) == (code, detail)


def test_a_stalled_target_is_logged_as_timed_out_after_the_worker_timeout(capsys):
    async def body(service):
        service.target.stalled = True
        stream = service.stub.GenerateStream(plain(50))
        await until(lambda: service.client.state == "down")
        service.restarter.allow()
        return sum([len(chunk.token_ids) async for chunk in stream])
    assert run(body, worker_timeout_s=0.5) == 50
    log = capsys.readouterr().out
    assert ("target 0 failed (DEADLINE_EXCEEDED: no answer within router.worker_timeout_s = 0.5 s): tearing its "
            "group down") in log
    assert log.count("target 0 failed") == 1 and "target 0 is back" in log


def test_refusals_are_logged_at_once_then_at_most_every_interval_and_a_bursts_count_within_it(capsys, monkeypatch):
    """The refusals after the first of a burst were only counted, and told at the next refusal at least 10 s later:
    a burst that ended was never told, and its count folded into a line much later."""
    monkeypatch.setattr(Shedding, "INTERVAL_S", 0.3)

    async def body(service):
        router = service.router
        async with router.admission():
            waiting = asyncio.ensure_future(router.admission().__aenter__())
            await asyncio.sleep(0.01)
            queued = (router.status()["queued_requests"], router.metrics.registry.get_sample_value("specpool_queued_requests"))
            for _ in range(3):
                with pytest.raises(Overloaded):
                    async with router.admission():
                        pass
            await asyncio.sleep(0.6)                    # the burst is over: its count is told when the interval ends
        await waiting
        return queued
    assert run(body, max_active_requests=1, max_queued_requests=1) == (1, 1)
    lines = [line for line in capsys.readouterr().out.splitlines() if "refused with RESOURCE_EXHAUSTED" in line]
    assert len(lines) == 2
    assert "overloaded: 1 request(s) refused with RESOURCE_EXHAUSTED (1 request running and 1 queued)" in lines[0]
    assert "overloaded: 2 request(s) refused with RESOURCE_EXHAUSTED in the last 0.3 s (" in lines[1]


def test_a_reserved_place_counts_until_its_request_enters_admission_or_gives_it_back():
    """Router.reserve (a background response's place, taken when it is sent): it fills the last slot for any other
    request until its own enters admission with it; given back unused (or twice), the place is free again."""
    async def body(service):
        router = service.router
        first = router.reserve()
        with pytest.raises(Overloaded):
            router.reserve()
        with pytest.raises(Overloaded):
            async with router.admission():
                pass
        async with router.admission(first):
            with pytest.raises(Overloaded):
                router.reserve()
        first.release()                         # taken by its request already: nothing to give back
        second = router.reserve()
        second.release()
        second.release()
        async with router.admission():
            pass
        return router.reserved, router.queued, router.running
    assert run(body, max_active_requests=1, max_queued_requests=0) == (0, 0, 0)


def test_a_draining_service_answers_health_checks_refuses_new_requests_and_finishes_the_one_in_flight(capsys):
    """Service.stop (SIGTERM): the public port stays open while requests drain, so a health check reads
    NOT_SERVING (it got UNAVAILABLE 'Connection refused' 0.5 s after SIGTERM: grpc's server.stop(grace) stops
    accepting connections at once); a new request gets UNAVAILABLE 'shutting down'; the one in flight finishes."""
    from router.service import Service

    async def body(service):
        running = Service(service.router.config)
        running.server, running.health, running.router = service.server, service.health, service.router
        stream = service.stub.GenerateStream(plain(1000))
        await stream.read()
        stopping = asyncio.ensure_future(running.stop(grace=30))
        await until(lambda: service.router.draining)
        during = await health(service)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await service.stub.Generate(plain(2), timeout=5)
        tokens = 1 + sum(len(chunk.token_ids) for chunk in await rest_of(stream))
        await stopping
        return during, refused.value, tokens
    during, refused, tokens = run(body)
    assert during == NOT_SERVING
    assert (refused.code(), refused.details()) == (grpc.StatusCode.UNAVAILABLE, "specpool is shutting down")
    assert tokens >= 999
    log = capsys.readouterr().out
    assert "draining 1 request(s) (grace 30s)" in log and log.rstrip().endswith("[specpool] stopped")


def test_a_replica_a_reload_adds_that_does_not_answer_stays_out_failed_and_the_pool_serves_on(capsys):
    """A replica grown by a reload joins once it answers a first call; one whose channel cannot reach it (nothing
    listens at its address here; over TLS, a new node the certificate does not name) stays out, failed, with the
    error in status and the log, and health and requests stay on the replica that answers."""
    async def body(service):
        service.router._scale_up = lambda pool, count: [
            lambda: TargetClient("127.0.0.1:9", 5.0, name="target 1") for _ in range(count)]
        document = {"router": {"host": "127.0.0.1", "port": 0, "worker_timeout_s": 30.0},
                    "draft": {"method": "ngram"}, "target": {"replicas": 2}}
        await service.router.reload(document)
        answers = [chunk async for chunk in service.stub.GenerateStream(plain(8))]
        return service.router.status()["workers"]["target"], await health(service), answers
    workers, serving, answers = run(body)
    assert [worker["state"] for worker in workers] == ["ready", "failed"]
    assert workers[1]["error"].startswith("target 1 at 127.0.0.1:9 does not answer: UNAVAILABLE: ")
    assert serving == SERVING and sum(len(chunk.token_ids) for chunk in answers) == 8
    assert "target 1 did not load and stays out of the pool (restart to retry): target 1 at 127.0.0.1:9" \
        in capsys.readouterr().out
