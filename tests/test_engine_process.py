"""The target's engine in a process of its own (target.engine_process, target_worker/engine_process.py): the same
TargetServicer on an EngineProcess answers exactly what it answers with the engine on a thread, for verify calls,
decode runs alone and stepping together, and seeded sampling; a bad call is answered with its error and the
process goes on serving; a run withdrawn mid-way stops; a lost engine process fails its calls at once. The byte
pair, in-process (no Ray, no gRPC; the child a real spawned process), then a service with it through Ray: greedy
output identical to the target alone, the two processes on their CPUs, and the engine's process killed
mid-request with the same tokens after."""
import asyncio
import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray

from protos.specpool.v1 import generation_pb2, worker_pb2
from settings.schema import ConfigError, config_from_dict
from target_worker.engine_process import EngineProcess
from target_worker.server import TargetServicer
from target_worker.verifier import TargetEngine
from tests.conftest import service_config
from tests.test_decode_run import PROMPT, decode, start


def build_engine(target: str, draft: str):
    return TargetEngine(target, draft)


@pytest.fixture(scope="module")
def engine(byte_pair):
    return TargetEngine(byte_pair[1], byte_pair[0])


def in_process(byte_pair, lost=None) -> EngineProcess:
    return EngineProcess(build_engine, (byte_pair[1], byte_pair[0]), on_lost=lost or (lambda: None))


async def served(byte_pair, **kwargs) -> TargetServicer:
    side = in_process(byte_pair)
    await side.started()
    return TargetServicer(side, 1, **kwargs)


def verify(session_id: int, position: int, new, drafts=(), temperature=0.0) -> worker_pb2.VerifyRequest:
    return worker_pb2.VerifyRequest(session_id=session_id, position=position, new_token_ids=new,
                                    draft_token_ids=drafts,
                                    sampling=generation_pb2.SamplingParams(temperature=temperature, top_p=1.0,
                                                                           seed=11))


async def rounds(servicer: TargetServicer, session_id: int, temperature: float) -> list[tuple]:
    """A session's start, then three verify calls with drafts (some accepted, some not): each verdict."""
    verdicts, new, position = [], PROMPT, 0
    for drafts in ([], [5, 9, 200], [1, 2], [77, 150, 42, 10]):
        answer = await servicer._submit(verify(session_id, position, new, drafts, temperature), None)
        verdicts.append((answer.num_accepted, answer.next_token_id))
        position += len(new) + answer.num_accepted
        new = [answer.next_token_id]
    return verdicts


def tokens(answers) -> list[int]:
    return [a.next_token_id for a in answers]


async def everything(servicer: TargetServicer) -> tuple:
    """Verify rounds (greedy and seeded), a run alone, three runs stepping together: what each answered."""
    greedy, sampled = await rounds(servicer, 1, 0.0), await rounds(servicer, 2, 0.9)
    alone = tokens(await decode(servicer, start(3, 0.9, steps=20)))
    together = await asyncio.gather(*(decode(servicer, start(10 + i, t, steps=s))
                                      for i, (t, s) in enumerate(((0.0, 7), (0.9, 15), (0.9, 30)))))
    return greedy, sampled, alone, [tokens(answers) for answers in together]


def test_an_engine_process_answers_what_the_engine_thread_does(byte_pair, engine):
    async def scenario():
        on_thread = await everything(TargetServicer(engine, 1, max_batch=4))
        servicer = await served(byte_pair, max_batch=4)
        stepped, together = [], servicer._side.together

        async def counted(runs):
            stepped.append(len(runs))
            return await together(runs)
        servicer._side.together = counted
        return on_thread, await everything(servicer), stepped, servicer._side.ask("batch_stats")
    on_thread, in_its_process, stepped, stats = asyncio.run(scenario())
    assert in_its_process == on_thread
    assert [len(run) for run in in_its_process[3]] == [7, 15, 30]
    assert stepped and max(stepped) == 3                   # the runs stepped together in the child
    assert stats["forward_passes"] > 0 and stats["max_batch"] == 3


def test_a_bad_call_is_answered_with_its_error_and_the_process_goes_on(byte_pair):
    async def scenario():
        servicer = await served(byte_pair)
        with pytest.raises(Exception) as failed:
            await servicer._submit(verify(5, 3, [1, 2]), None)          # a session the engine never started
        return failed.value, await rounds(servicer, 6, 0.0)
    error, verdicts = asyncio.run(scenario())
    assert "session" in str(error).lower() and len(verdicts) == 4


def test_a_withdrawn_run_stops_in_the_engine_process(byte_pair):
    """A 600-step run alone in the child, withdrawn after its first answers: the child hands back at its next step
    (the next call is answered at once, long before 600 steps would take)."""
    async def scenario():
        servicer, first = await served(byte_pair), asyncio.Event()
        run = asyncio.ensure_future(servicer._submit(start(20, 0.0, steps=600), lambda _: first.set()))
        await first.wait()
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        before = servicer._side.ask("batch_stats")["forward_passes"]
        await rounds(servicer, 21, 0.0)
        return before, servicer._side.ask("batch_stats")["forward_passes"]
    before, after = asyncio.run(scenario())
    assert before < 100 and after - before < 20


def test_a_lost_engine_process_fails_its_calls_and_tells_the_worker(byte_pair):
    async def scenario():
        lost = []
        side = in_process(byte_pair, lambda: lost.append(True))
        await side.started()
        servicer = TargetServicer(side, 1)
        run = asyncio.ensure_future(servicer._submit(start(30, 0.0, steps=100000), lambda _: None))
        await asyncio.sleep(0.5)
        os.kill(side.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="engine process"):
            await asyncio.wait_for(run, 30)
        with pytest.raises(RuntimeError, match="engine process"):
            await servicer._submit(verify(31, 0, PROMPT), None)
        return lost
    assert asyncio.run(scenario()) == [True]


# Through Ray, gRPC and the router.

CPUS = sorted(os.sched_getaffinity(0))[:2] if hasattr(os, "sched_getaffinity") else []
LONG = 120


@pytest.fixture(scope="module")
def service(start_service, byte_pair):
    cpus = ({"target": {"engine_process": True, "cpus": CPUS[:1]}, "draft": {"cpus": CPUS[1:]}} if len(CPUS) == 2
            else {"target": {"engine_process": True}})
    return start_service(service_config(byte_pair, router={"target_recovery_s": 120.0}, **cpus))


def greedy(k: int, max_new: int = 24, prompt=(10, 200, 3, 77, 150, 42)):
    request = generation_pb2.GenerateRequest(prompt_token_ids=list(prompt), max_new_tokens=max_new)
    request.speculation.k = k
    return request


@pytest.mark.parametrize("k", [0, 1, 4])
def test_a_service_with_an_engine_process_is_identical_to_the_target_alone(service, reference_generate, k):
    expected = reference_generate([10, 200, 3, 77, 150, 42], 24)
    streamed = [t for chunk in service.stub.GenerateStream(greedy(k)) for t in chunk.token_ids]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda _: list(service.stub.Generate(greedy(k)).token_ids), range(4)))
    assert streamed == expected and together == [expected] * 4


@pytest.mark.skipif(len(CPUS) != 2, reason="needs two CPUs and Linux's CPU affinity")
def test_the_engine_process_has_the_targets_cpu_and_the_grpc_process_the_other(service):
    rank = service.service.pools.target_actors[0][0]
    grpc_pid, engine_pid = ray.get([rank.pid.remote(), rank.engine_pid.remote()])
    affinity = lambda pid: {frozenset(os.sched_getaffinity(int(t))) for t in os.listdir(f"/proc/{pid}/task")}  # noqa
    assert engine_pid != grpc_pid
    assert affinity(engine_pid) == {frozenset(CPUS[:1])} and affinity(grpc_pid) == {frozenset(CPUS[1:])}


def test_the_engine_process_killed_mid_request_gives_identical_tokens(service, reference_generate):
    """SIGKILL the engine's process mid-stream: its worker exits with it, Ray restarts the worker, and the router
    goes on (re-prefilling on the new one) with the same tokens."""
    rank = service.service.pools.target_actors[0][0]
    engine_pid, chunks = ray.get(rank.engine_pid.remote()), []
    for chunk in service.stub.GenerateStream(greedy(3, LONG), timeout=180):
        chunks.append(chunk)
        if len(chunks) == 5:
            os.kill(engine_pid, signal.SIGKILL)
    assert [t for chunk in chunks for t in chunk.token_ids] == reference_generate([10, 200, 3, 77, 150, 42], LONG)
    assert ray.get(rank.engine_pid.remote()) != engine_pid          # a new worker, with an engine process of its own


@pytest.mark.parametrize("target, message", [
    ({"engine_process": True, "tensor_parallel_size": 2}, "target.engine_process: a tensor-parallel group's ranks"),
    ({"engine_process": "yes"}, "target.engine_process: must be bool (got 'yes')"),
])
def test_an_engine_process_the_config_cannot_have_is_refused_naming_the_key(target, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        config_from_dict({"target": target})
