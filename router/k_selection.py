"""Which proposal source and which K each round uses.

Statistics are kept per (proposal source, sampling regime): the draft model and prompt lookup accept at
different rates and cost different amounts, and so do greedy and sampled requests (a greedy draft's tokens
are often the target's argmax but rarely its sample at a high temperature). So the pool keeps one KController
per (source, regime), and a sampled request is never given a K learned from greedy traffic; nor is a request
with a prediction (its own regimes, "greedy predicted" and "sampled predicted") one learned from others. A
request also keeps its own controller per source, and uses it once it has drafted `warmup_rounds` of its own
rounds from that source (rounds at K = 0 teach no acceptance rate), its regime's pool controller before. Every round feeds both, and the
metrics. A request's controller learns its own acceptance, shrunk towards its pool controller's (not towards a
fixed prior: 16 rounds are too few to stand alone), and takes its costs (what a draft call, a verify, a round trip
cost) from the pool controller: they belong to the deployment, and a short request would see too few plain rounds
to measure T(0).

Source choice (draft.method model+ngram, a round whose context has an n-gram match): the source whose
controller models the higher goodput at its best K (drafting cost included: an n-gram proposal costs no call),
except that such a round tries the other one with chance `random_probe` (when probing is on), so neither's
statistics go stale.

Match length. How far n-gram drafts are accepted depends on how long a suffix of the context they were looked
up after (the demo pair, in a benchmark run: the first draft after a 2-, 3- and 4-or-more-token match accepted
66 %, 42 % and 89 % of the time). So beside each regime's n-gram controller the pool keeps one per match length,
which learns that length's acceptance (shrunk towards the n-gram controller's, whose costs it takes). The source
choice compares the draft model with the controller of the match at hand (drafting at its best K > 0), and a
decode run that looks its drafts up drafts only after matches at least as long as `lookup_limits` says: the shortest
length whose modeled goodput beats the alternative (the draft model, or plain decoding where there is none); with
chance random_probe every length counts, so a length left out is still measured. A length no round has drafted
after yet models as the n-gram controller does. After a match of each length a run drafts at most that length's
K of best goodput, and so does a round the router drafts itself with decode runs off (`match_k`). The lengths are the pool's: a request's own n-gram controller is not
split by length.

Lookup alone (model+ngram). Each source's rounds are modeled one by one, but mixing them costs more than any one
round shows: the draft catches up on the tokens lookup committed (calls the cost model leaves out as one-off), a
pre-draft goes unused when the next round looks up, an n-gram run ends at a miss to hand the next round to the
model, and a model round commits tokens that lookup would have drafted for less. So the selector also keeps what
whole requests have delivered, as the client sees it (committed tokens over the rounds' wall time), per sampling
regime, exponentially weighted over `cost_window` rounds: requests drafting from both sources (model+ngram), and
requests drafting by prompt lookup alone (draft.method ngram, or a model+ngram request run so). A model+ngram
request runs on lookup alone (RequestState.lookup_alone: its rounds never call the draft model) where lookup
alone has delivered more; with chance random_probe the other way round (when probing is on), and while either
has fewer than `warmup_rounds` behind it, the less measured one, so both stay measured. Requests that fell back to
lookup while the draft worker was unreachable count towards neither. A request with its own K is left out of
both and drafts from both sources by its rule of tokens alone. On the demo pair's input-grounded set, where the
draft model's controller settled on K = 2 (modeled at 153 tokens/s, plain decoding at 124), model+ngram delivered
0.71-0.88 of lookup alone, though its model rounds cost no more per token than plain decoding.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from router.controller import PLAN_LOAD_CAP, KController
from settings.schema import ControllerConfig
from router.metrics import Metrics
from router.request_state import MODEL, NGRAM, SOURCE_NAMES, RequestState, Round

REGIMES = ("greedy", "sampled", "greedy predicted", "sampled predicted")


def regime(state: RequestState) -> str:
    """The request's sampling regime: greedy (temperature 0) or sampled, and "predicted" for a request with a
    prediction (router/prediction.py), whose lookup drafts copy from it and are accepted far more often, until the
    request drops it (a useless prediction: PredictionTrial)."""
    name = "greedy" if state.sampling.temperature == 0 else "sampled"
    return f"{name} predicted" if state.predicting else name


@dataclass
class Delivered:
    """What the rounds of one kind of request have delivered: committed tokens and wall seconds, exponentially
    weighted over those rounds (`rounds`: their weight)."""
    tokens: float = 0.0
    seconds: float = 0.0
    rounds: float = 0.0

    def add(self, tokens: int, seconds: float, window: int) -> None:
        decay = 1.0 - 1.0 / window
        self.tokens, self.seconds = self.tokens * decay + tokens, self.seconds * decay + seconds
        self.rounds = self.rounds * decay + 1.0

    @property
    def rate(self) -> float:
        """Tokens per second (0 before any round)."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def delivery_kind(state: RequestState) -> str | None:
    """Which delivery a request's rounds count towards: "both" (model+ngram drafting from both sources), "lookup"
    (prompt lookup alone) or None (method model, a request with its own K, no n-gram index, or a model+ngram one
    that fell back to lookup alone while the draft worker was unreachable: RequestState.fell_back)."""
    if state.fixed_k is not None or state.ngram is None or state.method == "model" or state.fell_back:
        return None
    return "lookup" if state.method == "ngram" or state.lookup_alone else "both"


def _shown_source(method: str) -> int:
    """The source whose K the `k` gauge shows under draft.method `method`: prompt lookup where it is the only
    proposer (ngram), else the draft model (model+ngram: lookup drafts only where the context matches)."""
    return NGRAM if method == "ngram" else MODEL


def source_config(config: ControllerConfig, source: int, ngram_tokens: int) -> ControllerConfig:
    """The controller config of a source: n-gram rounds choose K up to draft.ngram_max_tokens and send no
    pre-draft (so their round time is modeled in turn)."""
    if source != NGRAM:
        return config
    k_max = max(ngram_tokens, config.k_min)
    return dataclasses.replace(config, k_max=k_max, k=min(config.k, k_max), overlap=False)


class Pools(dict):
    """(source, regime) -> the pool's KController of that source and regime, made on first use by `make`."""

    def __init__(self, make):
        super().__init__()
        self._make = make

    def __missing__(self, key: tuple) -> KController:
        self[key] = controller = self._make(key)
        return controller


class KSelector:
    """The pool's KControllers per (source, regime), per-request KControllers per source, and the metrics they
    feed."""

    def __init__(self, config: ControllerConfig, metrics: Metrics, rng: random.Random | None = None,
                 ngram_tokens: int = 8, method: str = "model", prediction_tokens: int = 32):
        """`method` (draft.method) says whose K the `k` gauge shows before a request has said (see show_k) and
        whether plain requests' deliveries are kept (_delivery); n-gram rounds draft up to `ngram_tokens`
        (draft.ngram_max_tokens), those of a request with a prediction up to `prediction_tokens`
        (draft.prediction_max_tokens)."""
        self._rng = rng or random.Random()
        self.config, self.ngram_tokens, self.prediction_tokens = config, ngram_tokens, prediction_tokens
        self.method, self._shown_source = method, _shown_source(method)
        self.pools = Pools(lambda key: KController(self._config(*key), random.Random(self._rng.getrandbits(64))))
        for source in SOURCE_NAMES:          # the predicted regimes' are made when a request with a prediction comes
            for name in REGIMES[:2]:
                self.pools[(source, name)]
        self.metrics = metrics
        self.by_match: dict[tuple, KController] = {}   # (regime, n-gram match length, the longest size?) -> its
                                                        # controller (a match of the longest size is "at least")
        self.active: dict[int, tuple[str, dict]] = {}     # session id -> (its regime, its controllers per source)
        self.delivered = {(kind, name): Delivered() for kind in ("both", "lookup") for name in REGIMES}
        self._show_pool_k()

    @property
    def pool(self) -> KController:
        """The draft model's controller for greedy requests (status's "pool"; the `k` gauge: see show_k)."""
        return self.pools[(MODEL, "greedy")]

    def _config(self, source: int, name: str = "greedy") -> ControllerConfig:
        """The controller config of a source in regime `name`: a predicted regime's n-gram controllers draft up to
        prediction_tokens and start there, since drafts copied from a prediction are mostly the output itself (the
        controller steps down where they are not)."""
        if not name.endswith("predicted"):
            return source_config(self.config, source, self.ngram_tokens)
        config = source_config(self.config, source, self.prediction_tokens)
        return dataclasses.replace(config, k=config.k_max) if source == NGRAM else config

    def attach(self, state: RequestState) -> None:
        """Give the request its own controllers, and say whether it runs on prompt lookup alone (for good: such a
        request takes no draft replica); a greedy one's method says which source the `k` gauge follows."""
        state.lookup_alone = self._lookup_alone(state)
        self._own_controllers(state)

    def _own_controllers(self, state: RequestState) -> None:
        """The request's own controllers, one per source, of its regime."""
        name = regime(state)
        if name == "greedy":
            self._shown_source = _shown_source(state.method)
        state.controller = {source: KController(self._config(source, name), random.Random(self._rng.getrandbits(64)),
                                                pool=self.pools[(source, name)])
                            for source in SOURCE_NAMES}
        self.active[state.session_id] = (name, state.controller)

    def detach(self, state: RequestState) -> None:
        self.active.pop(state.session_id, None)

    def controller(self, state: RequestState, source: int = MODEL) -> KController:
        """The request's own controller of `source` once it has drafted enough, else its regime's pool controller."""
        own = (state.controller or {}).get(source)
        if own is not None and own.drafting_rounds >= self.config.warmup_rounds:
            return own
        return self.pools[(source, regime(state))]

    def choose_k(self, state: RequestState, source: int = MODEL) -> int:
        """The next round's K from the request's controller of `source` (KSelector.controller). The `k` gauge
        follows what greedy rounds of the request's main source get (see show_k): the K that controller holds
        (its probes aside). A request's own controller, once it decides, may hold another K than the pool's,
        which nobody steps meanwhile."""
        controller = self.controller(state, source)
        k = controller.choose_k()
        if regime(state) == "greedy" and source == _shown_source(state.method):
            self.show_k(controller.k, self._origin(state, source, controller))
        return k

    def show_k(self, k: int, k_from: str = "pool model/greedy") -> None:
        """The K greedy rounds get now, from the draft model (draft.method model, model+ngram) or, where prompt
        lookup is the only proposer (ngram), from it: the `k` gauge, status's "k", and in `k_from` the controller
        that holds it ("pool model/greedy", "request ngram": a warmed-up request's own)."""
        self.k_now, self.k_from = k, k_from
        self.metrics.k.set(k)

    def _show_pool_k(self) -> None:
        """Show the K of the greedy pool controller of the source the gauge follows (at start, at a reload)."""
        name = SOURCE_NAMES[self._shown_source]
        self.show_k(self.pools[(self._shown_source, "greedy")].k, f"pool {name}/greedy")

    @staticmethod
    def _origin(state: RequestState, source: int, controller: KController) -> str:
        """Whose `controller` (KSelector.controller's for the request and `source`) is: its own, or its regime's
        pool's."""
        if controller is (state.controller or {}).get(source):
            return f"request {SOURCE_NAMES[source]}"
        return f"pool {SOURCE_NAMES[source]}/{regime(state)}"

    def held_k(self, state: RequestState, source: int) -> int:
        """The K the source's controller holds, with no probe drawn."""
        return self.controller(state, source).k

    def match_controller(self, state: RequestState, size: int) -> KController:
        """The pool's n-gram controller for drafts after a match of `size` tokens (made on first use). A match of
        the request's longest size means "at least that long", so it is kept apart from the same length matched
        when a reload has made the longest size larger."""
        key = (regime(state), size, size >= state.ngram.max_n)
        if key not in self.by_match:
            self.by_match[key] = KController(self._config(NGRAM, key[0]), random.Random(self._rng.getrandbits(64)),
                                             pool=self.pools[(NGRAM, key[0])])
        return self.by_match[key]

    def _best_goodput(self, state: RequestState, source: int, match_size: int = 0) -> float:
        """The source's best modeled goodput; n-gram drafts after a match of `match_size`: at its best K > 0."""
        if source == NGRAM and match_size:
            return self._drafting_goodput(state, match_size)
        return max(self.controller(state, source).goodput_curve().values())

    def choose_source(self, state: RequestState, candidates: list[int], match_size: int = 0) -> int:
        """The candidate with the highest modeled goodput (n-gram drafts: as drafts after a match of
        `match_size` tokens, when given; a tie goes to the first); with chance random_probe (a probe) another
        one, or a fifth of that if the other one holds K = 0 (a round it would run as plain decoding teaches it
        nothing, and that chance only keeps its own K probes going)."""
        best = max(candidates, key=lambda s: self._best_goodput(state, s, match_size))
        others = [s for s in candidates if s != best]
        if not self.config.probe_every or not others:
            return best
        other = self._rng.choice(others)
        chance = self.config.random_probe * (1.0 if self.controller(state, other).k > 0 else 0.2)
        return other if self._rng.random() < chance else best

    def lookup_limits(self, state: RequestState, k: int, with_model: bool) -> tuple[int, list[int]]:
        """For a run that looks its drafts up: (the shortest n-gram match, of the request's sizes, whose drafts
        model a higher goodput than the alternative, i.e. the draft model at its best K (`with_model`), else plain
        decoding, or past the longest size when none does; per size, shortest first, the most drafts worth
        proposing after a match of it, up to k: the K > 0 of best modeled goodput of its controller). Short
        matches' drafts are accepted less, and where a verify costs more per token they are worth fewer. Sizes no
        round has drafted after yet model as the n-gram controller does. With chance random_probe (when probing is
        on): (the shortest size, []), every size drafting up to k, so that a size left out, or K past a size's
        best, keeps being measured."""
        sizes = range(state.ngram.min_n, state.ngram.max_n + 1)
        if self._probe_drawn():
            return sizes[0], []
        if with_model:
            baseline = self._best_goodput(state, MODEL)
        else:
            baseline = self.controller(state, NGRAM).goodput_curve().get(0, 0.0)
        best = [self._best_drafting(state, n) for n in sizes]
        least = next((n for n, (_, goodput) in zip(sizes, best) if goodput > baseline), sizes[-1] + 1)
        return least, [min(k, size_k) for size_k, _ in best]

    def match_k(self, state: RequestState, size: int, k: int) -> int:
        """lookup_limits' K for one match length, for a round that drafts after a match of `size` tokens: the most
        drafts worth proposing after it, up to k; k on a probe (chance random_probe). Only that length's curve
        is computed: a round the router drafts itself asks this every round."""
        return k if self._probe_drawn() else min(k, self._best_drafting(state, size)[0])

    def _lookup_alone(self, state: RequestState) -> bool:
        """Whether a model+ngram request (not one with its own K) runs on prompt lookup alone: lookup_way, the
        other way round with chance random_probe once both are measured (when probing is on)."""
        if state.method != "model+ngram" or delivery_kind(state) is None:
            return False
        alone, measured = self.lookup_way(regime(state))
        return alone != (measured and self._probe_drawn())

    def lookup_way(self, name: str) -> tuple[bool, bool]:
        """(whether new model+ngram requests of regime `name` run on prompt lookup alone, whether both ways are
        measured): where lookup alone has delivered more tokens per second than both sources together; the less
        measured way while either has rounds of weight below warmup_rounds (at most half of cost_window, the most
        weight the decayed sums approach)."""
        both, alone = self.delivered[("both", name)], self.delivered[("lookup", name)]
        if min(both.rounds, alone.rounds) < min(max(self.config.warmup_rounds, 1), self.config.cost_window / 2):
            return alone.rounds < both.rounds, False
        return alone.rate > both.rate, True

    def delivery(self) -> dict:
        """Per regime, what requests drafting from both sources and those on prompt lookup alone have delivered
        (tokens per second to 1 decimal, null before any round), the weight of rounds behind each, and which way
        new model+ngram requests run (lookup_way; random_probe aside): status's "delivered"."""
        delivered = {}
        for name in REGIMES:
            both, alone = self.delivered[("both", name)], self.delivered[("lookup", name)]
            delivered[name] = {"both_tokens_per_s": round(both.rate, 1) or None,
                               "both_rounds": round(both.rounds, 1),
                               "lookup_alone_tokens_per_s": round(alone.rate, 1) or None,
                               "lookup_alone_rounds": round(alone.rounds, 1),
                               "new_requests": "lookup alone" if self.lookup_way(name)[0] else "both sources"}
        return delivered

    def _probe_drawn(self) -> bool:
        """Whether this plan is a random probe (chance random_probe, when probing is on)."""
        return bool(self.config.probe_every) and self._rng.random() < self.config.random_probe

    def _drafting_goodput(self, state: RequestState, size: int) -> float:
        """The best modeled goodput of drafts after a match of `size` tokens, over K > 0."""
        return self._best_drafting(state, size)[1]

    def _best_drafting(self, state: RequestState, size: int) -> tuple[int, float]:
        """(K, goodput) of the best modeled goodput of drafts after a match of `size` tokens, over K > 0."""
        curve = self.match_controller(state, size).goodput_curve()
        return max(((k, g) for k, g in curve.items() if k > 0), key=lambda kg: kg[1], default=(0, 0.0))

    @property
    def overlap(self) -> bool:
        """Whether rounds pre-draft the next one while the target verifies (speculation.overlap)."""
        return self.config.overlap

    @property
    def decode_steps(self) -> int:
        """The most tokens a round at K = 0 decodes in one target call (speculation.decode_steps)."""
        return self.config.decode_steps

    def plain_run_steps(self, state: RequestState) -> int:
        """The most tokens a plain decode run (K = 0, no lookup) commits before the policy plans again:
        decode_steps, times the target's load up to PLAN_LOAD_CAP. Under load a run's end costs its request a step
        of the batch and K = 0 is what the model favours anyway, so the policy plans (and probes) less often per
        token; alone, it plans as before. The load is the larger of the rows per forward the request's controller
        has seen and the sessions open on its target now: the former lags a burst of requests by its window, and
        a burst's first runs, cut short, each cost their row some 8 forwards of 8 demo-pair streams in leaving the
        batch and joining it again."""
        load = min(max(round(max(self.controller(state).load, state.target_sessions)), 1), PLAN_LOAD_CAP)
        return self.config.decode_steps * load

    def answer_delay_s(self, state: RequestState) -> float:
        """How long the target may hold a decode run's answer to send it with later ones: answer_delay_ms for a
        request streamed to its client, unstreamed_answer_delay_ms for one whose client takes the output whole.
        Nobody reads the latter's tokens before its end, and each message costs CPU in the target, the router
        and their cores' neighbours, so its answers travel several steps to a message even where a step is long;
        its stop strings, matched as tokens arrive, keep the streamed delay so that the run is withdrawn promptly.
        Under load the streamed delay grows with the target's rows per forward, up to answer_delay_max_ms: every
        row's answer is a message that the target's event loop sends while the batched forward waits for the
        interpreter (16 demo-pair streams at K = 0: 1.30x the tokens/s with 40 ms against 10)."""
        if not state.streamed and not state.stop_strings:
            return self.config.unstreamed_answer_delay_ms / 1000
        config, load = self.config, max(self.controller(state).load, 1.0)
        return min(config.answer_delay_ms * load, max(config.answer_delay_max_ms, config.answer_delay_ms)) / 1000

    @property
    def predraft_k(self) -> int:
        """The most drafts a pre-draft may carry after its guess (speculation.overlap_tokens - 1)."""
        return (self.config.overlap_tokens or self.config.k_max + 1) - 1

    @property
    def stage_predrafts(self) -> bool:
        """Whether a pre-draft back before its verdict is staged on the target (speculation.stage_predrafts)."""
        return self.config.stage_predrafts

    @property
    def hand_off(self) -> bool:
        """Whether model drafts go from the draft worker straight to the target (speculation.hand_off)."""
        return self.config.hand_off

    @property
    def chain_predrafts(self) -> bool:
        """Whether a pre-draft is chained to the draft call it follows (speculation.chain_predrafts)."""
        return self.config.chain_predrafts

    @property
    def prefill_first(self) -> bool:
        """Whether a request's first round is the target's prefill alone, the draft pre-drafting beside it
        (speculation.prefill_first)."""
        return self.config.prefill_first

    def predraft_branches(self, state: RequestState, k: int) -> list[tuple[int, int]]:
        """The rejection branches (j, rank) the request's next pre-draft, beside K drafts, carries besides its main
        guess (KController.branch_plan)."""
        return self.controller(state).branch_plan(k)

    def observe(self, state: RequestState, round_: Round) -> None:
        self.pools[(round_.source, regime(state))].observe(round_.k, round_.accepted, round_.timings)
        if round_.source == NGRAM and round_.match_size and state.ngram is not None:
            self.match_controller(state, round_.match_size).observe(round_.k, round_.accepted, round_.timings)
        own = (state.controller or {}).get(round_.source)
        if own is not None:
            own.observe(round_.k, round_.accepted, round_.timings)
        kind = self._delivery(state)
        if kind is not None and round_.parts:
            self.delivered[(kind, regime(state))].add(len(round_.committed), sum(round_.parts.values()),
                                                      self.config.cost_window)
        self.metrics.observe_round(round_)
        self.metrics.observe_source(SOURCE_NAMES[round_.source], round_.k, round_.accepted)
        if state.predicting and state.prediction_trial is not None and state.prediction_trial.useless(round_):
            self.drop_prediction(state)

    def _delivery(self, state: RequestState) -> str | None:
        """The delivery a request's rounds count towards (delivery_kind), where someone reads it: a plain regime's
        only on a model+ngram pool, the one whose new requests lookup_way sends one way or the other. (A request
        with a prediction drafts model+ngram on a model pool too, and keeps it once it drops the prediction.)"""
        return delivery_kind(state) if state.predicting or self.method == "model+ngram" else None

    def drop_prediction(self, state: RequestState) -> None:
        """A request's prediction proved useless (router.prediction.PredictionTrial): from its next round on its
        lookups copy from its own context alone (the target told so with its next lookup: a decode run under way
        ends, router.speculation.generate), and it learns with fresh controllers of its plain regime. It keeps
        model+ngram: where lookup in its context pays (the demo pair's repetitive output), the source choice finds
        it; where not, the draft model's rounds win. One that runs on lookup alone goes on so (it holds no draft
        replica)."""
        state.prediction_dropped = True
        state.stats.prediction_dropped_at = state.generated
        if state.ngram is not None:
            state.ngram.drop_prediction()
        self.metrics.predictions_dropped.inc()
        self._own_controllers(state)

    def update_config(self, config: ControllerConfig, ngram_tokens: int | None = None,
                      method: str | None = None, prediction_tokens: int | None = None) -> None:
        """Between rounds: new requests and the pool use it; statistics are kept. A reload that changes
        speculation.k (and only that: not a new ngram_max_tokens or prediction_max_tokens, which clamps the n-gram
        controllers' k) moves every controller, the pool's, the requests' and the match lengths', to it for a fresh
        warm-up (a predicted regime's n-gram controllers to its k_max, where they start)."""
        restart = config.k != self.config.k
        self.config = config
        if method is not None:
            self.method, self._shown_source = method, _shown_source(method)
        self.ngram_tokens = self.ngram_tokens if ngram_tokens is None else ngram_tokens
        self.prediction_tokens = self.prediction_tokens if prediction_tokens is None else prediction_tokens
        owned = [(source, name, c) for name, controllers in self.active.values() for source, c in controllers.items()]
        by_match = [(NGRAM, name, c) for (name, _, _), c in self.by_match.items()]
        for source, name, controller in [(source, name, c) for (source, name), c in self.pools.items()] + owned + by_match:
            controller.update_config(self._config(source, name), restart)
        self._show_pool_k()

    def snapshot(self) -> dict:
        """Every pool controller's snapshot, keyed "source/regime" (e.g. "ngram/sampled"), and those per n-gram
        match length, keyed "ngram/regime/match n" ("match n+" for the longest size: at least n)."""
        pools = {f"{SOURCE_NAMES[source]}/{name}": c.snapshot() for (source, name), c in self.pools.items()}
        return {**pools, **{f"ngram/{name}/match {n}{'+' if longest else ''}": c.snapshot()
                            for (name, n, longest), c in sorted(self.by_match.items())}}
