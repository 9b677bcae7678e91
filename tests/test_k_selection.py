"""Trace-driven tests of router/k_selection.py: K statistics per sampling regime and per proposal source.
No models, no Ray, no wall clock: the cost model and common-random-number traces of tests/test_controller.py
(but for one test of the Router that serves a request run on lookup alone, over a fake target:
tests/fake_workers.py).

Mixed traffic: requests alternate between greedy (the greedy draft often matches the target's argmax, α 0.8)
and sampled at a high temperature (it rarely matches the target's sample, α 0.1), 40 rounds each. Each regime's
throughput (its tokens / its rounds' time) is compared with the best fixed K for that regime on the same trace.
"""
from __future__ import annotations

import asyncio
import random

import pytest

from protos.specpool.v1 import generation_pb2, worker_pb2
from router import k_selection
from router.controller import RoundTimings
from router.k_selection import Delivered, KSelector, regime, source_config
from router.metrics import Metrics
from router.request_state import MODEL, NGRAM, RequestState, Round
from router.worker_client import DraftClient
from tests.test_controller import K_MAX, CostModel, make_trace, sequential

ALPHA = {"greedy": 0.8, "sampled": 0.1}
REQUESTS, ROUNDS_PER_REQUEST = 120, 40
TOLERANCE = 0.05
COST = CostModel()


def request_state(index: int, draft_mode: int) -> RequestState:
    temperature = 0.0 if index % 2 == 0 else 1.2
    return RequestState(session_id=index, tokens=[1], prompt_len=1, max_new_tokens=10 ** 6,
                        sampling=generation_pb2.SamplingParams(temperature=temperature, top_p=1.0), fixed_k=None,
                        draft_mode=draft_mode, max_context=0)


def play(k: int, alpha: float, uniforms, jit) -> tuple[int, RoundTimings, float]:
    """One round at K = k: (accepted, its timings, its duration) under the cost model."""
    accepted = 0
    while accepted < k and uniforms[accepted] < alpha:
        accepted += 1
    draft, verify = k * COST.t_draft * jit[0], (COST.verify_base + COST.verify_per_k * k) * jit[1]
    rtt, draft_rtt = COST.rtt * jit[2], (COST.rtt * jit[3] if k else 0.0)
    return accepted, RoundTimings(draft, None, draft_rtt, verify, rtt), draft + verify + rtt + draft_rtt


def mixed_traffic(choose, draft_mode: int = worker_pb2.DRAFT_MODE_GREEDY, selector: KSelector | None = None):
    """Run the mixed trace; `choose(selector, state)` gives each round's K. Per regime: throughput and the Ks."""
    trace = make_trace(tuple([0.0] * (REQUESTS * ROUNDS_PER_REQUEST)), 11, COST.jitter)
    selector = selector or KSelector(sequential(k_max=K_MAX), Metrics(), random.Random(3))
    totals = {name: [0.0, 0.0, []] for name in ALPHA}
    for index in range(REQUESTS):
        state = request_state(index, draft_mode)
        selector.attach(state)
        total = totals[regime(state)]
        for step in range(ROUNDS_PER_REQUEST):
            _, uniforms, jit = trace[index * ROUNDS_PER_REQUEST + step]
            k = choose(selector, state)
            accepted, timings, seconds = play(k, ALPHA[regime(state)], uniforms, jit)
            selector.observe(state, Round([0] * k, accepted, [0] * (accepted + 1), timings))
            total[0], total[1] = total[0] + accepted + 1, total[1] + seconds
            total[2].append(k)
        selector.detach(state)
    return {name: (tokens / seconds, ks) for name, (tokens, seconds, ks) in totals.items()}


def best_fixed() -> dict[str, tuple[int, float]]:
    """Per regime: (the best fixed K, its throughput) on the same trace."""
    runs = {k: mixed_traffic(lambda selector, state, k=k: k) for k in range(K_MAX + 1)}
    return {name: max(((k, runs[k][name][0]) for k in runs), key=lambda kv: kv[1]) for name in ALPHA}


@pytest.mark.parametrize("draft_mode", [worker_pb2.DRAFT_MODE_GREEDY, worker_pb2.DRAFT_MODE_SAMPLED],
                         ids=["greedy-draft", "sampled-draft"])
def test_each_regime_within_5pct_of_its_best_fixed_k(draft_mode):
    best = best_fixed()
    adaptive = mixed_traffic(KSelector.choose_k, draft_mode)
    for name in ALPHA:
        ratio = adaptive[name][0] / best[name][1]
        print(f"{name}: best fixed K={best[name][0]}, adaptive/best = {ratio:.3f}")
        assert ratio >= 1 - TOLERANCE, (name, ratio, best[name])
    assert best["sampled"][0] == 0 and best["greedy"][0] >= 3             # the regimes want different Ks
    sampled_ks = adaptive["sampled"][1]
    assert sampled_ks.count(0) > 0.8 * len(sampled_ks)                     # K falls to 0 for sampled traffic


def test_one_pooled_statistic_misses_the_sampled_regime(monkeypatch):
    """What per-regime statistics fix: one statistic for all traffic gives sampled requests a greedy K."""
    best = best_fixed()
    monkeypatch.setattr(k_selection, "regime", lambda state: "greedy")
    pooled = mixed_traffic(KSelector.choose_k)
    monkeypatch.undo()
    ratio = pooled["sampled"][0] / best["sampled"][1]
    print(f"pooled statistics: sampled adaptive/best = {ratio:.3f}")
    assert ratio < 1 - TOLERANCE


def test_a_request_uses_its_regimes_pool_statistics_until_it_has_drafted_enough():
    selector = KSelector(sequential(k_max=K_MAX, warmup_rounds=4, probe_every=0), Metrics(), random.Random(0))
    greedy, sampled = request_state(0, 0), request_state(1, 0)
    for state in (greedy, sampled):
        selector.attach(state)
    assert selector.controller(sampled) is selector.pools[(MODEL, "sampled")]
    for _ in range(3):
        selector.observe(sampled, Round([0, 0], 0, [0], RoundTimings()))
    selector.observe(sampled, Round([], 0, [0], RoundTimings()))           # K = 0 teaches no acceptance
    assert selector.controller(sampled) is selector.pools[(MODEL, "sampled")]
    selector.observe(sampled, Round([0, 0], 0, [0], RoundTimings()))
    assert selector.controller(sampled) is sampled.controller[MODEL]
    assert selector.pools[(MODEL, "greedy")].rounds == 0                  # greedy statistics untouched
    assert selector.controller(greedy) is selector.pools[(MODEL, "greedy")]


def test_the_k_gauge_shows_the_k_a_warmed_up_request_holds_not_the_pools_stale_one():
    """A request's own controller decides once it has drafted warmup_rounds; nobody steps the pool's policy
    meanwhile, so the gauge (and status's "k") follow the K of the controller that chose, its probes aside."""
    metrics = Metrics()
    selector = KSelector(sequential(k_max=K_MAX, k=4, warmup_rounds=4, probe_every=0), metrics, random.Random(0))
    state = request_state(0, 0)
    selector.attach(state)
    rejected = RoundTimings(draft_seconds=0.01, verify_seconds=0.002, rtt_seconds=0.001)
    for _ in range(40):                       # every draft rejected, drafting slow: K = 0 pays
        k = selector.choose_k(state)
        selector.observe(state, Round([0] * k, 0, [0], rejected))
    assert selector.controller(state) is state.controller[MODEL]
    assert selector.pool.k == 4 and state.controller[MODEL].k == 0
    assert selector.k_now == 0 and metrics.k._value.get() == 0 and selector.k_from == "request model"


def test_with_ngram_only_the_k_shown_is_the_ngram_controllers_and_says_so():
    """With draft.method ngram no round asks the draft model's controller, so status's "k" (and the gauge) used
    to show its unused K; now the n-gram controller's, and "k_from" names the controller: the pool's before a
    request warms up, then the request's own; a reload shows its regime's pool again."""
    metrics = Metrics()
    config = sequential(k_max=K_MAX, k=4, warmup_rounds=4, probe_every=0)
    selector = KSelector(config, metrics, random.Random(0), ngram_tokens=3)
    assert (selector.k_now, selector.k_from) == (4, "pool model/greedy")        # no request has said yet
    state = request_state(0, 0)
    state.method = "ngram"
    selector.attach(state)
    assert selector.choose_k(state, NGRAM) == 3
    assert (selector.k_now, selector.k_from, metrics.k._value.get()) == (3, "pool ngram/greedy", 3)
    rejected = RoundTimings(draft_seconds=1e-5, verify_seconds=0.002, rtt_seconds=0.001)
    for _ in range(40):                       # every lookup draft rejected: K = 0 pays
        k = selector.choose_k(state, NGRAM)
        selector.observe(state, Round([0] * k, 0, [0], rejected, source=NGRAM))
    assert selector.pool.k == 4 and (selector.k_now, selector.k_from) == (0, "request ngram")
    selector.update_config(config, ngram_tokens=2)
    assert (selector.k_now, selector.k_from) == (2, "pool ngram/greedy")
    fresh = KSelector(config, Metrics(), random.Random(0), ngram_tokens=3, method="ngram")
    assert (fresh.k_now, fresh.k_from) == (3, "pool ngram/greedy")


def test_sources_learn_separately_and_the_faster_one_is_chosen():
    """N-gram rounds feed the n-gram controllers only; with lookup accepting far better here (and costing no
    call), the selector prefers it, and a source whose acceptance collapses loses the choice."""
    config = sequential(k_max=K_MAX, probe_every=0)
    selector = KSelector(config, Metrics(), random.Random(0), ngram_tokens=12)
    state = request_state(0, 0)
    selector.attach(state)
    assert selector.pools[(NGRAM, "greedy")].config.k_max == 12 and source_config(config, MODEL, 12) is config
    timings = RoundTimings(draft_seconds=0.4, draft_rtt_seconds=0.2, verify_seconds=1.2, rtt_seconds=0.2)
    lookup = RoundTimings(draft_seconds=1e-5, draft_rtt_seconds=0.0, verify_seconds=1.2, rtt_seconds=0.2)
    for _ in range(40):
        selector.observe(state, Round([0] * 4, 2, [0] * 3, timings))
        selector.observe(state, Round([0] * 6, 6, [0] * 7, lookup, source=NGRAM))
    assert selector.pools[(MODEL, "greedy")].rounds == 40 and selector.pools[(NGRAM, "greedy")].rounds == 40
    assert selector.choose_source(state, [MODEL, NGRAM]) == NGRAM
    for _ in range(60):
        selector.observe(state, Round([0] * 6, 0, [0], lookup, source=NGRAM))
    assert selector.choose_source(state, [MODEL, NGRAM]) == MODEL
    metric = selector.metrics.registry.get_sample_value
    assert metric("specpool_spec_decode_source_num_drafts_total", {"source": "ngram"}) == 100
    assert metric("specpool_spec_decode_source_num_drafts_total", {"source": "model"}) == 40
    per_pos = {"source": "ngram", "position": "5"}
    assert metric("specpool_spec_decode_source_num_draft_tokens_per_pos_total", per_pos) == 100
    assert metric("specpool_spec_decode_source_num_accepted_tokens_per_pos_total", per_pos) == 40
    assert metric("specpool_spec_decode_source_num_accepted_tokens_per_pos_total",
                  {"source": "model", "position": "1"}) == 40
    assert metric("specpool_spec_decode_source_num_accepted_tokens_per_pos_total",
                  {"source": "model", "position": "2"}) is None


# -- model+ngram on measured costs --------------------------------------------------------------------------------

REQUEST_ROUNDS = 50           # rounds per request of method_run
LOOKUP_MATCH = 0.35            # share of rounds whose context has an n-gram match (input-grounded set: about 1/3)
LOOKUP_ALPHA = {MODEL: 0.55, NGRAM: 0.7}
# Drafts after a long match are accepted far more often than after a short one (demo pair, input-grounded set:
# a first draft accepted 85 % of the time after a 4-token match, 25-40 % after 1 to 3): {match length: alpha}
MATCH_ALPHA = {4: 0.85, 2: 0.25}


def heavy_costs():
    """Per-call costs (ms) of the heavy pair's in-turn rows (benchmarks/results/results.md): the verify dwarfs a
    draft call, so the draft model pays there."""
    from tests.test_controller_measured import Measured
    return Measured(draft_fixed=1.0, draft_per_token=0.65, draft_rtt=1.0, verify_plain=14.8, verify_base=16.6,
                    verify_per_token=0.6, rtt_plain=0.1, rtt_busy=1.1, between=0.1)


def play_round(selector: KSelector, state: RequestState, cost, source: int, k: int, alpha: float, rng,
               match_size: int = 0, catch_up: float = 0.0) -> tuple[int, float]:
    """One round of K drafts from `source`, each accepted with chance alpha, observed by the selector at `cost`'s
    per-call costs (in turn), timed as a whole (Round.parts): (tokens committed, its seconds). `catch_up`: what the
    draft call first spends absorbing committed tokens (a model round after rounds of another kind), timed as
    the router times it (draft_catch_up: left out of the cost model's fit)."""
    accepted = next((j for j in range(k) if rng.random() >= alpha), k)
    model = bool(k) and source == MODEL
    draft_s, draft_rtt = (cost.draft(k) + catch_up, cost.draft_rtt) if model else (1e-3 * k, 0.0)
    verify_s, rtt = cost.verify(k, False)
    timings = RoundTimings(draft_s, None, draft_rtt, verify_s, rtt, between_seconds=cost.between,
                           draft_catch_up=10 if model and catch_up else 0)
    seconds = cost.between + draft_s + draft_rtt + verify_s + rtt
    round_ = Round([0] * k, accepted, [0] * (accepted + 1), timings, source=source,
                   match_size=match_size if source == NGRAM and k else 0)
    round_.parts = {"round": seconds}
    selector.observe(state, round_)
    return accepted + 1, seconds


def method_run(method: str, rounds: int = 3000, cost=None, match_alpha: dict | None = None,
               blind: bool = False, catch_up: float = 0.0, alpha: dict | None = None) -> tuple[float, dict]:
    """Greedy requests of REQUEST_ROUNDS rounds under `cost` (default: tests.test_controller_measured's MEASURED, in
    turn), their sources picked as round_plan.plan_round picks them: n-gram where the context matches (method
    ngram, or model+ngram by the selector), else the draft model (model, model+ngram) or plain decoding (ngram, or
    a model+ngram request the selector runs on lookup alone). With `match_alpha`, a match is of one of its
    lengths, equally often, and its drafts accept at that length's rate; `blind`: the selector is not told the
    length. A model round after a round of another kind pays `catch_up` ms more, timed as the router times a
    draft's catch-up. `alpha`: per source (LOOKUP_ALPHA). Returns (tokens per ms, rounds per (source, K > 0), and
    of requests drafting from both sources, n-gram rounds per match length ("ngram after", n); "lookup alone":
    requests run so)."""
    from engine.ngram import NgramIndex
    from tests.test_controller_measured import MEASURED
    cost, alpha = cost or MEASURED, alpha or LOOKUP_ALPHA
    selector = KSelector(sequential(k_max=K_MAX), Metrics(), random.Random(5), ngram_tokens=K_MAX, method=method)
    rng, tokens, elapsed, used, last = random.Random(9), 0.0, 0.0, {}, MODEL
    for index in range(rounds):
        if index % REQUEST_ROUNDS == 0:
            state = request_state(0, worker_pb2.DRAFT_MODE_GREEDY)
            state.ngram, state.method = NgramIndex(2, 4), method
            selector.attach(state)
            used["lookup alone"] = used.get("lookup alone", 0) + state.lookup_alone
        match = method != "model" and rng.random() < LOOKUP_MATCH
        size = rng.choice(sorted(match_alpha)) if match and match_alpha else 0
        candidates = [s for s, ok in ((MODEL, method != "ngram" and not state.lookup_alone), (NGRAM, match)) if ok]
        source = (selector.choose_source(state, candidates, 0 if blind else size) if len(candidates) > 1
                  else candidates[0] if candidates else NGRAM)
        k = selector.choose_k(state, source) if candidates else 0
        rate = match_alpha[size] if source == NGRAM and size else alpha[source]
        drafting = source == MODEL and k > 0
        committed, seconds = play_round(selector, state, cost, source, k, rate, rng, size,
                                        catch_up if drafting and last != MODEL else 0.0)
        tokens, elapsed, last = tokens + committed, elapsed + seconds, MODEL if drafting else NGRAM
        used[(source, k > 0)] = used.get((source, k > 0), 0) + 1
        if source == NGRAM and k and size and not state.lookup_alone:
            used[("ngram after", size)] = used.get(("ngram after", size), 0) + 1
    return tokens / elapsed, used


def test_model_plus_ngram_at_least_as_fast_as_the_better_source():
    """The draft model does not pay here (alpha 0.55: plain decoding beats every K on these costs) and lookup
    does where it matches. model+ngram must keep up with ngram alone (lookup where it matches, plain decoding
    elsewhere): its model controller has to fall to K = 0 on the rounds with no match, or its requests run on
    lookup alone. Measured: 0.991 of ngram (55 of its 60 requests on lookup alone); mixing the sources in every
    request, 0.936; the old controller (T(0) extrapolated from drafting rounds), 0.913. The gap left is the price
    of the probes of both sources, which ngram alone never pays."""
    rates = {method: method_run(method) for method in ("model", "ngram", "model+ngram")}
    for method, (rate, used) in rates.items():
        print(f"{method}: {rate:.4f} tokens/ms, rounds by (source, drafting): {used}")
    better = max(rates["model"][0], rates["ngram"][0])
    assert rates["model+ngram"][0] >= 0.97 * better
    drafted_by_model = rates["model+ngram"][1].get((MODEL, True), 0)
    assert drafted_by_model < 0.2 * 3000


def test_model_plus_ngram_runs_on_lookup_alone_where_mixing_the_sources_delivers_less(monkeypatch):
    """Here the draft model pays on its own rounds (alpha 0.7: 0.245 tokens/ms against plain decoding's 0.213), but
    a model round takes the round that lookup might have drafted next, and its draft first catches up on the
    tokens lookup committed (4 ms, left out of the cost model's fit as a one-off, as the router leaves it out). The
    model's controller keeps drafting, and model+ngram delivered 0.81 of lookup alone; run on lookup alone where
    that has delivered more, it keeps up with it (measured: 0.967), its model probes (random_probe) the price."""
    lookup_alone = {MODEL: 0.7, NGRAM: 0.7}
    rates = {method: method_run(method, catch_up=4.0, alpha=lookup_alone) for method in ("model", "ngram",
                                                                                       "model+ngram")}
    monkeypatch.setattr(KSelector, "_lookup_alone", lambda self, state: False)
    mixing, _ = method_run("model+ngram", catch_up=4.0, alpha=lookup_alone)
    for method, (rate, used) in rates.items():
        print(f"{method}: {rate:.4f} tokens/ms, rounds by (source, drafting): {used}")
    better = max(rates["model"][0], rates["ngram"][0])
    print(f"model+ngram mixing every request: {mixing / better:.3f} of the better source")
    assert rates["ngram"][0] > rates["model"][0] and mixing < 0.85 * better
    assert rates["model+ngram"][0] >= 0.95 * better
    assert rates["model+ngram"][1]["lookup alone"] >= 0.85 * 3000 / REQUEST_ROUNDS


def observe_timed_rounds(selector: KSelector, state: RequestState, n: int, seconds_per_token: float,
                         drafts: int = 2) -> None:
    """Have the selector observe n rounds of the request, each of `drafts` drafts with one accepted (two tokens
    committed), timed as a whole (Round.parts) at `seconds_per_token` per token committed."""
    for _ in range(n):
        round_ = Round([0] * drafts, 1, [0, 0], RoundTimings())
        round_.parts = {"verify_compute": 2 * seconds_per_token}
        selector.observe(state, round_)


def test_a_model_plus_ngram_request_runs_on_lookup_alone_where_that_has_delivered_more():
    """Per regime: the less measured way until both have warmup_rounds behind them, then the way that delivered
    more tokens per second, the other with chance random_probe; methods model and ngram, and a request with its own
    K, are never run so (and a request with its own K counts towards neither)."""
    from engine.ngram import NgramIndex
    selector = KSelector(sequential(k_max=K_MAX, random_probe=0.1), Metrics(), random.Random(2), method="model+ngram")

    def request(method="model+ngram", index=0, fixed_k=None):
        state = request_state(index, worker_pb2.DRAFT_MODE_GREEDY)
        state.ngram, state.method, state.fixed_k = NgramIndex(2, 4), method, fixed_k
        selector.attach(state)
        return state

    first = request()
    assert not first.lookup_alone                                 # nothing measured: both sources
    observe_timed_rounds(selector, first, 20, 0.004)              # both: 250 tokens/s
    second = request()
    assert second.lookup_alone                                    # the less measured way
    observe_timed_rounds(selector, second, 10, 0.002)             # lookup alone: 500 tokens/s, not yet warmup_rounds
    assert request().lookup_alone
    observe_timed_rounds(selector, request("ngram"), 10, 0.002)   # method ngram counts as lookup alone
    # A request with its own K counts towards neither, and so does one that fell back to lookup while the draft
    # was down.
    observe_timed_rounds(selector, request(fixed_k=3), 50, 0.001)
    fell_back = request()
    fell_back.fell_back = True
    observe_timed_rounds(selector, fell_back, 50, 0.001)
    assert selector.delivery()["greedy"] == {"both_tokens_per_s": 250.0, "both_rounds": 19.3,
                                             "lookup_alone_tokens_per_s": 500.0, "lookup_alone_rounds": 19.3,
                                             "new_requests": "lookup alone"}
    chosen = [request().lookup_alone for _ in range(1000)]
    assert 0.85 < sum(chosen) / 1000 < 0.95       # lookup alone, but for random_probe's 10 %
    assert not request(fixed_k=3).lookup_alone and not request("model").lookup_alone
    assert not request("model+ngram", index=1).lookup_alone       # the sampled regime has measured nothing
    both = request()
    both.lookup_alone = False                                     # a probe of both sources ...
    observe_timed_rounds(selector, both, 200, 0.001)              # ... now at 1000 tokens/s
    chosen = [request().lookup_alone for _ in range(1000)]
    assert 0.05 < sum(chosen) / 1000 < 0.15
    assert selector.delivery()["greedy"]["new_requests"] == "both sources"


def test_the_lookup_way_is_decided_once_both_have_half_a_cost_window_behind_them_whatever_warmup_rounds_says():
    """The decayed weight of rounds approaches cost_window and never reaches it: a warm-up as long as the window
    must still end."""
    from engine.ngram import NgramIndex
    selector = KSelector(sequential(k_max=K_MAX, warmup_rounds=64, cost_window=64), Metrics(), random.Random(2),
                         method="model+ngram")
    for alone, seconds_per_token in ((False, 0.001), (True, 0.0005)):
        state = request_state(0, worker_pb2.DRAFT_MODE_GREEDY)
        state.ngram, state.method, state.lookup_alone = NgramIndex(2, 4), "model+ngram", alone
        # 45 rounds: weight 64 * (1 - (63/64) ** 45) = 32.5
        observe_timed_rounds(selector, state, 45, seconds_per_token, drafts=1)
    assert selector.lookup_way("greedy") == (True, True)


class DraftSpy(DraftClient):
    """A draft replica that records each call the router makes to it and answers none: the call raises, failing
    the request (a release's failure is only recorded: the router ignores it)."""

    def __init__(self):
        super().__init__("127.0.0.1:1", name="draft 0")
        self.calls: list[str] = []

    def _called(self, name: str) -> AssertionError:
        self.calls.append(name)
        return AssertionError(f"the draft got a {name} call")

    async def propose(self, *args, **kwargs):
        raise self._called("propose")

    def propose_chained(self, *args, **kwargs):
        raise self._called("propose_chained")

    async def release(self, session_id: int) -> None:
        raise self._called("release")


async def serve_on_lookup_alone(new_tokens: int) -> tuple[RequestState, list[int], int, list[str]]:
    """One greedy model+ngram request through Router.run, over a fake target and a DraftSpy, where lookup alone has
    delivered twice what both sources have (probing off, so KSelector.attach runs it on lookup alone): (its state,
    the draft's sessions at each chunk, the tokens it streamed, the calls the draft got)."""
    from router.server import Router
    from router.worker_client import TargetClient
    from settings.schema import config_from_dict
    from tests.fake_workers import VOCAB, FakeTarget, tokenizer
    target, draft = FakeTarget(), DraftSpy()
    config = config_from_dict({"router": {"host": "127.0.0.1", "port": 0}, "draft": {"method": "model+ngram"},
                               "speculation": {"probe_every": 0}})
    info = {"eos_token_ids": [0], "vocab_size": len(VOCAB), "max_context": 4096, "model_path": "fake"}
    router = Router(config, [draft], [TargetClient(await target.start(), name="target 0")], info, tokenizer())
    router.k_selector.delivered.update({("both", "greedy"): Delivered(100.0, 1.0, 64.0),
                                        ("lookup", "greedy"): Delivered(200.0, 1.0, 64.0)})
    state = await router.admit(generation_pb2.GenerateRequest(prompt_token_ids=[2, 3, 4, 2, 3, 4],
                                                              max_new_tokens=new_tokens))
    sessions, streamed = [], 0
    try:
        async for tokens in router.run(state):
            sessions.append(draft.outstanding)
            streamed += len(tokens)
    finally:
        await router.close()
        await target.kill()
    return state, sessions, streamed, draft.calls


def test_a_request_run_on_lookup_alone_takes_no_draft_replica_and_never_calls_the_draft():
    """Router.run gives a model+ngram request that KSelector.attach runs on prompt lookup alone no draft replica
    (the draft's session count stays 0 while it runs), and none of its rounds, nor its end, calls the draft."""
    state, sessions, streamed, calls = asyncio.run(serve_on_lookup_alone(100))
    assert state.method == "model+ngram" and state.lookup_alone and streamed == 100
    assert sessions and set(sessions) == {0}
    assert calls == []


def test_model_plus_ngram_drafts_by_lookup_after_long_matches_and_by_the_model_after_short_ones():
    """On the heavy pair's costs the draft model pays (alpha 0.55), and so do n-gram drafts after a 4-token match
    (0.85), while those after a 2-token match (0.25) lose to the model. Told each match's length, model+ngram uses
    each source where it is better and beats both alone; blind to it, it learns one n-gram rate for both lengths,
    and mixing the sources so delivers less than lookup alone, on which it then runs most requests. Measured: told
    1.035x the better one (ngram), blind 1.005x (0.965x before requests could run on lookup alone). Requests drafting
    from both sources drafted by lookup after 93 % of the 4-token matches and 31 % of the 2-token ones (one request
    of 3000 rounds: 88 % and 14 %; requests of 50 rounds, none on lookup alone: 87 % and 22 %)."""
    heavy = heavy_costs()
    rates = {name: method_run(method, cost=heavy, match_alpha=MATCH_ALPHA, blind=blind)
             for name, method, blind in (("model", "model", False), ("ngram", "ngram", False),
                                         ("model+ngram", "model+ngram", False), ("blind", "model+ngram", True))}
    for name, (rate, used) in rates.items():
        print(f"{name}: {rate:.4f} tokens/ms, rounds by (source, drafting): {used}")
    better = max(rates["model"][0], rates["ngram"][0])
    assert rates["model+ngram"][0] >= 1.02 * better
    assert rates["model+ngram"][0] >= 1.02 * rates["blind"][0] and rates["blind"][0] >= 0.99 * rates["ngram"][0]
    assert rates["model+ngram"][1]["lookup alone"] < 0.25 * 3000 / REQUEST_ROUNDS < rates["blind"][1]["lookup alone"]
    used = rates["model+ngram"][1]
    offered = (3000 - REQUEST_ROUNDS * used["lookup alone"]) * LOOKUP_MATCH / 2   # matches of each length, about,
                                                                                # in requests drafting from both
    assert used[("ngram after", 4)] > 0.85 * offered and used.get(("ngram after", 2), 0) < 0.35 * offered


def test_lookup_runs_draft_after_the_shortest_match_that_beats_the_alternative():
    """Trained on the heavy pair's costs, drafts after 2-token matches lose even to plain decoding (alpha 0.1),
    after 3 beat plain decoding but not the draft model (0.35), after 4 beat both (0.85): a run drafts after
    matches of 4 tokens where the model is the alternative, of 3 or more where plain decoding is; a length no
    round has drafted after yet models as the n-gram controller does (here: worth it)."""
    from engine.ngram import NgramIndex
    cost, rng = heavy_costs(), random.Random(1)
    selector = KSelector(sequential(k_max=K_MAX, probe_every=0), Metrics(), random.Random(0), ngram_tokens=K_MAX)
    state = request_state(0, worker_pb2.DRAFT_MODE_GREEDY)
    state.ngram = NgramIndex(2, 4)
    selector.attach(state)
    for _ in range(200):
        for source, size, k, alpha in ((MODEL, 0, 4, 0.55), (NGRAM, 2, 4, 0.1), (NGRAM, 3, 4, 0.35),
                                       (NGRAM, 4, 8, 0.85), (MODEL, 0, 0, 0.0), (NGRAM, 0, 0, 0.0)):
            play_round(selector, state, cost, source, k, alpha, rng, size)
    assert selector.lookup_limits(state, K_MAX, with_model=True)[0] == 4
    assert selector.lookup_limits(state, K_MAX, with_model=False)[0] == 3
    assert [selector.choose_source(state, [MODEL, NGRAM], n) for n in (2, 3, 4)] == [MODEL, MODEL, NGRAM]
    assert "ngram/greedy/match 4+" in selector.snapshot() and "ngram/greedy/match 3" in selector.snapshot()
    fresh = KSelector(sequential(k_max=K_MAX, probe_every=0), Metrics(), random.Random(0), ngram_tokens=K_MAX)
    assert fresh.lookup_limits(state, K_MAX, with_model=False)[0] == 2
    probing = KSelector(sequential(k_max=K_MAX, random_probe=1.0), Metrics(), random.Random(0), ngram_tokens=K_MAX)
    probing.by_match = selector.by_match
    assert probing.lookup_limits(state, K_MAX, with_model=True) == (2, [])   # a probe: every length counts


def test_lookup_drafts_after_each_match_length_as_many_tokens_as_its_own_acceptance_is_worth():
    """On the heavy pair's costs (a verify costs more per token), drafts after 2-token matches (alpha 0.1) are
    worth one token, after 4-token ones (0.85) the most allowed; 3 (0.35) in between. Within the run's K; none
    on a probe (every length drafts up to the run's K, so that longer drafts stay measured)."""
    from engine.ngram import NgramIndex
    cost, rng = heavy_costs(), random.Random(1)
    selector = KSelector(sequential(k_max=K_MAX, probe_every=0), Metrics(), random.Random(0), ngram_tokens=K_MAX)
    state = request_state(0, worker_pb2.DRAFT_MODE_GREEDY)
    state.ngram = NgramIndex(2, 4)
    selector.attach(state)
    for _ in range(300):                # at varying K, so that a verify's cost per token is learned
        for size, alpha in ((2, 0.1), (3, 0.35), (4, 0.85)):
            play_round(selector, state, cost, NGRAM, rng.randint(1, K_MAX), alpha, rng, size)
    ks = selector.lookup_limits(state, K_MAX, with_model=False)[1]
    assert ks[0] == 1 and 1 <= ks[1] < K_MAX and ks[2] == K_MAX and ks == sorted(ks), ks
    assert selector.lookup_limits(state, 3, with_model=False)[1] == [min(k, 3) for k in ks]
    assert [selector.match_k(state, size, k) for size in (2, 3, 4) for k in (3, K_MAX)] == [
        min(size_k, k) for size_k in ks for k in (3, K_MAX)]        # one length's K: the same figures
    probing = KSelector(sequential(k_max=K_MAX, random_probe=1.0), Metrics(), random.Random(0), ngram_tokens=K_MAX)
    probing.by_match = selector.by_match
    assert probing.lookup_limits(state, K_MAX, with_model=False) == (2, [])
    assert probing.match_k(state, 2, K_MAX) == K_MAX


def test_a_reload_to_longer_ngrams_keeps_the_old_longest_size_apart():
    """A match of the longest size means "at least that long": after ngram_max grows, the same length is counted
    apart from it."""
    from engine.ngram import NgramIndex
    selector = KSelector(sequential(k_max=K_MAX), Metrics(), random.Random(0), ngram_tokens=K_MAX)
    state = request_state(0, worker_pb2.DRAFT_MODE_GREEDY)
    state.ngram = NgramIndex(2, 4)
    longest = selector.match_controller(state, 4)
    state.ngram = NgramIndex(2, 6)
    assert selector.match_controller(state, 4) is not longest and selector.match_controller(state, 6) is not longest


def test_a_reload_of_k_moves_every_controller_to_it_and_one_of_anything_else_none():
    """Pool controllers of every source and regime, requests' own (here at K = 0, their choice) and the
    per-match-length ones all hold the new k after a reload that changes it (the n-gram ones within
    ngram_max_tokens), keeping their statistics; a reload that changes only ngram_max_tokens moves none of them
    (it clamps the n-gram ones)."""
    from engine.ngram import NgramIndex
    selector = KSelector(sequential(k_max=K_MAX, k=4, warmup_rounds=4), Metrics(), random.Random(0),
                         ngram_tokens=K_MAX)
    state = request_state(0, worker_pb2.DRAFT_MODE_GREEDY)
    state.ngram = NgramIndex(2, 4)
    selector.attach(state)
    rejected = RoundTimings(draft_seconds=0.01, verify_seconds=0.002, rtt_seconds=0.001)
    for _ in range(40):                       # every draft rejected, drafting slow: every policy falls to K = 0
        for source in (MODEL, NGRAM):
            k = selector.choose_k(state, source)
            selector.observe(state, Round([0] * k, 0, [0], rejected, source=source, match_size=3 if k else 0))
    controllers = [*selector.pools.values(), *state.controller.values(), *selector.by_match.values()]
    assert len(selector.by_match) == 1 and [c.k for c in controllers] == [4, 4, 4, 4, 0, 0, 4]   # own ones decided
    samples = [c.snapshot()["samples"] for c in controllers]

    selector.update_config(sequential(k_max=K_MAX, k=6, warmup_rounds=4), ngram_tokens=5)
    assert [c.k for c in controllers] == [6, 6, 5, 5, 6, 5, 5]       # pools (model, ngram) x regimes, own, match
    assert [c.snapshot()["samples"] for c in controllers] == [s[:c.config.k_max] for s, c in zip(samples, controllers)]
    assert selector.choose_k(state, MODEL) == 6 and selector.choose_k(state, NGRAM) == 5

    selector.update_config(sequential(k_max=K_MAX, k=6, warmup_rounds=4), ngram_tokens=3)
    assert [c.k for c in controllers] == [6, 6, 3, 3, 6, 3, 3]       # clamped into the new n-gram range, no more


def test_plain_runs_grow_with_the_target_load_up_to_four_times_decode_steps():
    """Alone, a plain decode run plans again every decode_steps tokens; under load (rows per target forward) it
    runs load times longer, up to 4x: each run's end costs its request a step of the batch, and K = 0 is what the
    model favours there anyway."""
    from settings.schema import ControllerConfig
    selector = KSelector(ControllerConfig(decode_steps=32), Metrics(), random.Random(0))
    state = request_state(0, worker_pb2.DRAFT_MODE_GREEDY)
    selector.attach(state)
    assert selector.plain_run_steps(state) == 32
    for rows, steps in ((2, 64), (3, 96), (13, 128)):
        for _ in range(64):                       # the load estimate moves over load_window rounds
            selector.observe(state, Round([], 0, [1], RoundTimings(batch_size=rows)))
        assert selector.plain_run_steps(state) == steps, rows


def test_a_plain_run_is_as_long_as_the_sessions_open_on_its_target_ask_before_the_load_estimate_catches_up():
    """A burst of requests: the rows per forward the controller has seen are still 1, but the request's target
    already holds 3 sessions, so its run is planned for 3 rows (up to 4x decode_steps)."""
    from settings.schema import ControllerConfig
    selector = KSelector(ControllerConfig(decode_steps=32), Metrics(), random.Random(0))
    state = request_state(0, worker_pb2.DRAFT_MODE_GREEDY)
    selector.attach(state)
    for sessions, steps in ((1, 32), (3, 96), (9, 128)):
        state.target_sessions = sessions
        assert selector.plain_run_steps(state) == steps, sessions


def test_streamed_answers_wait_longer_under_load_up_to_answer_delay_max_ms():
    """Alone, a streamed run's answers wait at most answer_delay_ms; under load (rows per target forward) that
    many times longer, up to answer_delay_max_ms; 0 stays 0 (each answer at once), and a cap at or below
    answer_delay_ms turns the growth off. A request read whole keeps unstreamed_answer_delay_ms."""
    import dataclasses

    from settings.schema import ControllerConfig

    def delays(rows_seen: list[int], **config) -> list[float]:
        selector = KSelector(ControllerConfig(**config), Metrics(), random.Random(0))
        state = request_state(0, worker_pb2.DRAFT_MODE_GREEDY)
        selector.attach(state)
        out = [selector.answer_delay_s(state)]
        for rows in rows_seen:
            for _ in range(64):                   # the load estimate moves over load_window rounds
                selector.observe(state, Round([], 0, [1], RoundTimings(batch_size=rows)))
            out.append(selector.answer_delay_s(state))
        out.append(selector.answer_delay_s(dataclasses.replace(state, streamed=False)))
        return out

    assert delays([2, 3, 16], answer_delay_ms=10, answer_delay_max_ms=40, unstreamed_answer_delay_ms=200) == \
        pytest.approx([0.010, 0.020, 0.030, 0.040, 0.200], rel=0.02)
    assert delays([16], answer_delay_ms=0, answer_delay_max_ms=40) == pytest.approx([0.0, 0.0, 0.2])
    assert delays([16], answer_delay_ms=10, answer_delay_max_ms=0) == pytest.approx([0.010, 0.010, 0.2])


def test_answers_wait_longer_only_for_a_client_that_takes_its_output_whole_and_has_no_stop_strings():
    """A streamed request's run answers within answer_delay_ms; one read whole at the end (Generate, HTTP without
    stream) within unstreamed_answer_delay_ms, unless stop strings need its tokens as they come."""
    import dataclasses

    from settings.schema import ControllerConfig
    selector = KSelector(ControllerConfig(answer_delay_ms=10, unstreamed_answer_delay_ms=250), Metrics(),
                         random.Random(0))
    streamed = request_state(0, worker_pb2.DRAFT_MODE_GREEDY)
    whole = dataclasses.replace(streamed, streamed=False)
    assert selector.answer_delay_s(streamed) == pytest.approx(0.010)
    assert selector.answer_delay_s(whole) == pytest.approx(0.250)
    assert selector.answer_delay_s(dataclasses.replace(whole, stop_strings=("\n\n",))) == pytest.approx(0.010)
