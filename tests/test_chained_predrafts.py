"""Chained pre-drafts (speculation.chain_predrafts, ProposeRequest.then): a round that drafts now tells the draft
worker its pre-draft too, and the worker starts it right after answering the drafts, with no router round trip
between. Real draft (and target) servicers over gRPC on 127.0.0.1, no Ray: the chained pre-draft is exactly the call
the router would have sent (tokens, choices, branches, a sampled draft's hidden states), so rounds that take it give
the target's own tokens, handed off or not; unary Propose refuses a chained call and goes on serving."""
import asyncio

import grpc
import pytest

from draft_worker.server import DraftServicer
from engine.worker_server import start_server
from protos.specpool.v1 import generation_pb2, worker_pb2, worker_pb2_grpc
from router.worker_client import DraftClient
from tests.test_overlap import FixedK
from tests.test_staged_rounds import SlowTarget, serve_loop

PROMPT = [5, 9, 14, 200, 3, 77]
BRANCHES = [(0, 0), (1, 0), (2, 0), (0, 1), (3, 1)]      # (j, rank 0 runner-up | 1 third choice)


def choices(answer) -> tuple:
    """What a draft answer (or branch) drafted: tokens, runner-ups, third choices, hidden states."""
    tokens = answer.draft_token_ids if hasattr(answer, "draft_token_ids") else answer.token_ids
    hidden = answer.draft_hidden_states if hasattr(answer, "draft_hidden_states") else answer.hidden_states
    return list(tokens), list(answer.runner_up_token_ids), list(answer.third_choice_token_ids), hidden


async def with_draft_server(engine, scenario):
    server, address = await start_server(worker_pb2_grpc.add_DraftWorkerServicer_to_server, DraftServicer(engine),
                                         "127.0.0.1")
    client = DraftClient(address)
    try:
        return await scenario(client, address)
    finally:
        await client.close()
        await server.stop(None)


@pytest.mark.parametrize("mode", [worker_pb2.DRAFT_MODE_GREEDY, worker_pb2.DRAFT_MODE_SAMPLED],
                         ids=["greedy", "sampled"])
def test_a_chained_call_answers_the_drafts_then_the_predraft_the_router_would_have_sent(demo_engines, mode):
    """Session 1 chains its pre-draft; session 2 sends the same drafts call and then the pre-draft the router
    builds from its answer (the held context, the last draft, K + 1 drafts, a branch per planned point). Both
    answer the same drafts and the same pre-draft, branch for branch."""
    sampling = generation_pb2.SamplingParams(temperature=0.9, top_p=1.0, seed=3)
    start = {"sampling": sampling}       # the session start's fields (RequestState.session_start)
    then = worker_pb2.ChainedPredraft(k=5, branch_at=[j for j, _ in BRANCHES], branch_rank=[r for _, r in BRANCHES])

    async def scenario(client, _):
        chained = [answer async for answer, _ in client.propose_chained(1, PROMPT, 0, 4, start, mode, 10.0, then)]
        drafts, _ = await client.propose(2, PROMPT, 0, 4, start, mode, 10.0, runner_ups=True)
        tokens, runner_ups, thirds, _ = choices(drafts)
        points = [(len(PROMPT) + j, (runner_ups, thirds)[rank][j]) for j, rank in BRANCHES]
        ahead, _ = await client.propose(2, PROMPT + tokens, len(PROMPT) + 3, 5, start, mode, 10.0,
                                        runner_ups=True, branches=points)
        return chained, drafts, ahead
    chained, drafts, ahead = asyncio.run(with_draft_server(demo_engines[0], scenario))
    assert len(chained) == 2 and chained[0].more and not chained[1].more
    assert choices(chained[0]) == choices(drafts) and len(drafts.draft_token_ids) == 4
    assert choices(chained[1]) == choices(ahead) and len(ahead.draft_token_ids) == 5
    assert [choices(b) for b in chained[1].branch_drafts] == [choices(b) for b in ahead.branch_drafts]
    assert len(ahead.branch_drafts) == len(BRANCHES)
    assert (mode == worker_pb2.DRAFT_MODE_SAMPLED) == bool(ahead.draft_hidden_states)


def test_a_chained_call_on_unary_propose_is_refused_naming_the_field_and_the_server_keeps_serving(demo_engines):
    """Unary Propose answers once, so it cannot carry a chained pre-draft: INVALID_ARGUMENT naming `then`; the
    next call is served."""
    async def scenario(_, address):
        async with grpc.aio.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.DraftWorkerStub(channel)
            asked = dict(session_id=4, new_token_ids=PROMPT, k=3, sampling=generation_pb2.SamplingParams(top_p=1.0))
            try:
                await stub.Propose(worker_pb2.ProposeRequest(**asked, then=worker_pb2.ChainedPredraft(k=4)))
                error = None
            except grpc.aio.AioRpcError as exc:
                error = exc
            return error, await stub.Propose(worker_pb2.ProposeRequest(**asked))
    error, served = asyncio.run(with_draft_server(demo_engines[0], scenario))
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT and "then" in error.details()
    assert len(served.draft_token_ids) == 3


@pytest.mark.parametrize("hand_off", [False, True], ids=["through-router", "handed-off"])
def test_overlapped_rounds_with_chained_predrafts_give_the_targets_greedy_output(demo_engines, hand_off):
    """Overlap on, the target slower than a pre-draft (so most pre-drafts are staged): every round that drafts now
    chains its pre-draft, and with hand_off hands its drafts straight to the target too (an overlapped round is
    handed off only when its pre-draft is chained). The tokens are the target's own greedy tokens."""
    draft_engine, target_engine = demo_engines
    policy = FixedK(4, True, 3, stage=True, hand_off=hand_off, chain=True)
    chained = asyncio.run(serve_loop(draft_engine, SlowTarget(target_engine, 0.02), policy, PROMPT, 40))
    plain = asyncio.run(serve_loop(draft_engine, target_engine, FixedK(0, False), PROMPT, 40))
    assert chained.tokens == plain.tokens
    drafted_now = sum(1 for r in policy.rounds if r.k and not r.predrafted)
    assert drafted_now > 0 and chained.stats.predraft_hits > 0
    assert chained.stats.handed_off_rounds + chained.stats.handoffs_from_router == (drafted_now if hand_off else 0)
    assert chained.waiting_on_target == 0


def test_a_seeded_sampled_request_draws_the_same_tokens_chained_or_not(demo_engines):
    """Sampled-draft mode, overlap on: a chained pre-draft samples what the router's own call would have, so a
    seeded request's tokens do not depend on where the pre-draft was started."""
    draft_engine, target_engine = demo_engines
    sampling = generation_pb2.SamplingParams(temperature=0.9, top_p=1.0, seed=11)
    runs = [asyncio.run(serve_loop(draft_engine, target_engine, FixedK(3, True, 2, chain=chain), PROMPT, 32,
                                   sampling=sampling, mode=worker_pb2.DRAFT_MODE_SAMPLED))
            for chain in (True, False)]
    assert runs[0].tokens == runs[1].tokens
    assert runs[0].stats.draft_tokens > runs[0].stats.accepted_tokens          # some drafts were rejected
