"""The overlapped (draft-ahead) loop of router/speculation.py against in-memory workers, no Ray, no gRPC.

The fake target decodes a fixed greedy rule; the fake draft follows it except at every ninth position (where its
runner-up is the target's token), so rounds both hit and miss their pre-draft, and a rejection branch hits. Both fakes hold a per-session cache the way real workers do and
count every time the router claims they hold more than they do (a forced re-prefill), so the router's
`synced` accounting is checked too, not only its output.
"""
import asyncio

import grpc
import pytest

from draft_worker.server import chained
from protos.specpool.v1 import generation_pb2, worker_pb2
from router.request_state import RequestState
from router.speculation import generate, releases_done

VOCAB = 50
PROMPT = [3, 1, 4, 1, 5]
MAX_NEW = 60


def truth(context: list[int]) -> int:
    """The target's greedy next token."""
    return (sum(context) * 31 + len(context) * 7) % VOCAB


def guess(context: list[int]) -> int:
    """The draft's: right except at every ninth position."""
    return (truth(context) + 1) % VOCAB if len(context) % 9 == 3 else truth(context)


def runner_up(context: list[int]) -> int:
    """The draft's next best token."""
    return truth(context) if guess(context) != truth(context) else (truth(context) + 2) % VOCAB


def drafts_after(context: list[int], k: int) -> tuple[list[int], list[int]]:
    """k draft tokens after `context` and each one's runner-up."""
    drafts, runner_ups = [], []
    for _ in range(k):
        runner_ups.append(runner_up(context + drafts))
        drafts.append(guess(context + drafts))
    return drafts, runner_ups


def second_guesses(context: list[int], k: int) -> tuple[list[int], list[int], list[int]]:
    """As drafts_after, for a draft whose runner-up is wrong at every other mistake (its third choice is the
    target's token there): k drafts, their runner-ups and third choices."""
    drafts, runner_ups, thirds = [], [], []
    for _ in range(k):
        here = context + drafts
        swap = guess(here) != truth(here) and len(here) % 18 == 12
        choices = [(truth(here) + 3) % VOCAB, runner_up(here)]
        runner_ups.append(choices[not swap])
        thirds.append(choices[swap])
        drafts.append(guess(here))
    return drafts, runner_ups, thirds


def reference(max_new: int = MAX_NEW) -> list[int]:
    tokens = list(PROMPT)
    for _ in range(max_new):
        tokens.append(truth(tokens))
    return tokens[len(PROMPT):]


def down() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "killed")


class FakeWorker:
    """A worker's session caches, the position contract, and what the router asked of it."""
    timeout, outstanding = 5.0, 1       # outstanding: sessions the router holds there (WorkerClient's)

    def __init__(self):
        self.held: dict[int, list[int]] = {}
        self.reprefills = self.calls = 0
        self.healthy, self.released = True, []

    def sync(self, session_id: int, tokens: list[int], synced: int) -> list[int]:
        """Crop to `synced` and append the rest; a claim past what is held costs a re-prefill."""
        self.calls += 1
        held = self.held.get(session_id, [])
        if synced > len(held) or held[:synced] != tokens[:synced]:
            self.reprefills += 1
        self.held[session_id] = list(tokens)
        return self.held[session_id]

    def mark_failed(self, error=None):
        self.healthy = False

    async def wait_recovered(self, timeout):
        pass

    async def release(self, session_id: int):
        self.released.append(session_id)
        self.held.pop(session_id, None)


class FakeDraft(FakeWorker):
    def __init__(self, die_on_call: int = 0):
        super().__init__()
        self.die_on_call, self.cancelled, self.branches, self.chained = die_on_call, 0, [], 0

    async def propose(self, session_id, tokens, synced, k, sampling, mode, timeout, runner_ups=False, branches=(),
                      hand_to=("", 0), **_):
        if self.calls + 1 == self.die_on_call:
            self.calls += 1
            await asyncio.sleep(0.01)       # still pending when the verdict comes back, then the worker dies
            raise down()
        context = self.sync(session_id, tokens, synced)
        try:
            await asyncio.sleep(0.002)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        self.branches.append(len(branches))
        forks = [drafts_after(context[:at] + [token], k - 1) for at, token in branches]
        drafts, ranks = drafts_after(context, k)
        context.extend(drafts[:-1])         # a draft caches what it fed: all but its last draft
        return worker_pb2.ProposeResponse(
            draft_token_ids=drafts, runner_up_token_ids=ranks if runner_ups else [],
            branch_drafts=[worker_pb2.BranchDrafts(token_ids=d, runner_up_token_ids=r if runner_ups else [])
                           for d, r in forks]), 0

    async def propose_chained(self, session_id, tokens, synced, k, sampling, mode, timeout, then, hand_to=("", 0),
                              **_):
        """The drafts, then the pre-draft the real worker chains to them (draft_worker.server.chained)."""
        drafts, _ = await self.propose(session_id, tokens, synced, k, sampling, mode, timeout, runner_ups=True)
        drafts.more = True
        self.chained += 1
        yield drafts, 0
        asked = chained(worker_pb2.ProposeRequest(position=synced, new_token_ids=tokens[synced:], then=then), drafts)
        context = list(tokens) + list(drafts.draft_token_ids)
        yield await self.propose(session_id, context, asked.position, asked.k, sampling, mode, timeout, True,
                                 [(b.at, b.token_id) for b in asked.branches])


class SecondGuessDraft(FakeDraft):
    """A FakeDraft whose runner-up is the target's correction at only half its mistakes, its third choice at the
    others (second_guesses), both answered when asked."""

    async def propose(self, session_id, tokens, synced, k, sampling, mode, timeout, runner_ups=False, branches=(),
                      hand_to=("", 0), **_):
        context = self.sync(session_id, tokens, synced)
        await asyncio.sleep(0.002)
        self.branches.append(len(branches))
        forks = [second_guesses(context[:at] + [token], k - 1) for at, token in branches]
        drafts, ranks, thirds = second_guesses(context, k)
        context.extend(drafts[:-1])

        def choices(ranks: list[int], thirds: list[int]) -> dict:
            return dict(runner_up_token_ids=ranks, third_choice_token_ids=thirds) if runner_ups else {}
        return worker_pb2.ProposeResponse(
            draft_token_ids=drafts, **choices(ranks, thirds),
            branch_drafts=[worker_pb2.BranchDrafts(token_ids=d, **choices(r, t)) for d, r, t in forks]), 0


class FakeTarget(FakeWorker):
    """A target whose verify takes `delay` seconds and that keeps each verdict for the staged call that may follow
    it (target_worker/staging.py), keyed as the real one keys them: (session, committed tokens before the drafts).
    `stage_first`: a verify also waits (up to 0.3 s) for the staged call of its round's pre-draft, so that
    staging happens before every verdict however loaded the machine is."""

    def __init__(self, delay: float = 0.001, die_on_stage: int = 0, stage_first: bool = False):
        super().__init__()
        self.delay, self.die_on_stage, self.stage_first = delay, die_on_stage, stage_first
        self.verdicts: dict[tuple[int, int], asyncio.Future] = {}
        self.stage_calls: dict[tuple[int, int], asyncio.Event] = {}
        self.staged = self.missed = 0

    def stage_call(self, key: tuple[int, int]) -> asyncio.Event:
        return self.stage_calls.setdefault(key, asyncio.Event())

    async def verify(self, session_id, tokens, synced, drafts, hidden, sampling, timeout, **_):
        context = self.sync(session_id, tokens, synced)
        verdict = self.verdicts[(session_id, len(tokens))] = asyncio.get_running_loop().create_future()
        await asyncio.sleep(self.delay)
        if self.stage_first:
            try:
                await asyncio.wait_for(self.stage_call((session_id, len(tokens))).wait(), 0.3)
            except TimeoutError:
                pass                        # no pre-draft was staged for this round
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == truth(context + list(drafts[:accepted])):
            accepted += 1
        context.extend(drafts)
        response = worker_pb2.VerifyResponse(num_accepted=accepted,
                                             next_token_id=truth(context[:len(tokens) + accepted]))
        verdict.set_result(response)
        return response, 0

    async def stage(self, session_id, position, candidates, timeout):
        """The staged call: once the round at `position` has its verdict, verify the candidate that guessed it."""
        self.staged += 1
        self.stage_call((session_id, position)).set()
        if self.staged == self.die_on_stage:
            raise down()
        verdict = await self.verdicts.pop((session_id, position))
        for c in candidates:
            if (c.num_accepted, c.next_token_id) == (verdict.num_accepted, verdict.next_token_id):
                held = self.held[session_id][:position + c.num_accepted] + [c.next_token_id]
                return await self.verify(session_id, held, position + c.num_accepted, list(c.draft_token_ids),
                                         c.draft_hidden_states, None, timeout)
        self.missed += 1
        return worker_pb2.VerifyResponse(missed=True), 0


class FixedK:
    """A KPolicy with one K, recording the rounds."""

    def __init__(self, k: int, overlap: bool, branches: int = 0, stage: bool = False, thirds: bool = False,
                 prefill_first: bool = False, hand_off: bool = False, chain: bool = False):
        self.k, self.overlap, self.predraft_k, self.rounds = k, overlap, 8, []
        self.branches, self.stage_predrafts, self.ranks = branches, stage, (0, 1) if thirds else (0,)
        self.prefill_first, self.hand_off, self.chain_predrafts = prefill_first, hand_off, chain
        self.decode_steps = 1               # the fake target answers one token per call

    def choose_k(self, state, source=None):
        return self.k

    def held_k(self, state, source):
        return self.k

    def choose_source(self, state, candidates, match_size=0):
        return candidates[-1]               # n-gram drafts whenever they match

    def lookup_limits(self, state, k, with_model):
        return 0, []

    def match_k(self, state, size, k):
        return k

    def predraft_branches(self, state, k):
        return [(j, rank) for rank in self.ranks for j in range(min(self.branches, k))]   # at the first positions

    def observe(self, state, round_):
        self.rounds.append(round_)


def request(max_new: int = MAX_NEW) -> RequestState:
    return RequestState(session_id=7, tokens=list(PROMPT), prompt_len=len(PROMPT), max_new_tokens=max_new,
                        sampling=generation_pb2.SamplingParams(top_p=1.0), fixed_k=None,
                        draft_mode=worker_pb2.DRAFT_MODE_GREEDY, max_context=0)


def run(draft, target, policy, state=None, stop_after: int | None = None) -> RequestState:
    state = state or request()

    async def main():
        rounds = generate(state, draft, target, policy)
        async for _ in rounds:
            if stop_after is not None and len(policy.rounds) >= stop_after:
                break
        await rounds.aclose()
        await releases_done()               # released in the background (release_later)
    asyncio.run(main())
    return state


@pytest.mark.parametrize("k", [0, 1, 2, 3, 6])
@pytest.mark.parametrize("overlap,branches,prefill_first,chain",
                         [(False, 0, False, False), (True, 0, False, False), (True, 2, False, False),
                          (True, 8, False, False), (True, 2, True, False), (True, 2, False, True),
                          (True, 8, True, True)],
                         ids=["in-turn", "overlap", "overlap-2-branches", "overlap-8-branches", "prefill-first",
                              "chained", "chained-8-branches-prefill-first"])
def test_output_identical_to_target_alone_and_no_worker_is_over_claimed(k, overlap, branches, prefill_first, chain):
    draft = FakeDraft()
    target, policy = FakeTarget(), FixedK(k, overlap, branches, prefill_first=prefill_first, chain=chain)
    state = run(draft, target, policy)
    assert state.tokens[len(PROMPT):] == reference()
    assert draft.reprefills == 0 and target.reprefills == 0
    hits = sum(r.predrafted for r in policy.rounds)
    assert state.stats.predraft_hits == hits and state.stats.predrafts == (0 if not overlap or k == 0 else
                                                                           sum(r.predraft_sent for r in policy.rounds))
    if overlap and k:
        assert 0 < hits < len(policy.rounds)                          # it both hits and misses
        assert all(not r.predrafted or r.parts["draft_compute"] == 0 for r in policy.rounds)
        assert target.calls == len(policy.rounds)
        drafted_now = sum(1 for r in policy.rounds if r.k and not r.predrafted)
        assert draft.calls == state.stats.predrafts + drafted_now          # a hit makes no draft call
        # chained: every round that drafted now and pre-drafted had its pre-draft start on the draft worker
        assert draft.chained == (sum(1 for r in policy.rounds if r.k and not r.predrafted and r.predraft_sent)
                                 if chain else 0)


@pytest.mark.parametrize("stage", [False, True], ids=["not-staged", "staged"])
def test_the_first_round_is_the_targets_prefill_alone_with_the_draft_pre_drafting_beside_it(stage):
    """speculation.prefill_first: a request's first round verifies no drafts (K = 0) while its pre-draft (the
    draft's prefill, its guess of the first token and K drafts after it) runs beside the target's prefill. The fake
    draft guesses the first token right, so the second round's drafts are ready at once (on a target slower than
    the pre-draft, staged: the target starts it by itself). Then rounds run at K, and the output is the target's."""
    draft, target = FakeDraft(), FakeTarget(delay=0.006, stage_first=stage)
    policy = FixedK(3, True, 0, stage=stage, prefill_first=True)
    state = run(draft, target, policy)
    assert state.tokens[len(PROMPT):] == reference()
    assert draft.reprefills == 0 and target.reprefills == 0
    first, second = policy.rounds[:2]
    assert first.k == 0 and first.predraft_sent and first.committed == reference()[:1]
    assert guess(PROMPT) == truth(PROMPT) and second.predrafted and second.staged == stage and second.k == 3
    assert {r.k for r in policy.rounds[1:-1]} == {3} and list(state.stats.k_per_round[:2]) == [0, 3]
    assert draft.calls == state.stats.predrafts + sum(1 for r in policy.rounds if r.k and not r.predrafted)
    in_turn_first = FixedK(3, True, 0, stage=stage)
    run(FakeDraft(), FakeTarget(delay=0.006, stage_first=stage), in_turn_first)
    assert in_turn_first.rounds[0].k == 3 and not in_turn_first.rounds[0].predrafted


def test_in_sampled_draft_mode_the_first_round_drafts_so_that_seeded_tokens_do_not_depend_on_overlap():
    """A sampled draft's draws depend on the rounds' K: with prefill_first only where overlap is on, a seeded
    request's tokens would change with speculation.overlap. So in sampled-draft mode the first round drafts at K,
    overlap or not."""
    state = request()
    state.draft_mode = worker_pb2.DRAFT_MODE_SAMPLED
    policy = FixedK(3, True, 0, prefill_first=True)
    run(FakeDraft(), FakeTarget(), policy, state)
    assert policy.rounds[0].k == 3 and state.tokens[len(PROMPT):] == reference()


def test_a_k_above_the_predraft_budget_runs_in_turn_at_its_k_not_cut_to_the_budget():
    """speculation.overlap_tokens bounds a pre-draft, not the K of the rounds: a round planned past it drafts
    its whole K after the verdict, with no pre-draft."""
    policy, draft = FixedK(4, True), FakeDraft()
    policy.predraft_k = 2
    state = run(draft, FakeTarget(), policy)
    assert state.tokens[len(PROMPT):] == reference()
    assert {r.k for r in policy.rounds[:-1]} == {4}      # the last round may stop short of max_new
    assert state.stats.predrafts == 0 and draft.calls == len(policy.rounds)


@pytest.mark.parametrize("branches", [0, 1, 3])
def test_a_hit_means_all_drafts_accepted_and_the_guess_right_or_a_branch_guessed_the_rejection(branches):
    policy, draft = FixedK(3, True, branches), FakeDraft()
    state = run(draft, FakeTarget(), policy)
    for previous, round_ in zip(policy.rounds, policy.rounds[1:]):
        main = previous.accepted == previous.k and previous.timings.guess_hit is True
        # The fake draft's runner-up is always the target's token: a rejection where a branch was is a hit.
        branch = previous.predraft_sent and previous.accepted < min(previous.k, branches)
        assert round_.predrafted == (main or branch) and round_.from_branch == branch
        # ... and the controller learns so from every rejection, branched or not
        assert previous.timings.branch_hit is (True if previous.accepted < previous.k else None)
    branch_hits = sum(r.from_branch for r in policy.rounds)
    assert state.stats.predraft_branch_hits == branch_hits and (branch_hits > 0) == (branches > 0)
    assert set(draft.branches) <= {0, min(branches, 3)}


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("branches", [0, 3])
def test_a_staged_round_is_verified_by_the_target_on_its_own_and_the_output_stays_the_targets(k, branches):
    """A verify slower than a pre-draft: each pre-draft is staged on the target before its verdict. Every hit is
    then a round the target started by itself (no second verify call), every miss a staged call answered
    `missed`, and the output and the workers' caches are exactly as without staging."""
    draft, target = FakeDraft(), FakeTarget(delay=0.006, stage_first=True)
    policy = FixedK(k, True, branches, stage=True)
    state = run(draft, target, policy)
    assert state.tokens[len(PROMPT):] == reference()
    assert draft.reprefills == 0 and target.reprefills == 0
    staged = [r.staged for r in policy.rounds]
    assert staged == [r.predrafted for r in policy.rounds] and any(staged) and not all(staged)
    assert state.stats.staged_rounds == sum(staged) == target.staged - target.missed
    assert target.calls == len(policy.rounds)                          # a staged hit sends no verify of its own
    assert all(r.parts["verify_worker"] == 0 for r in policy.rounds if r.staged)


@pytest.mark.parametrize("thirds", [False, True], ids=["runner-ups", "and-third-choices"])
def test_third_choice_branches_take_the_rejections_a_runner_up_missed_staged_and_stay_the_targets(thirds):
    """Half the draft's mistakes are corrected to its third choice: with a second guess per position those
    rounds are pre-drafted too (and staged: the target verifies them itself), the workers are never claimed past
    what they hold, and the output is the target's."""
    draft, target = SecondGuessDraft(), FakeTarget(delay=0.006, stage_first=True)
    policy = FixedK(3, True, 3, stage=True, thirds=thirds)
    state = run(draft, target, policy)
    assert state.tokens[len(PROMPT):] == reference()
    assert draft.reprefills == 0 and target.reprefills == 0
    pairs = list(zip(policy.rounds, policy.rounds[1:]))
    third_hits = sum(r.from_branch and p.timings.branch_hit is False and p.timings.third_hit is True for p, r in pairs)
    runner_up_hits = sum(r.from_branch and p.timings.branch_hit is True for p, r in pairs)
    assert runner_up_hits > 0 and (third_hits > 0) == thirds
    assert state.stats.staged_rounds == sum(r.staged for r in policy.rounds) == target.staged - target.missed
    assert all(r.staged == r.predrafted for r in policy.rounds)


def test_a_staged_call_that_fails_leaves_its_round_to_verify_as_usual():
    """The target fails the third staged call (UNAVAILABLE): that round sends its verify as it would have
    without staging, and the tokens are unchanged."""
    target = FakeTarget(delay=0.006, die_on_stage=3, stage_first=True)
    state = run(FakeDraft(), target, FixedK(3, True, 3, stage=True))
    assert state.tokens[len(PROMPT):] == reference() and target.reprefills == 0
    assert 0 < state.stats.staged_rounds < state.stats.predraft_hits


def test_a_predraft_back_after_its_verdict_is_not_staged():
    draft, target, policy = FakeDraft(), FakeTarget(delay=0.0), FixedK(3, True, 3, stage=True)
    state = run(draft, target, policy)
    assert state.tokens[len(PROMPT):] == reference()
    assert target.staged == 0 and state.stats.predraft_hits > 0 and state.stats.staged_rounds == 0


def test_draft_killed_while_a_predraft_is_pending_gives_identical_tokens():
    draft, target, policy = FakeDraft(die_on_call=6), FakeTarget(), FixedK(3, True)
    state = run(draft, target, policy)
    assert state.tokens[len(PROMPT):] == reference()
    ks = [r.k for r in policy.rounds]
    assert draft.calls == 6 and not draft.healthy and ks[0] == 3
    assert all(k == 0 for k in ks[ks.index(0):]) and ks.index(0) < len(ks) - 10   # plain decoding from then on
    assert target.reprefills == 0


@pytest.mark.parametrize("chain", [False, True], ids=["sent", "chained"])
def test_draft_killed_while_drafting_or_pre_drafting_a_chained_round_gives_identical_tokens(chain):
    """The draft worker dies on its 5th call (a round's drafts, chained or not) or 6th (a pre-draft; chained: the
    one its drafts' call started): the round goes on without it, and so does the request, by plain decoding."""
    for die_on_call in (5, 6):
        draft, target, policy = FakeDraft(die_on_call=die_on_call), FakeTarget(), FixedK(3, True, 2, chain=chain)
        state = run(draft, target, policy)
        assert state.tokens[len(PROMPT):] == reference() and target.reprefills == 0
        assert not draft.healthy and 0 in [r.k for r in policy.rounds] and (draft.chained > 0) == chain


@pytest.mark.parametrize("chain", [False, True], ids=["sent", "chained"])
def test_a_request_that_ends_cancels_its_predraft_before_releasing(chain):
    draft, target, policy = FakeDraft(), FakeTarget(), FixedK(3, True, chain=chain)
    run(draft, target, policy, stop_after=3)
    assert draft.released == [7] and target.released == [7]
    assert draft.held == {} and target.held == {}                    # no pre-draft re-created the session


class SlowRelease(FakeTarget):
    async def release(self, session_id: int):
        await asyncio.sleep(0.2)
        await super().release(session_id)


def test_a_request_ends_without_waiting_for_its_release_and_releases_the_draft_only_if_it_called_it():
    """The workers' caches are freed in the background: the request's rounds end while a slow release is in
    flight, and releases_done() waits for it. A request that never called the draft (K = 0) releases only the
    target; one that drafted releases both."""
    async def main(draft, target, k):
        async for _ in generate(request(), draft, target, FixedK(k, True)):
            pass
        in_flight = list(target.released)
        await releases_done()
        return in_flight, draft.released, target.released
    assert asyncio.run(main(FakeDraft(), SlowRelease(), 0)) == ([], [], [7])
    assert asyncio.run(main(FakeDraft(), SlowRelease(), 3)) == ([], [7], [7])



class SizedLookup(FixedK):
    """FixedK whose n-gram drafts are worth at most CAPS[n - 1] tokens after a match of n tokens."""
    CAPS = [1, 1, 2, 3]

    def match_k(self, state, size, k):
        return min(k, self.CAPS[size - 1])


def lookup_rounds(fixed_k: int | None) -> tuple[RequestState, list]:
    """A request drafting only by prompt lookup (1- to 4-grams) with decode runs off, and its n-gram rounds."""
    from engine.ngram import NgramIndex
    from router.request_state import NGRAM
    state, policy = request(), SizedLookup(6, overlap=False)
    state.method, state.ngram, state.fixed_k = "ngram", NgramIndex(1, 4), fixed_k
    run(None, FakeTarget(), policy, state)
    return state, [r for r in policy.rounds if r.source == NGRAM and r.k]


@pytest.mark.parametrize("fixed_k", [None, 6])
def test_a_round_the_router_looks_up_drafts_after_a_match_at_most_the_k_for_its_length(fixed_k):
    """With decode runs off the router drafts by prompt lookup itself: after a match of n tokens it proposes at
    most the policy's K for that length (a request with its own K: up to it after any match), and the output
    stays the target's alone."""
    state, drafted = lookup_rounds(fixed_k)
    assert state.tokens[len(PROMPT):] == reference()
    assert min(r.match_size for r in drafted) < 4 == drafted[-1].match_size       # short matches and long ones
    steady = drafted[:-2]                           # the last rounds are cut short by max_new_tokens
    assert all(r.k == (fixed_k or SizedLookup.CAPS[r.match_size - 1]) for r in steady)
