"""Decode runs on the target worker (VerifyRequest.decode_steps, the K = 0 path): one call decodes several tokens
and answers each as it is sampled. A run commits exactly what that many plain K = 0 calls would (greedy and
seeded sampling), ends at a stop token, batches with other sessions' calls while they wait, and stops stepping
once withdrawn. The real TargetServicer and TargetEngine on the byte pair, in-process (no Ray, no gRPC)."""
import asyncio

import pytest

from protos.specpool.v1 import generation_pb2, worker_pb2
from target_worker.server import TargetServicer
from target_worker.verifier import TargetEngine

PROMPT = [10, 200, 3, 77, 150, 42]
STEPS = 12


@pytest.fixture(scope="module")
def engine(byte_pair):
    return TargetEngine(byte_pair[1], byte_pair[0])


def start(session_id: int, temperature: float, steps: int = STEPS, stops=()) -> worker_pb2.VerifyRequest:
    sampling = generation_pb2.SamplingParams(temperature=temperature, top_p=1.0, seed=7)
    return worker_pb2.VerifyRequest(session_id=session_id, position=0, new_token_ids=PROMPT, sampling=sampling,
                                    decode_steps=steps, stop_token_ids=stops)


async def decode(servicer: TargetServicer, request) -> list[worker_pb2.VerifyResponse]:
    """Every answer of a decode run, in the order the stream would send them."""
    answers = []
    last = await servicer._submit(request, answers.append)
    await asyncio.sleep(0)                    # answers emitted from the engine thread land on the loop
    return answers + [last]


async def plain_calls(servicer: TargetServicer, request, n: int) -> list[int]:
    """The tokens of n K = 0 calls, one call each (what the router sent before decode runs)."""
    tokens, request = [], worker_pb2.VerifyRequest(**{**{f.name: v for f, v in request.ListFields()},
                                                      "decode_steps": 0})
    for _ in range(n):
        answer = await servicer._submit(request, None)
        tokens.append(answer.next_token_id)
        request = worker_pb2.VerifyRequest(session_id=request.session_id, new_token_ids=[answer.next_token_id],
                                           position=request.position + len(request.new_token_ids))
    return tokens


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "seeded-sampled"])
def test_a_run_commits_what_that_many_plain_calls_would(engine, temperature):
    async def scenario():
        servicer = TargetServicer(engine, 1)
        answers = await decode(servicer, start(1, temperature))
        return answers, await plain_calls(servicer, start(2, temperature), STEPS)
    answers, plain = asyncio.run(scenario())
    assert [a.next_token_id for a in answers] == plain
    assert [a.more for a in answers] == [True] * (STEPS - 1) + [False]
    assert all(a.compute_us > 0 and a.handler_us >= a.compute_us for a in answers)


def test_a_run_ends_after_a_stop_token(engine):
    async def scenario():
        servicer = TargetServicer(engine, 1)
        full = [a.next_token_id for a in await decode(servicer, start(3, 0.0))]
        stop = full[4]
        cut = await decode(servicer, start(4, 0.0, stops=[stop]))
        return full, stop, cut
    full, stop, cut = asyncio.run(scenario())
    assert [a.next_token_id for a in cut] == full[:full.index(stop) + 1] and not cut[-1].more


def test_runs_batch_with_each_other_and_match_themselves_alone(engine):
    async def scenario():
        servicer = TargetServicer(engine, 1, max_batch=4)
        alone = [await decode(servicer, start(10 + i, 0.9)) for i in range(3)]
        before = engine.stats.as_dict()
        together = await asyncio.gather(*(decode(servicer, start(20 + i, 0.9)) for i in range(3)))
        after = engine.stats.as_dict()
        return alone, together, after["rows"] - before["rows"], after["forward_passes"] - before["forward_passes"]
    alone, together, rows, passes = asyncio.run(scenario())
    tokens = lambda answers: [a.next_token_id for a in answers]   # noqa: E731
    assert [tokens(a) for a in together] == [tokens(a) for a in alone]
    assert rows == 3 * STEPS and passes < rows                   # steps of different runs shared forwards


def test_a_withdrawn_run_stops_stepping(engine):
    async def scenario():
        servicer = TargetServicer(engine, 1)
        first = asyncio.Event()
        run = asyncio.ensure_future(servicer._submit(start(30, 0.0, steps=400), lambda _: first.set()))
        await first.wait()
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        await asyncio.sleep(0.3)
        held = engine.sessions._sessions[30].length
        await asyncio.sleep(0.3)
        return held, engine.sessions._sessions[30].length
    held, later = asyncio.run(scenario())
    assert held == later < len(PROMPT) + 400 // 2


def tokens_of(answers) -> list[int]:
    return [t for a in answers for t in list(a.draft_token_ids[:a.num_accepted]) + [a.next_token_id]]


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "seeded-sampled"])
def test_a_run_that_looks_up_its_own_drafts_commits_what_plain_decoding_would(engine, temperature):
    """Prompt-lookup drafts are verified as a deterministic draft's (q one-hot, coupled to plain decoding), so a
    run that looks up its drafts commits plain decoding's tokens, exactly its token budget of them."""
    def request(session_id: int, lookup: bool) -> worker_pb2.VerifyRequest:
        call = start(session_id, temperature, steps=40)
        call.new_token_ids[:] = PROMPT * 3                     # a context that repeats: lookup always matches
        if lookup:
            call.lookup.min_n, call.lookup.max_n, call.lookup.max_tokens = 1, 3, 6
        return call

    async def scenario():
        servicer = TargetServicer(engine, 1)
        return await decode(servicer, request(40, False)), await decode(servicer, request(41, True))
    plain, looked_up = asyncio.run(scenario())
    assert tokens_of(looked_up) == tokens_of(plain) and len(tokens_of(plain)) == 40
    assert sum(len(a.draft_token_ids) for a in looked_up) > 0
    assert all(len(a.draft_token_ids) <= 6 for a in looked_up) and not looked_up[-1].more
    if temperature == 0.0:                                     # a random model's greedy output cycles: drafts hit
        assert len(looked_up) < len(plain)
