"""Chunked prefill on the target (`target.prefill_chunk_tokens`, target_worker/prefill_chunks.py): a call with more
new tokens than a chunk runs as several forwards, each its own trip through the Batcher. Its verdict, its cache and
everything after are identical to the prompt in one forward (greedy and seeded sampling, drafts included, the
prefix cache too); other calls run between its chunks; a decode run that starts with a long prompt commits what it
would unchunked. The real TargetEngine and TargetServicer on the byte pair, in process (no Ray, no gRPC); the whole
stack with chunks is in tests/test_e2e_greedy.py."""
import asyncio

import pytest

from protos.specpool.v1 import generation_pb2, worker_pb2
from target_worker.prefill_chunks import Prefilled
from target_worker.server import TargetServicer
from target_worker.verifier import TargetEngine

PROMPT = [(37 * i + 11) % 250 + 3 for i in range(90)]
DRAFTS = [5, 77, 120]
CHUNK = 32


def start(session_id: int, temperature: float, prompt=PROMPT, **fields) -> worker_pb2.VerifyRequest:
    sampling = generation_pb2.SamplingParams(temperature=temperature, top_p=1.0, seed=11)
    return worker_pb2.VerifyRequest(session_id=session_id, position=0, new_token_ids=prompt, sampling=sampling,
                                    **fields)


def whole(engine: TargetEngine, request) -> tuple[worker_pb2.VerifyResponse, list[int]]:
    """A call's verdict, each Prefilled answer's rest submitted again; and the positions the chunks ended at."""
    ends, answer = [], engine.verify(request)
    while isinstance(answer, Prefilled):
        ends.append(answer.rest.position)
        answer = engine.verify(answer.rest)
    return answer, ends


def rounds(engine: TargetEngine, session_id: int, first: worker_pb2.VerifyResponse, n: int = 4) -> list[tuple]:
    """n more rounds after a start (drafts after the committed token), their verdicts."""
    verdicts, position, token = [], len(PROMPT) + first.num_accepted, first.next_token_id
    for _ in range(n):
        answer = engine.verify(worker_pb2.VerifyRequest(session_id=session_id, position=position,
                                                        new_token_ids=[token], draft_token_ids=DRAFTS))
        verdicts.append((answer.num_accepted, answer.next_token_id))
        position, token = position + 1 + answer.num_accepted, answer.next_token_id
    return verdicts


@pytest.fixture(scope="module")
def engines(byte_pair):
    draft, target = byte_pair
    return lambda chunk, prefix=0: TargetEngine(target, draft, prefix_cache_tokens=prefix, prefill_chunk_tokens=chunk)


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "seeded-sampled"])
def test_a_chunked_start_gets_the_verdict_and_cache_of_one_forward(engines, temperature):
    chunked, plain = engines(CHUNK), engines(0)
    answer, ends = whole(chunked, start(1, temperature, draft_token_ids=DRAFTS))
    expected, none = whole(plain, start(1, temperature, draft_token_ids=DRAFTS))
    assert ends == [32, 64] and none == []                   # 90 tokens: 32 + 32 + 26 with the drafts
    assert (answer.num_accepted, answer.next_token_id) == (expected.num_accepted, expected.next_token_id)
    assert chunked.stats.forward_passes == 3 and plain.stats.forward_passes == 1
    assert rounds(chunked, 1, answer) == rounds(plain, 1, expected)      # the caches hold the same


def test_a_chunked_start_caches_its_prefix_and_reports_its_lookup(engines):
    engine = engines(CHUNK, prefix=1024)
    first, _ = whole(engine, start(1, 0.0))
    second, ends = whole(engine, start(2, 0.0))
    assert ends == [] and second.next_token_id == first.next_token_id    # 80 cached: the other 10 in one chunk
    assert (second.prefix_cache.looked_up, second.prefix_cache.found) == (90, 80)
    async def served():                                       # the servicer puts the start's lookup on the verdict
        return await TargetServicer(engines(CHUNK, prefix=1024), 1)._whole(start(3, 0.0, prompt=PROMPT + [9] * 40))
    third = asyncio.run(served())
    assert (third.prefix_cache.looked_up, third.prefix_cache.found) == (130, 0)


def test_calls_waiting_beside_a_long_prompt_run_between_its_chunks(engines):
    """A call submitted with a 120-token start is answered beside its first chunk, not after all four."""
    async def scenario():
        engine = engines(CHUNK)
        servicer, order = TargetServicer(engine, 1, max_batch=4), []
        await servicer._whole(start(1, 0.0, prompt=PROMPT[:10]))
        async def call(name, request):
            await servicer._whole(request)
            order.append((name, engine.stats.forward_passes))
        short = worker_pb2.VerifyRequest(session_id=1, position=10, new_token_ids=[4])
        long = start(2, 0.0, prompt=PROMPT + PROMPT[:30])
        await asyncio.gather(call("long", long), call("short", short))
        return order
    order = asyncio.run(scenario())
    # forwards: the short start, then the long prompt's first chunk and the call (2), then its 3 other chunks
    assert order == [("short", 3), ("long", 6)]


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "seeded-sampled"])
def test_a_decode_run_that_starts_with_a_long_prompt_commits_what_it_would_unchunked(engines, temperature):
    async def run(engine):
        answers = []
        last = await TargetServicer(engine, 1)._submit(start(1, temperature, decode_steps=12), answers.append)
        await asyncio.sleep(0)
        return [a.next_token_id for a in answers + [last]]
    chunked = asyncio.run(run(engines(CHUNK)))
    assert len(chunked) == 12 and chunked == asyncio.run(run(engines(0)))


def test_a_chunk_runs_with_the_session_starts_not_beside_the_decode_rows(engines):
    """A long prompt's later chunk (position > 0, many tokens) never pads a decode row: its own forward."""
    engine = engines(CHUNK)
    engine.verify(start(1, 0.0, prompt=PROMPT[:10]))
    rest = engine.verify(start(2, 0.0)).rest
    results = engine.verify_batch([worker_pb2.VerifyRequest(session_id=1, position=10, new_token_ids=[4]), rest])
    assert isinstance(results[1], Prefilled) and results[0].batch_tokens == 1 and results[0].batch_size == 1


def test_eviction_passes_over_a_session_mid_prefill_and_a_batch_that_evicts_it_holds_it_again(engines):
    from engine.sessions import PREFILL_STALE_OPENS, Session, SessionStore
    from engine.sampling import Sampling
    store = SessionStore(2)
    first = store.open(1, 0, Sampling())
    store.open(2, 0, Sampling())
    first.chunked = True
    store.open(3, 0, Sampling())                          # evicts 2, the least recently used not mid-prefill
    assert sorted(store._sessions) == [1, 3]
    for session_id in range(10, 10 + PREFILL_STALE_OPENS):  # that many sessions opened since: its caller is gone
        store.open(session_id, 0, Sampling())
    assert 1 not in store._sessions and len(store) == 2
    evicted = Session(sampling=Sampling())
    store.hold(5, evicted)
    assert store._sessions[5] is evicted
    # a batch of four long starts on a worker holding two sessions: each goes on through its chunks
    engine = engines(CHUNK)
    engine.sessions = SessionStore(2)
    answers = engine.verify_batch([start(i, 0.0, prompt=PROMPT[i:]) for i in range(4)])
    while any(isinstance(answer, Prefilled) for answer in answers):
        answers = [engine.verify(a.rest) if isinstance(a, Prefilled) else a for a in answers]
    assert all(isinstance(answer, worker_pb2.VerifyResponse) for answer in answers)
