"""Decode runs on the target worker (VerifyRequest.decode_steps, the K = 0 path): one call decodes several tokens
and answers each as it is sampled. A run commits exactly what that many plain K = 0 calls would (greedy and
seeded sampling), ends at a stop token, batches with other sessions' calls while they wait, and stops stepping
once withdrawn. The real TargetServicer and TargetEngine on the byte pair, in-process (no Ray, no gRPC)."""
import asyncio
import threading

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


def steps_of(messages: list[worker_pb2.VerifyResponse]) -> list[worker_pb2.VerifyResponse]:
    """Every step a run answered, in order: each message's held steps (`earlier`), then the message itself."""
    return [step for message in messages for step in (*message.earlier, message)]


def test_answers_held_back_travel_together_and_lose_nothing(engine):
    async def scenario():
        servicer = TargetServicer(engine, 1)
        together = start(5, 0.9, steps=40)
        together.answer_delay_us = 10_000_000           # longer than the whole run: only the first goes at once
        return await decode(servicer, start(6, 0.9, steps=40)), await decode(servicer, together)
    each, together = asyncio.run(scenario())
    assert len(each) == 40 and not any(m.earlier for m in each)
    assert len(together) == 2 and len(together[0].earlier) == 0 and len(together[1].earlier) == 38
    assert [a.next_token_id for a in steps_of(together)] == [a.next_token_id for a in each]


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("position, messages, last", [
    (0, [[0], [1, 2, 3, 4], [5, 6, 7, 8]], [9, 10]),          # a session's start: its first token at once
    (30, [[0, 1, 2, 3], [4, 5, 6, 7]], [8, 9, 10]),            # a later run holds its first answer too
])
def test_a_held_answer_waits_at_most_the_delay(position, messages, last):
    """Steps of 3 ms, a delay of 10 ms: what is held goes out when its oldest answer has waited 9 ms (one more
    step would make that 12 > 10); the last answer carries the rest."""
    from target_worker.server import DecodeRun
    clock, sent = Clock(), []
    request = worker_pb2.VerifyRequest(session_id=1, position=position, decode_steps=11, answer_delay_us=10_000)
    run = DecodeRun(request, sent.append, clock)
    for step in range(11):
        started, clock.now = clock.now, clock.now + 0.003
        run.advance(worker_pb2.VerifyResponse(next_token_id=step), started)
        assert (run.last is None) == (step < 10)
    assert [[a.next_token_id for a in (*m.earlier, m)] for m in sent] == messages
    assert [a.next_token_id for a in (*run.last.earlier, run.last)] == last
    assert all(a.more for m in sent for a in (*m.earlier, m)) and not run.last.more


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


def test_plain_runs_step_together_on_the_engine_thread_and_each_matches_itself_alone(engine):
    """Plain runs of different lengths, batched only with each other, take several steps at a time on the engine
    thread (EngineSteps.together): each still commits what it would alone, the shorter ones end on time, and the
    others go on."""
    async def scenario():
        servicer = TargetServicer(engine, 1, max_batch=4)
        alone = [await decode(servicer, start(40 + i, 0.9, steps=steps)) for i, steps in enumerate((5, 9, 14))]
        stepped, together = [], servicer._side.together

        async def counted(runs):
            results = await together(runs)
            stepped.append(len(runs))
            return results
        servicer._side.together = counted
        runs = await asyncio.gather(*(decode(servicer, start(50 + i, 0.9, steps=steps))
                                      for i, steps in enumerate((5, 9, 14))))
        return alone, runs, stepped
    alone, together, stepped = asyncio.run(scenario())
    tokens = lambda answers: [a.next_token_id for a in answers]   # noqa: E731
    assert [tokens(a) for a in together] == [tokens(a) for a in alone]
    assert [len(tokens(a)) for a in together] == [5, 9, 14]
    assert stepped and max(stepped) == 3                           # all three runs' steps together,
    assert len(stepped) <= 4, stepped                              # several steps per trip to the engine thread


def test_a_call_that_arrives_while_runs_step_together_joins_their_next_forward(engine):
    """Two 300-step runs stepping together leave the engine thread as soon as another call waits: a plain verify
    call sent meanwhile is answered long before the runs end."""
    async def scenario():
        servicer = TargetServicer(engine, 1, max_batch=4)
        runs = [asyncio.ensure_future(decode(servicer, start(60 + i, 0.0, steps=300))) for i in range(2)]
        await asyncio.sleep(0.05)
        request = worker_pb2.VerifyRequest(session_id=70, position=0, new_token_ids=PROMPT,
                                           sampling=generation_pb2.SamplingParams(top_p=1.0))
        verdict = await servicer._submit(request, None)
        done_when_answered = [run.done() for run in runs]
        await asyncio.gather(*runs)
        return verdict, done_when_answered, [len(run.result()) for run in runs]
    verdict, done_when_answered, lengths = asyncio.run(scenario())
    assert verdict.next_token_id >= 0 and done_when_answered == [False, False]
    assert all(length >= 1 for length in lengths)


class GatedEngine:
    """The engine, each forward after the first waiting for `gate` (so a test decides when steps may go on)."""

    def __init__(self, engine):
        self._engine, self.forwards, self.gate = engine, 0, threading.Event()

    def verify_batch(self, requests):
        self.forwards += 1
        if self.forwards > 1:
            self.gate.wait(30)
        return self._engine.verify_batch(requests)

    def __getattr__(self, name):
        return getattr(self._engine, name)


def test_a_withdrawn_run_stops_stepping(engine):
    """Withdrawn after its first answer (its second step waiting meanwhile), a 400-step run takes at most the
    step in progress and stops."""
    async def scenario():
        gated = GatedEngine(engine)
        servicer, first = TargetServicer(gated, 1), asyncio.Event()
        run = asyncio.ensure_future(servicer._submit(start(30, 0.0, steps=400), lambda _: first.set()))
        await first.wait()
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        gated.gate.set()
        await asyncio.sleep(0.3)
        held = engine.sessions._sessions[30].length
        await asyncio.sleep(0.3)
        return held, engine.sessions._sessions[30].length
    held, later = asyncio.run(scenario())
    assert held == later <= len(PROMPT) + 3


def tokens_of(answers) -> list[int]:
    return [t for a in answers for t in list(a.draft_token_ids[:a.num_accepted]) + [a.next_token_id]]


def plain_and_looked_up(engine, call: worker_pb2.VerifyRequest, max_tokens: int) -> tuple[list, list]:
    """The answers of decode run `call` (a session start) drafting nothing, and of the same run in another session
    looking up its own drafts (1- to 3-grams, up to `max_tokens` drafts)."""
    looked_up = worker_pb2.VerifyRequest()
    looked_up.CopyFrom(call)
    looked_up.session_id = call.session_id + 1
    looked_up.lookup.min_n, looked_up.lookup.max_n, looked_up.lookup.max_tokens = 1, 3, max_tokens

    async def scenario():
        servicer = TargetServicer(engine, 1)
        return await decode(servicer, call), await decode(servicer, looked_up)
    return asyncio.run(scenario())


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "seeded-sampled"])
def test_a_run_that_looks_up_its_own_drafts_commits_what_plain_decoding_would(engine, temperature):
    """Prompt-lookup drafts are verified as a deterministic draft's (q one-hot, coupled to plain decoding), so a
    run that looks up its drafts commits plain decoding's tokens, exactly its token budget of them."""
    call = start(40, temperature, steps=40)
    call.new_token_ids[:] = PROMPT * 3                         # a context that repeats: lookup always matches
    plain, looked_up = plain_and_looked_up(engine, call, 6)
    assert tokens_of(looked_up) == tokens_of(plain) and len(tokens_of(plain)) == 40
    assert sum(len(a.draft_token_ids) for a in looked_up) > 0
    assert all(len(a.draft_token_ids) <= 6 for a in looked_up) and not looked_up[-1].more
    if temperature == 0.0:                                     # a random model's greedy output cycles: drafts hit
        assert len(looked_up) < len(plain)


def test_a_lookup_run_drafts_after_a_match_at_most_the_k_for_its_length(engine):
    """max_tokens_by_match caps the drafts after a match of each length (0: none after it); the run still commits
    plain decoding's tokens."""
    def request(session_id: int, by_match: list[int]) -> worker_pb2.VerifyRequest:
        call = start(session_id, 0.0, steps=40)
        call.new_token_ids[:] = PROMPT * 3
        call.lookup.min_n, call.lookup.max_n, call.lookup.max_tokens = 1, 3, 6
        call.lookup.max_tokens_by_match[:] = by_match
        return call

    async def scenario():
        servicer = TargetServicer(engine, 1)
        return [await decode(servicer, request(60 + i, b)) for i, b in enumerate(([], [2, 2, 2], [0, 0, 0]))]
    free, capped, none = asyncio.run(scenario())
    assert tokens_of(free) == tokens_of(capped) == tokens_of(none)
    assert max(len(a.draft_token_ids) for a in free) > 2 >= max(len(a.draft_token_ids) for a in capped) > 0
    assert not any(a.draft_token_ids for a in none)


def test_a_lookup_run_that_may_end_on_a_miss_ends_there_without_the_step(engine):
    """end_on_miss (model+ngram: the router has the draft model for the next round): the run stops at the first
    step after the first whose lookup finds no match, answering `missed` and committing nothing for it. A match
    shorter than min_match counts as none: matching 1 to 4 tokens with min_match 4 drafts and ends exactly where
    matching 4 tokens only does, and without min_match it goes on differently."""
    context = list(range(257)) + PROMPT + PROMPT[:4]   # every token occurred before, and this 4-token suffix
    def request(session_id: int, lookup: tuple | None) -> worker_pb2.VerifyRequest:
        call = start(session_id, 0.0, steps=40)
        call.new_token_ids[:] = context
        if lookup:
            (call.lookup.min_n, call.lookup.min_match), call.lookup.max_n, call.lookup.max_tokens = lookup, 4, 6
            call.lookup.end_on_miss = True
        return call

    async def scenario():
        servicer = TargetServicer(engine, 1)
        plain = await decode(servicer, request(50, None))
        runs = [await decode(servicer, request(51 + i, sizes)) for i, sizes in enumerate(((4, 0), (1, 4), (1, 0)))]
        return plain, runs, engine.sessions._sessions[51].length
    plain, (run, refusing, any_match), held = asyncio.run(scenario())
    committed = tokens_of(run[:-1])
    assert run[-1].missed and not run[-1].more and all(a.more for a in run[:-1])
    assert run[0].draft_token_ids and 0 < len(committed) < 40
    assert committed == tokens_of(plain)[:len(committed)]
    assert held == len(context) + len(committed) - 1         # the missed step never ran
    drafts = [[list(a.draft_token_ids) for a in r] for r in (run, refusing, any_match)]
    assert drafts[1] == drafts[0] and drafts[2] != drafts[0]


# ---- the router's choice of runs (router.round_plan.run_plan) ---------------------------------------------

class Policy:
    decode_steps, overlap, predraft_k, prefill_first, hand_off, chain_predrafts = 16, True, 8, False, False, False

    def plain_run_steps(self, state):
        return self.decode_steps

    def answer_delay_s(self, state):
        return 0.0

    def choose_k(self, state, source=None):
        return 5

    def held_k(self, state, source):
        return getattr(self, "model_k", 4)

    def lookup_limits(self, state, k, with_model):
        self.against_model = with_model
        return getattr(self, "min_match", 0), [min(k, n) for n in getattr(self, "ks", [])]

    def choose_source(self, state, candidates, match_size=0):
        self.match_size = match_size
        return candidates[-1]

    def observe(self, state, round_):
        self.observed = round_


class Draft:
    def __init__(self, healthy: bool = True):
        self.healthy = healthy


def router_state(method: str, generated: int = 0, max_new: int = 100):
    from engine.ngram import NgramIndex
    from router.request_state import RequestState
    tokens = PROMPT + [1] * generated
    return RequestState(session_id=1, tokens=tokens, prompt_len=len(PROMPT), max_new_tokens=max_new,
                        sampling=generation_pb2.SamplingParams(top_p=1.0), fixed_k=None,
                        draft_mode=worker_pb2.DRAFT_MODE_GREEDY, max_context=0, method=method,
                        ngram=NgramIndex(2, 4))


@pytest.mark.parametrize("method, draft, source, k, expected", [
    ("model", Draft(), "model", 0, (16, None)),                 # K = 0: a plain run
    ("model", Draft(), "model", 3, (1, None)),                  # speculating: a round as usual
    ("ngram", None, "ngram", 0, (16, (5, False))),              # lookup only: the target looks up, K from the policy
    ("model", Draft(healthy=False), "ngram", 2, (16, (5, False))),   # the fallback while the draft is down
    ("model+ngram", Draft(), "ngram", 3, (16, (3, True))),      # an n-gram round: ends at a miss
    ("model+ngram", Draft(), "model", 4, (1, None)),
    ("model+ngram", Draft(), "model", 0, (16, (5, False))),     # K = 0 where lookup may propose: a lookup run
    ("model", Draft(), "ngram", 0, (16, None)),                 # method model, draft up: no lookup at all
])
def test_which_rounds_are_decode_runs(method, draft, source, k, expected):
    from router.request_state import MODEL, NGRAM
    from router.round_plan import run_plan
    state = router_state(method)
    state.tokens += PROMPT[:3]              # its last 3 tokens occurred before (an n-gram round needs a match)
    policy = Policy()
    policy.model_k = k                      # the K the model's controller holds: no probe
    tokens, lookup = run_plan(state, draft, policy, {"model": MODEL, "ngram": NGRAM}[source], k)
    assert (tokens, lookup and (lookup.max_tokens, lookup.end_on_miss)) == expected
    if lookup:
        assert (lookup.min_n, lookup.max_n) == (2, 4)


@pytest.mark.parametrize("method, draft, expected", [
    ("model", Draft(), (4, None)),                          # a probe: long enough to time plain decoding
    ("model+ngram", Draft(), (4, (5, False))),              # ... looking up drafts as K = 0 would
    ("model", Draft(healthy=False), (16, (5, False))),      # the draft is down: K = 0 is no probe, a whole run
])
def test_a_probe_of_plain_decoding_is_a_short_run_not_a_whole_one(method, draft, expected):
    """While the draft model holds K > 0, a round planned at K = 0 is the policy's probe of plain decoding: its run
    lasts PLAIN_PROBE_STEPS tokens. A whole run at the K the policy had rejected cost a heavy-pair request a third
    of its speed."""
    from router.request_state import MODEL
    from router.round_plan import PLAIN_PROBE_STEPS, run_plan
    state = router_state(method)
    state.tokens += PROMPT[:3]
    tokens, lookup = run_plan(state, draft, Policy(), MODEL, 0)
    assert PLAIN_PROBE_STEPS == 4 and (tokens, lookup and (lookup.max_tokens, lookup.end_on_miss)) == expected


def test_an_ngram_run_of_model_plus_ngram_ends_at_a_miss_only_while_the_draft_model_would_draft():
    """At a miss the next round may use the draft model, so the run ends there; not while the model holds K = 0
    (the next round would be a lookup run again: ending would cost a call for nothing). A request with its own K
    > 0 uses the model at a miss."""
    from router.request_state import NGRAM
    from router.round_plan import run_plan
    state, policy = router_state("model+ngram"), Policy()
    state.tokens += PROMPT[:3]
    ends = [run_plan(state, Draft(), policy, NGRAM, 3)[1].end_on_miss]
    policy.model_k = 0
    ends.append(run_plan(state, Draft(), policy, NGRAM, 3)[1].end_on_miss)
    state.fixed_k = 3
    ends.append(run_plan(state, Draft(), policy, NGRAM, 3)[1].end_on_miss)
    assert ends == [True, False, True]


class PicksModel(Policy):
    def choose_source(self, state, candidates, match_size=0):
        return candidates[0]


@pytest.mark.parametrize("method, draft, policy, matched, fixed_k, expected", [
    ("model+ngram", Draft(), Policy(), True, None, True),          # the context matches and lookup is picked
    ("model+ngram", Draft(), Policy(), False, None, False),        # no match: the model round goes on as planned
    ("model+ngram", Draft(), PicksModel(), True, None, False),     # the policy picks the model there anyway
    ("model+ngram", Draft(), PicksModel(), True, 3, True),         # a request with its own K takes every match
    ("model", Draft(), Policy(), True, None, False),               # method model, draft up: no lookup at all
])
def test_a_round_made_by_a_predraft_hit_pre_drafts_nothing_where_lookup_would_have_been_planned(
        method, draft, policy, matched, fixed_k, expected):
    """A pre-draft hit makes the next round a model round without planning it; where plan_round would have chosen
    prompt lookup (an exact prediction matching again after one round that measured the draft model), that round
    pre-drafts nothing, so that the round after it is planned again instead of chained to the model by hits."""
    from router.round_plan import lookup_first
    state = router_state(method)
    state.fixed_k = fixed_k
    if matched:
        state.tokens += PROMPT[:3]
    assert lookup_first(state, draft, policy) is expected


def test_a_model_plus_ngram_request_run_on_lookup_alone_plans_its_rounds_as_ngram_does():
    """KSelector runs a model+ngram request on prompt lookup alone where that has delivered more: its rounds never
    go to the draft model, its lookup runs do not end at a miss, nor are they short probes of plain decoding while
    the model's controller holds K > 0, and their matches are weighed against plain decoding, not the model."""
    from router.request_state import MODEL, NGRAM
    from router.round_plan import plan_round, run_plan
    state, policy = router_state("model+ngram"), Policy()
    state.lookup_alone = True
    assert plan_round(state, Draft(), policy) == (MODEL, 0)              # no match: K = 0, as for ngram
    assert run_plan(state, Draft(), policy, MODEL, 0)[0] == policy.decode_steps
    state.tokens += PROMPT[:3]
    assert plan_round(state, Draft(), policy) == (NGRAM, 5)
    tokens, lookup = run_plan(state, Draft(), policy, NGRAM, 5)
    assert (tokens, lookup.end_on_miss, policy.against_model) == (policy.decode_steps, False, False)
    state.lookup_alone = False
    assert run_plan(state, Draft(), policy, NGRAM, 5)[1].end_on_miss and policy.against_model


@pytest.mark.parametrize("method, draft, policy_says, expected", [
    ("model+ngram", Draft(), 3, (3, True)),          # against the draft model: matches of 3 or 4 tokens
    ("model+ngram", Draft(), 5, (4, True)),          # none pays, but this round was planned on a 4-token match
    ("ngram", None, 2, (2, False)),                  # against plain decoding
    ("ngram", None, 5, (5, False)),                  # ... where none pays: a plain run
    ("model", Draft(healthy=False), 3, (3, False)),  # the fallback while the draft is down: likewise
])
def test_a_lookup_run_drafts_only_after_matches_as_long_as_the_policy_finds_worth_it(method, draft, policy_says,
                                                                                     expected):
    from router.request_state import NGRAM
    from router.round_plan import run_plan
    state, policy = router_state(method), Policy()
    state.tokens += [101, 102, 103, 104, 105, 101, 102, 103, 104]     # its suffix matched 4 tokens back
    policy.min_match = policy_says
    _, lookup = run_plan(state, draft, policy, NGRAM, 3)
    assert (lookup.min_match, policy.against_model) == expected
    state.fixed_k = 3                       # a request with its own K drafts after any match (a rule of its tokens)
    assert run_plan(state, draft, policy, NGRAM, 3)[1].min_match == 0


def test_a_lookup_run_drafts_after_each_match_length_as_many_tokens_as_the_policy_finds_worth_it():
    """The policy's K per match length travels within the run's K; a request with its own K drafts up to it after
    every length."""
    from router.request_state import NGRAM
    from router.round_plan import run_plan
    state, policy = router_state("ngram"), Policy()
    policy.ks = [1, 4, 8]
    lookup = run_plan(state, None, policy, NGRAM, 0)[1]
    assert (lookup.max_tokens, list(lookup.max_tokens_by_match)) == (5, [1, 4, 5])
    state.fixed_k = 3
    assert list(run_plan(state, None, policy, NGRAM, 3)[1].max_tokens_by_match) == []


def test_a_round_knows_the_length_of_the_match_its_ngram_drafts_followed():
    """plan_round tells the policy the match at hand; a round of n-gram drafts is observed with the length of the
    match before it (its context: the tokens committed before it)."""
    from router.controller import RoundTimings
    from router.request_state import NGRAM, Round
    from router.round_plan import plan_round
    from router.speculation import conclude
    state, policy = router_state("model+ngram"), Policy()
    state.tokens += [101, 102, 103, 104, 105, 101, 102, 103]     # its suffix matched 3 tokens back
    assert plan_round(state, Draft(), policy) == (NGRAM, 5) and policy.match_size == 3
    conclude(state, policy, Round([104, 9], 1, [104, 7], RoundTimings(), source=NGRAM), None)
    assert policy.observed.match_size == 3 and state.tokens[-2:] == [104, 7]
    conclude(state, policy, Round([], 0, [8], RoundTimings(), source=NGRAM), None)
    assert policy.observed.match_size == 0                       # no drafts: no match to learn about


def test_a_run_stays_within_max_new_tokens_and_runs_turn_off_with_one_step():
    from router.request_state import MODEL
    from router.round_plan import run_plan
    plain = Policy()
    plain.model_k = 0
    assert run_plan(router_state("model", generated=95), Draft(), plain, MODEL, 0) == (5, None)
    assert run_plan(router_state("ngram", generated=97), None, Policy(), MODEL, 0)[1].max_tokens == 2
    off = Policy()
    off.decode_steps = 1
    assert run_plan(router_state("model"), Draft(), off, MODEL, 0) == (1, None)


def test_a_request_pinned_to_k0_decodes_to_its_end_in_one_run():
    from router.request_state import MODEL
    from router.round_plan import run_plan
    pinned = router_state("model", generated=20)
    pinned.fixed_k = 0
    assert run_plan(pinned, Draft(), Policy(), MODEL, 0) == (80, None)        # all 80 tokens left, not 16
    pinned.method = "model+ngram"                                             # lookup may propose: runs of 16
    assert run_plan(pinned, Draft(), Policy(), MODEL, 0)[0] == 16
