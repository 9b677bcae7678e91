"""Staged rounds on the target worker (VerifyRequest.staged, target_worker/staging.py): a call sent while the
target still verifies a round, naming the next round's drafts for the verdicts a pre-draft guessed. The real
TargetServicer and TargetEngine on the byte pair, in-process (no Ray, no gRPC): the candidate that guessed the
verdict is verified exactly as the call the router would have sent after seeing it (greedy and seeded sampled,
with logprobs), a verdict no candidate guessed verifies nothing, and staged rounds chain."""
import asyncio

import pytest

from protos.specpool.v1 import generation_pb2, worker_pb2
from target_worker.server import TargetServicer
from target_worker.verifier import TargetEngine

PROMPT = [10, 200, 3, 77, 150, 42]
DRAFTS = [[5, 9, 250], [17, 4], [88, 1, 2, 3]]          # each round's drafts (arbitrary: mostly rejected)


@pytest.fixture(scope="module")
def engine(byte_pair):
    return TargetEngine(byte_pair[1], byte_pair[0])


def first(session_id: int, temperature: float) -> worker_pb2.VerifyRequest:
    sampling = generation_pb2.SamplingParams(temperature=temperature, top_p=1.0, seed=11)
    return worker_pb2.VerifyRequest(session_id=session_id, position=0, new_token_ids=PROMPT, sampling=sampling,
                                    draft_token_ids=DRAFTS[0], top_logprobs=2)


def after(request: worker_pb2.VerifyRequest, verdict, drafts: list[int]) -> worker_pb2.VerifyRequest:
    """The call the router sends once it has seen `verdict`: what it committed, then the next drafts."""
    held = request.position + len(request.new_token_ids)
    return worker_pb2.VerifyRequest(session_id=request.session_id, position=held + verdict.num_accepted,
                                    new_token_ids=[verdict.next_token_id], draft_token_ids=drafts, top_logprobs=2)


def staged(session_id: int, position: int, candidates: list[tuple[int, int, list[int]]]) -> worker_pb2.VerifyRequest:
    return worker_pb2.VerifyRequest(session_id=session_id, position=position, top_logprobs=2, staged=worker_pb2.StagedRound(
        candidates=[worker_pb2.StagedDrafts(num_accepted=a, next_token_id=t, draft_token_ids=d) for a, t, d in candidates]))


def verdict_of(answer: worker_pb2.VerifyResponse) -> tuple:
    return answer.num_accepted, answer.next_token_id, [(e.token_id, round(e.logprob, 5)) for e in answer.logprobs]


async def plain_rounds(servicer: TargetServicer, request) -> list[worker_pb2.VerifyResponse]:
    """Every round of DRAFTS, each call sent after the verdict before it (the router without staging)."""
    answers = [await servicer._submit(request, None)]
    for drafts in DRAFTS[1:]:
        request = after(request, answers[-1], drafts)
        answers.append(await servicer._submit(request, None))
    return answers


def decoys(verdict, drafts) -> list[tuple[int, int, list[int]]]:
    """Candidates guessing other verdicts than `verdict`, then the one guessing it."""
    return [(verdict.num_accepted, (verdict.next_token_id + 1) % 257, [1, 2]),
            (verdict.num_accepted + 1, verdict.next_token_id, [3]), (verdict.num_accepted, verdict.next_token_id,
                                                                       drafts)]


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "seeded-sampled"])
def test_staged_rounds_verify_what_the_router_would_have_sent_after_each_verdict(engine, temperature):
    """Each round's staged call goes out as the router sends it: once the verdict two rounds back is in (the round
    it follows has just started on the target), with each verdict's candidates known in advance from a session run
    without staging. The target answers every round as the plain calls did, starting each staged round itself,
    after a plain round and after a staged one."""
    async def scenario():
        servicer = TargetServicer(engine, 1)
        plain = await plain_rounds(servicer, first(1, temperature))
        calls = [asyncio.ensure_future(servicer._submit(first(2, temperature), None))]
        held = len(PROMPT)
        for verdict, drafts in zip(plain, DRAFTS[1:]):
            if len(calls) > 1:
                await calls[-2]
            calls.append(asyncio.ensure_future(servicer._submit(staged(2, held, decoys(verdict, drafts)), None)))
            held += verdict.num_accepted + 1
        return plain, await asyncio.gather(*calls)
    plain, answers = asyncio.run(scenario())
    assert [verdict_of(a) for a in answers] == [verdict_of(p) for p in plain]
    assert not any(a.missed for a in answers)


def test_a_verdict_no_candidate_guessed_verifies_nothing(engine):
    """The staged call answers `missed` and leaves the session as the verdict left it: the router's own call
    after the verdict then answers as it would have without the staged call."""
    async def scenario():
        servicer = TargetServicer(engine, 1)
        plain = await plain_rounds(servicer, first(3, 0.0))
        request = first(4, 0.0)
        verifying = asyncio.ensure_future(servicer._submit(request, None))
        wrong = [(plain[0].num_accepted, (plain[0].next_token_id + 1) % 257, DRAFTS[1])]
        missed = await servicer._submit(staged(4, len(PROMPT), wrong), None)
        verdict = await verifying
        own = await servicer._submit(after(request, verdict, DRAFTS[1]), None)
        unknown = await servicer._submit(staged(4, 999, wrong), None)      # no round starts there
        return plain, missed, own, unknown
    plain, missed, own, unknown = asyncio.run(scenario())
    assert missed.missed and not missed.logprobs and unknown.missed
    assert verdict_of(own) == verdict_of(plain[1])


def test_a_staged_call_that_comes_after_its_verdict_still_follows_it(engine):
    async def scenario():
        servicer = TargetServicer(engine, 1)
        plain = await plain_rounds(servicer, first(5, 0.9))
        verdict = await servicer._submit(first(6, 0.9), None)
        late = await servicer._submit(staged(6, len(PROMPT), decoys(verdict, DRAFTS[1])), None)
        return plain, late
    plain, late = asyncio.run(scenario())
    assert verdict_of(late) == verdict_of(plain[1])


class SlowTarget:
    """The demo target engine with each verify `delay` seconds longer (a target whose pass outlasts a pre-draft,
    as a large model's does): every pre-draft is back before its verdict, so it is staged."""

    def __init__(self, engine, delay: float):
        self._engine, self._delay = engine, delay

    def verify_batch(self, requests):
        import time
        time.sleep(self._delay)
        return self._engine.verify_batch(requests)

    def __getattr__(self, name):
        return getattr(self._engine, name)


async def serve_loop(draft_engine, target_engine, policy, prompt: list[int], max_new: int,
                     sampling: generation_pb2.SamplingParams | None = None, mode: int = worker_pb2.DRAFT_MODE_GREEDY,
                     draft_channel=None, stop_draft_after: int | None = None):
    """The router's loop (router.speculation.generate) over real gRPC workers on 127.0.0.1: its request, with
    `waiting_on_target` set to the handed-off calls still waiting on the target at the end (tests/test_hand_off.py).
    `draft_channel`: how the draft worker dials the target for handoffs; the draft server stops after
    `stop_draft_after` rounds."""
    from draft_worker.server import DraftServicer
    from engine.worker_server import start_server
    from protos.specpool.v1 import worker_pb2_grpc
    from router.request_state import RequestState
    from router.speculation import generate, releases_done
    from router.worker_client import DraftClient, TargetClient
    draft_server, draft_address = await start_server(
        worker_pb2_grpc.add_DraftWorkerServicer_to_server,
        DraftServicer(draft_engine, **({"channel": draft_channel} if draft_channel else {})), "127.0.0.1")
    target_servicer = TargetServicer(target_engine, 1)
    target_server, target_address = await start_server(worker_pb2_grpc.add_TargetWorkerServicer_to_server,
                                                        target_servicer, "127.0.0.1")
    draft, target = DraftClient(draft_address), TargetClient(target_address)
    state = RequestState(session_id=9, tokens=list(prompt), prompt_len=len(prompt), max_new_tokens=max_new,
                         sampling=sampling or generation_pb2.SamplingParams(top_p=1.0), fixed_k=None,
                         draft_mode=mode, max_context=0)
    try:
        async for _ in generate(state, draft, target, policy):
            if len(policy.rounds) == stop_draft_after:
                await draft_server.stop(None)
        await releases_done()
        state.waiting_on_target = sum(not f.done() for f in target_servicer._handoffs._handoffs.values())
    finally:
        for client in (draft, target):
            await client.close()
        for server in (draft_server, target_server):
            await server.stop(None)
    return state


@pytest.mark.parametrize("branches", [0, 3])
def test_the_router_loop_over_grpc_takes_staged_rounds_and_stays_the_targets_greedy_output(demo_engines, branches):
    """Real draft and target servicers over gRPC, the target slower than a pre-draft: most hits are staged rounds
    (the target began them itself), and the tokens are the target's own greedy tokens, as in turn. (Whether a
    pre-draft is back before its verdict is timing: on a loaded machine a few are not, and are verified the usual
    way; tests/test_overlap.py checks with in-memory workers that every one staged in time is taken.)"""
    from tests.test_overlap import FixedK
    draft_engine, target_engine = demo_engines
    prompt, slow = [5, 9, 14, 200, 3, 77], SlowTarget(target_engine, 0.06)
    staged = asyncio.run(serve_loop(draft_engine, slow, FixedK(4, True, branches, stage=True), prompt, 40))
    in_turn = asyncio.run(serve_loop(draft_engine, slow, FixedK(4, False), prompt, 40))
    plain = asyncio.run(serve_loop(draft_engine, target_engine, FixedK(0, False), prompt, 40))
    assert staged.tokens == in_turn.tokens == plain.tokens
    assert staged.stats.predraft_hits > 2 and 2 * staged.stats.staged_rounds > staged.stats.predraft_hits


async def unary_verify(engine, refused: worker_pb2.VerifyRequest, served: worker_pb2.VerifyRequest) -> tuple:
    """Send `refused`, then `served`, on unary Verify to a TargetServicer on 127.0.0.1: (the first one's error, or
    None if it was answered; the second one's answer)."""
    import grpc

    from engine.worker_server import start_server
    from protos.specpool.v1 import worker_pb2_grpc
    server, address = await start_server(worker_pb2_grpc.add_TargetWorkerServicer_to_server,
                                         TargetServicer(engine, 1), "127.0.0.1")
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.TargetWorkerStub(channel)
            try:
                await stub.Verify(refused)
                error = None
            except grpc.aio.AioRpcError as exc:
                error = exc
            return error, await stub.Verify(served)
    finally:
        await server.stop(None)


def test_a_staged_call_on_unary_verify_is_refused_naming_the_field_and_the_server_keeps_serving(engine):
    """A staged round follows a call on the same stream, so unary Verify refuses one (INVALID_ARGUMENT naming
    `staged`) instead of verifying nothing at its position; the next call is served."""
    import grpc
    refused, served = asyncio.run(unary_verify(engine, staged(8, len(PROMPT), [(0, 1, [2])]), first(8, 0.0)))
    assert refused is not None and refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.details().startswith("staged:")
    assert not served.missed and served.compute_us > 0
