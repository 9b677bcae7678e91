"""Pre-draft branches on the draft engine: besides its own row, a pre-draft drafts after each guessed rejection
(the drafts accepted up to a point, then the draft's runner-up there), batched in the same steps. Each branch must
draft exactly what a draft call from that context would, and leave the session's own cache as without branches.
(Engines in-process, no Ray.)"""
import asyncio

import pytest
import torch

from draft_worker.proposer import DraftEngine
from protos.specpool.v1 import generation_pb2, worker_pb2

PROMPT = [0, 1, 2, 3, 4, 5, 6]


@pytest.fixture(scope="module")
def draft(tiny_pair):
    return DraftEngine(tiny_pair[0])


def request(session_id, position, new, k, mode=worker_pb2.DRAFT_MODE_GREEDY, branches=(), **sampling):
    params = generation_pb2.SamplingParams(seed=5, **sampling) if position == 0 else None
    return worker_pb2.ProposeRequest(session_id=session_id, position=position, new_token_ids=new, k=k,
                                     sampling=params, mode=mode, runner_ups=True,
                                     branches=[worker_pb2.BranchPoint(at=at, token_id=t) for at, t in branches])


def greedy_from_scratch(model, context: list[int], k: int) -> tuple[list[int], list[int], list[int]]:
    """k argmax drafts after `context`, each with its runner-up and third choice, by the model alone over the
    whole context."""
    tokens, runner_ups, thirds = list(context), [], []
    with torch.no_grad():
        for _ in range(k):
            top3 = model(torch.tensor([tokens])).logits[0, -1].topk(3).indices.tolist()
            tokens.append(top3[0])
            runner_ups.append(top3[1])
            thirds.append(top3[2])
    return tokens[len(context):], runner_ups, thirds


def choices(answer) -> tuple[list[int], list[int], list[int]]:
    """A draft answer's (or branch's) tokens, runner-ups and third choices."""
    tokens = answer.draft_token_ids if hasattr(answer, "draft_token_ids") else answer.token_ids
    return list(tokens), list(answer.runner_up_token_ids), list(answer.third_choice_token_ids)


def test_each_branch_drafts_what_a_draft_call_from_its_context_would(draft):
    first = draft.propose(request(1, 0, PROMPT, 3))
    drafts = list(first.draft_token_ids)
    assert choices(first) == greedy_from_scratch(draft.model, PROMPT, 3)
    held = len(PROMPT) + 2                                   # the session holds the prompt + drafts[:-1]
    points = [(len(PROMPT) + j, first.runner_up_token_ids[j]) for j in range(3)] + \
        [(len(PROMPT), first.third_choice_token_ids[0])]      # and a second guess at the first position
    ahead = draft.propose(request(1, held, drafts[2:], 4, branches=points))
    context = PROMPT + drafts
    assert choices(ahead) == greedy_from_scratch(draft.model, context, 4)
    assert len(ahead.branch_drafts) == 4
    for (at, token), branch in zip(points, ahead.branch_drafts):
        expected = greedy_from_scratch(draft.model, context[:at] + [token], 3)
        assert choices(branch) == expected, at
    # The session holds its own row: going on from it drafts what the model alone would.
    main = list(ahead.draft_token_ids)
    after = draft.propose(request(1, len(context) + 3, main[3:], 2))
    assert list(after.draft_token_ids) == greedy_from_scratch(draft.model, context + main, 2)[0]


def test_a_branch_can_start_inside_the_new_tokens_or_at_the_held_context(draft):
    draft.propose(request(2, 0, PROMPT, 1))
    new = [3, 2, 1]
    points = [(len(PROMPT) + 2, 7), (len(PROMPT), 6)]        # after two of the new tokens; before any
    ahead = draft.propose(request(2, len(PROMPT), new, 3, branches=points))
    for (at, token), branch in zip(points, ahead.branch_drafts):
        expected = greedy_from_scratch(draft.model, (PROMPT + new)[:at] + [token], 2)[0]
        assert list(branch.token_ids) == expected


def test_sampled_branches_sample_the_same_tokens_as_a_call_from_their_context(draft):
    sampled = dict(mode=worker_pb2.DRAFT_MODE_SAMPLED, temperature=0.9, top_k=6)
    first = draft.propose(request(3, 0, PROMPT, 3, **sampled))
    drafts = list(first.draft_token_ids)
    points = [(len(PROMPT) + j, first.runner_up_token_ids[j]) for j in range(3)]
    ahead = draft.propose(request(3, len(PROMPT) + 2, drafts[2:], 4, mode=sampled["mode"], branches=points))
    hidden = draft.model.config.hidden_size * 4
    for n, ((at, token), branch) in enumerate(zip(points, ahead.branch_drafts)):
        alone = draft.propose(request(100 + n, 0, (PROMPT + drafts)[:at] + [token], 3, **sampled))
        assert list(branch.token_ids) == list(alone.draft_token_ids)      # the draft's RNG is keyed by position
        assert len(branch.hidden_states) == 3 * hidden
        got = torch.frombuffer(bytearray(branch.hidden_states), dtype=torch.float32)
        want = torch.frombuffer(bytearray(alone.draft_hidden_states), dtype=torch.float32)
        assert torch.allclose(got, want, atol=1e-5)


def test_a_branch_point_past_the_context_fails_that_request_alone(draft):
    draft.propose(request(4, 0, PROMPT, 1))
    draft.propose(request(5, 0, PROMPT, 1))
    bad = request(4, len(PROMPT), [1], 2, branches=[(len(PROMPT) + 5, 3)])
    good = request(5, len(PROMPT), [1], 2, branches=[(len(PROMPT), 3)])
    results = draft.propose_batch([bad, good])
    assert isinstance(results[0], ValueError) and "branches.at" in str(results[0])
    assert len(results[1].branch_drafts) == 1 and len(results[1].draft_token_ids) == 2


# ---- the router's loop over the real engines (in process: no gRPC, no Ray) ----------------------------------

class EngineClient:
    """A worker client in front of an engine: the position contract as the real client speaks it."""
    timeout, healthy, outstanding = 30.0, True, 1

    def __init__(self, engine):
        self.engine = engine

    def mark_failed(self, error=None):
        raise AssertionError("an engine call failed")

    async def release(self, session_id):
        self.engine.release(session_id)

    def fields(self, tokens, synced, start) -> dict:
        return dict(position=synced, new_token_ids=tokens[synced:], **({} if synced else start))


class DraftClient(EngineClient):
    async def propose(self, session_id, tokens, synced, k, start, mode, timeout, runner_ups=False, branches=(),
                      hand_to=("", 0), committed=0):
        await asyncio.sleep(0)              # sent beside the verify: it runs after the verify was sent
        points = [worker_pb2.BranchPoint(at=at, token_id=t) for at, t in branches]
        return self.engine.propose(worker_pb2.ProposeRequest(
            session_id=session_id, k=k, mode=mode, runner_ups=runner_ups, branches=points, committed=committed,
            **self.fields(tokens, synced, start))), 0


class TargetClient(EngineClient):
    async def verify(self, session_id, tokens, synced, drafts, hidden, start, timeout):
        return self.engine.verify(worker_pb2.VerifyRequest(
            session_id=session_id, draft_token_ids=drafts, draft_hidden_states=hidden,
            **self.fields(tokens, synced, start))), 0


def greedy_loop(engines, session_id: int, policy, max_new: int):
    """The router's loop over the engines for one greedy request (prompt 40..69): its final state, and the
    target's own greedy tokens for that prompt."""
    from router.request_state import RequestState
    from router.speculation import generate
    draft, target = engines
    prompt = list(range(40, 70))
    state = RequestState(session_id=session_id, tokens=list(prompt), prompt_len=len(prompt), max_new_tokens=max_new,
                         sampling=generation_pb2.SamplingParams(top_p=1.0), fixed_k=None,
                         draft_mode=worker_pb2.DRAFT_MODE_GREEDY, max_context=0)

    async def main():
        async for _ in generate(state, DraftClient(draft), TargetClient(target), policy):
            pass
    asyncio.run(main())
    with torch.no_grad():
        expected = target.model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False)[0].tolist()
    return state, expected


@pytest.mark.parametrize("k,branches", [(3, 0), (3, 3), (5, 2)])
def test_greedy_rounds_taking_branch_drafts_match_the_target_alone(demo_engines, k, branches):
    """The demo pair's draft, whose runner-up is often the target's correction: rounds take a rejection branch's
    drafts, the draft's cache is never claimed past what it holds (an engine would raise SessionLost), and the
    tokens are the target's own greedy ones."""
    from tests.test_overlap import FixedK
    policy = FixedK(k, True, branches)
    state, expected = greedy_loop(demo_engines, k * 10 + branches, policy, 64)
    assert state.tokens == expected
    from_branch = sum(r.from_branch for r in policy.rounds)
    assert (from_branch > 0) == (branches > 0) and from_branch <= state.stats.predraft_branch_hits
    assert all(r.parts["draft_compute"] == 0 for r in policy.rounds if r.predrafted)


def third_choice_hits(draft_model, state, rounds) -> int:
    """Rounds whose drafts came from a branch that guessed the draft's third choice (its runner-up was not the
    target's correction), recomputed from the draft model over the committed tokens."""
    hits, at = 0, state.prompt_len
    for previous, round_ in zip(rounds, rounds[1:]):
        at += len(previous.committed)
        if round_.from_branch:
            with torch.no_grad():
                top3 = draft_model(torch.tensor([state.tokens[:at - 1]])).logits[0, -1].topk(3).indices.tolist()
            others = [t for t in top3 if t != previous.drafts[previous.accepted]]
            hits += previous.committed[-1] == others[1]
    return hits


@pytest.mark.parametrize("thirds", [False, True], ids=["runner-ups", "and-third-choices"])
def test_third_choice_branches_take_rejections_the_runner_up_missed_and_stay_the_targets_greedy_output(
        demo_engines, thirds):
    """A second guess per rejected position (the draft's third choice): some rounds are pre-drafted after a
    correction that only the third choice guessed, and the tokens are still the target's greedy ones."""
    from tests.test_overlap import FixedK
    policy = FixedK(4, True, 4, thirds=thirds)
    state, expected = greedy_loop(demo_engines, 90 + thirds, policy, 96)
    assert state.tokens == expected
    assert (third_choice_hits(demo_engines[0].model, state, policy.rounds) > 0) == thirds
