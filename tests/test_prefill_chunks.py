"""Chunked prefill (`*.prefill_chunk_tokens`, engine/prefill_chunks.py): a call with more new tokens than a chunk
runs as several forwards, each its own trip through the worker's Batcher. On the target, its verdict, its cache and
everything after are identical to the prompt in one forward (greedy and seeded sampling, drafts included, the
prefix cache too); other calls run between its chunks; a decode run that starts with a long prompt commits what it
would unchunked. On the draft, its drafts (greedy and sampled, with pre-draft branches) and the next call's are
those of one forward. The real engines and servicers on the byte pair, in process (no Ray, no gRPC); the whole
stack with chunks is in tests/test_e2e_greedy.py."""
import asyncio

import pytest
import torch

from protos.specpool.v1 import generation_pb2, worker_pb2
from engine.prefill_chunks import Prefilled
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
        servicer = TargetServicer(engines(CHUNK, prefix=1024), 1)
        return await servicer._submit(start(3, 0.0, prompt=PROMPT + [9] * 40), None)
    third = asyncio.run(served())
    assert (third.prefix_cache.looked_up, third.prefix_cache.found) == (130, 0)


def test_calls_waiting_beside_a_long_prompt_run_between_its_chunks(engines):
    """A call submitted with a 120-token start is answered beside its first chunk, not after all four."""
    async def scenario():
        engine = engines(CHUNK)
        servicer, order = TargetServicer(engine, 1, max_batch=4), []
        await servicer._submit(start(1, 0.0, prompt=PROMPT[:10]), None)
        async def call(name, request):
            await servicer._submit(request, None)
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


def hidden(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.float32) if raw else torch.zeros(0)


@pytest.mark.parametrize("mode", [worker_pb2.DRAFT_MODE_GREEDY, worker_pb2.DRAFT_MODE_SAMPLED], ids=["greedy", "sampled"])
def test_a_chunked_start_on_the_draft_drafts_what_one_forward_would(byte_pair, mode):
    from draft_worker.proposer import DraftEngine
    from draft_worker.server import DraftServicer

    def calls(session_id: int) -> list[worker_pb2.ProposeRequest]:
        sampling = generation_pb2.SamplingParams(temperature=0.9, top_p=1.0, seed=5)
        branch = worker_pb2.BranchPoint(at=len(PROMPT) - 2, token_id=9)       # a pre-draft branch inside the prompt
        return [worker_pb2.ProposeRequest(session_id=session_id, position=0, new_token_ids=PROMPT, k=4, mode=mode,
                                          sampling=sampling, runner_ups=True, branches=[branch]),
                worker_pb2.ProposeRequest(session_id=session_id, position=len(PROMPT) + 2, new_token_ids=[7], k=3,
                                          mode=mode)]

    async def drafts(chunk: int) -> list:
        engine = DraftEngine(byte_pair[0], prefill_chunk_tokens=chunk)
        servicer = DraftServicer(engine)
        answers = [await servicer._propose(call) for call in calls(1)]
        return [(list(a.draft_token_ids), list(a.runner_up_token_ids), [list(b.token_ids) for b in a.branch_drafts],
                 hidden(a.draft_hidden_states), [hidden(b.hidden_states) for b in a.branch_drafts])
                for a in answers], engine.stats.forward_passes
    (chunked, passes), (plain, plain_passes) = asyncio.run(drafts(CHUNK)), asyncio.run(drafts(0))
    assert [answer[:3] for answer in chunked] == [answer[:3] for answer in plain]
    assert chunked[0][2] and passes == plain_passes + 2               # 90 tokens: 32 + 32, then 26 with the drafts
    for ours, theirs in zip(chunked, plain):                          # sampled mode's hidden states, up to rounding
        for a, b in zip([ours[3], *ours[4]], [theirs[3], *theirs[4]]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    engine = DraftEngine(byte_pair[0], prefill_chunk_tokens=CHUNK)
    assert isinstance(engine.propose(calls(2)[0]), Prefilled)
