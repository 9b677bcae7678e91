"""The target's engine in a process of its own (target.engine_process, target_worker/engine_process.py): the same
TargetServicer on an EngineProcess answers exactly what it answers with the engine on a thread, for verify calls,
decode runs alone and stepping together, and seeded sampling; a bad call is answered with its error and the
process goes on serving; a run withdrawn mid-way stops; a lost engine process fails its calls at once. The byte
pair, in-process (no Ray, no gRPC): the child is a real spawned process."""
import asyncio
import os
import signal

import pytest

from protos.specpool.v1 import generation_pb2, worker_pb2
from target_worker.engine_process import EngineProcess
from target_worker.server import TargetServicer
from target_worker.verifier import TargetEngine
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
