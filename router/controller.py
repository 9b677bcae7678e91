"""Adaptive K: how many draft tokens to propose per speculative round.

Model. Each round the draft proposes K tokens and the target verifies them in one pass. Draft position j
(0-based) is accepted with the conditional probability a_j = P(j accepted | 0..j-1 accepted); the round commits
the accepted prefix plus one target token, so

    E[K] = sum_{i=0..K} prod_{j<i} a_j                                (E[0] = 1: plain target decoding)
    T(K) = g + d0 + K * t_draft + rtt_draft + t_verify(K) + rtt_target,      t_verify(K) = a + b * load * (K + 1)
    T(0) = g + a0 + b * load + rtt0                                   (plain: no drafts, nothing beside the verify)
    goodput(K) = E[K] / T(K)                                          (tokens per second)

g is the router's own time between two rounds (commit, stream out, choose K). With overlap, see round_time().
Each term was checked against per-round traces of the running system (benchmarks/k_trace.py): a draft call has a
fixed part d0, a verify with drafts (or with a pre-draft beside it on shared cores) costs a - a0 more than one
without, and its round trip rtt_target differs from the plain rtt0.

Load. The target verifies the rounds of many requests in one batched forward, so its pass costs a + b * (tokens
in the batch): each row brings its K drafts plus one committed token. `load` is the rows per forward the target
reports (plus the verify calls it had waiting, which join the next forward), as if every row used the same K. At
load 1 this is the single-stream model; as the batch grows the b * load * (K + 1) term dominates, E[K] / (K + 1)
falls with K, and the argmax moves towards K = 0: when the target is compute-bound, speculation stops paying.

Acceptance statistics. The drafting rounds (K > 0) among the last `window` rounds are kept as (attempted,
accepted), with per-position counts over them: a round with K drafts and n accepted counts "accepted"
at positions 0..n-1, "rejected" at n (if n < K) and nothing beyond (never attempted). At least `min_samples` such
rounds are kept however old, so the sparse data of K = 0 (probes only) is not too noisy. a_j = accepted/attempted
at j, shrunk with `prior_weight` pseudo-outcomes towards the rate pooled over all positions (itself shrunk
towards `prior_acceptance`), or, for a controller given a `pool`, towards the pool's a_j. That pooled prior is how positions beyond the current K stay learnable: an unseen or
rarely seen position is assumed to accept like the positions seen, so the controller can jump to a large K as
soon as the shallow positions look good, and probes at K+1 (below) then measure the next position directly.
Phase changes: when a_0 over the last `change_recent` drafting rounds differs from the rest of the window by a
likelihood-ratio test at `change_z` (in standard-error units), the older rounds are forgotten at once.

Cost statistics (all timings are passed in; nothing here reads a clock), exponentially weighted with an effective
length of `cost_window` rounds: d0 and t_draft by ridge-regularised weighted least squares of draft seconds on
drafted tokens, the slope pulled towards seconds per token (d0 -> 0) while one size has been seen; a, a0 and b by
weighted least squares of verify seconds on the tokens of the target's forward (K + 1 when a request runs alone)
and a "busy" indicator (drafts in the forward or a pre-draft beside it), ridge-regularised so that b tends to 0
while one size has been seen and a - a0 to 0 while no plain round has; rtt_draft, rtt_target (busy rounds), rtt0
(plain rounds) and g are weighted means, and so is the load, over the shorter `load_window`. A call that first
absorbed a backlog of committed tokens (RoundTimings.*_catch_up: a prompt's prefill, the draft after rounds at
K = 0) is left out: it is paid once, not per round. A controller given a `pool` uses the pool's costs.

Policies. `fixed` always returns `k`. `threshold` moves K by one step every `adjust_every` rounds: up when the
acceptance rate since its last step is above `raise_above`, down when below `lower_below`. `goodput` starts at
`k` for `warmup_rounds` (and so does each policy again after a reload that changes `k`, its statistics kept),
then takes the argmax of goodput(K) over [k_min, k_max], switching only when the best
beats the current K by the `hysteresis` fraction. Both adaptive policies probe roughly every `probe_every`
rounds (jittered by the injected RNG; under load, times the load up to PLAN_LOAD_CAP): K+1 (K-1 at k_max), or with
chance `random_probe` a uniformly random other K, so stale statistics refresh and a phase change is noticed even
at K = 0. The goodput policy makes every
third probe from K > 0 a K = 0 probe while plain decoding is modeled within 60 % of K (so T(0) is measured, not
extrapolated); with overlap it lasts two rounds, since only the second runs with no pre-draft beside it.
"""
from __future__ import annotations

import itertools
import math
import random
from collections import deque
from dataclasses import dataclass

from settings.schema import ControllerConfig

_RIDGE = 0.01          # added to the variance of each regressor in the timing fits: its slope -> its prior (0 for
                       # t_verify and the busy term, the mean seconds per token for drafting) while one value was seen
_MIN_TIME = 1e-12      # floor of T(K), so a model with no timings yet never divides by zero
_MIN_SLOPE_SHARE = 0.25  # the drafting slope stays >= this share of seconds per token: a burst of load on a shared
                         # machine can flatten the fitted line, and a flat one would make every K cost the same
_CATCH_UP = {"draft": 2, "target": 1}   # more than this many tokens to absorb first (a prompt's prefill, a draft
                                        # back after rounds at K = 0): the call's time says nothing of a round's
_BUSY_RIDGE = 0.002    # ... for the busy term of t_verify (a share of plain rounds near 4 % is enough to see it)
PLAN_LOAD_CAP = 4        # under load the policy plans and probes less often, by the load up to this factor
_PLAIN_PROBE_EVERY = 3  # every 3rd probe (from K > 0) is a K = 0 probe, so T(0) is measured, not extrapolated,
_PLAIN_PROBE_WORTH = 0.6  # ... when plain decoding's modeled goodput is at least this share of K's (else a probe
                          # costs more than a doubt about T(0) could be worth)
_BRANCH_GROW_AFTER = 16  # pre-drafts done by their verdict, in a row, before one more branch is tried
_COST_KEYS = ("w", "x", "y", "xx", "xy", "z", "zz", "xz", "zy", "rtt_target", "busy_w", "rtt_plain", "plain_w",
              "between", "between_w",
              "load", "load_w", "dw", "draft_s", "draft_k", "draft_kk", "draft_ks", "rtt_draft",
              "guess_tries", "guess_hits", "branch_tries", "branch_hits", "third_tries", "third_hits")


@dataclass
class RoundTimings:
    """What one round cost (seconds) and the target's load, as the router measured them."""
    draft_seconds: float = 0.0               # the draft worker's compute for this round's drafts
    draft_tokens: int | None = None          # tokens that compute drafted (None: K; a pre-draft drafts K + 1)
    draft_rtt_seconds: float | None = None   # the rest of the draft call (None: same as rtt_seconds; negative for
                                             # drafts handed off, where drafting hid behind the verify's way)
    verify_seconds: float = 0.0              # the target's compute for the verify pass
    rtt_seconds: float = 0.0                 # the rest of the verify call (router <-> target round trip)
    batch_size: int = 1                      # rows of the target forward that verified this round
    batch_tokens: int = 0                    # tokens in that forward (0: this round alone, K + 1)
    queue_depth: int = 0                     # verify calls waiting at the target meanwhile
    guess_hit: bool | None = None            # overlap, all K accepted: was the pre-draft's guess of the
                                             # target's next token right (None: no pre-draft was out)
    branch_hit: bool | None = None           # a draft rejected: was the draft's runner-up there the target's
                                             # correction (None: no rejection, or no runner-up known)
    third_hit: bool | None = None            # a draft rejected, the runner-up there not the correction: was the
                                             # draft's third choice (None: no such rejection or no third known)
    predraft_beside: bool = False            # a pre-draft ran on the draft worker while the target verified
    predraft_done: bool | None = None        # ... and had finished when the verdict came back (None: none sent)
    branches: int = 0                        # ... with this many rejection branches
    between_seconds: float | None = None     # the router's time from the request's previous round to this one
                                             # (commit, stream the tokens out, choose K; None: first round)
    draft_catch_up: int = 0                  # committed tokens the draft absorbed before drafting (steady: <= 2)
    target_catch_up: int = 0                 # committed tokens the target absorbed besides the drafts (steady: 1)


def expected_tokens(rates: list[float], k: int) -> float:
    """E[K] = sum_{i=0..K} prod_{j<i} a_j; positions past the end of `rates` reuse its last rate."""
    return expected_curve(rates, k)[k]


def expected_curve(rates: list[float], k_max: int) -> list[float]:
    """E[K] for every K in 0..k_max, in one pass."""
    out, survive = [1.0], 1.0
    for j in range(k_max):
        survive *= _rate(rates, j)
        out.append(out[-1] + survive)
    return out


def all_accepted(rates: list[float], k: int) -> float:
    """P(all K drafts accepted) = prod_{j<K} a_j; positions past the end of `rates` reuse its last rate."""
    return math.prod(_rate(rates, j) for j in range(k))


def overlap_chances(rates: list[float], k_max: int, guess: float, rank_rates: list[float],
                    branches: int) -> list[tuple[float, float]]:
    """Per K in 0..k_max, with overlap: (h(K), the chance that a round waits for its own pre-draft). A round's
    drafts were pre-drafted if its predecessor accepted all K drafts and the guess of the next token was right
    (`guess`), or rejected draft j where branch_plan put a branch (j, rank) and that guess was the correction
    (`rank_rates[rank]`); the round waits for the pre-draft whenever its verdict is one of those."""
    out, survive, n = [], 1.0, len(rank_rates)     # survive: P(the first k drafts accepted)
    chances = [chance for chance, _, _ in branch_chances(rates, k_max, rank_rates)]
    for k in range(k_max + 1):
        branched = sum(sorted(chances[:k * n], reverse=True)[:branches])   # branch_plan's: the likeliest
        out.append((survive * guess + branched, survive + branched))
        survive *= _rate(rates, k)
    return out


def branch_chances(rates: list[float], k: int, rank_rates: list[float]) -> list[tuple[float, int, int]]:
    """(chance, j, rank) of each rejection branch of a pre-draft beside K drafts, by j then rank: the verdict "j
    drafts accepted, then the draft's runner-up (rank 0) or third choice (rank 1) at j", of chance P(exactly j
    accepted) * rank_rates[rank] (P(that guess is the correction | draft j rejected))."""
    out, survive = [], 1.0
    for j in range(k):
        accept = _rate(rates, j)
        out += [(survive * (1.0 - accept) * rate, j, rank) for rank, rate in enumerate(rank_rates)]
        survive *= accept
    return out


def branch_plan(rates: list[float], k: int, branches: int, rank_rates: list[float]) -> list[tuple[int, int]]:
    """The `branches` likeliest rejection branches (j, rank) of a pre-draft beside K drafts, likeliest first (see
    branch_chances). Ties (nothing learned yet) go to runner-ups, then to the earlier position."""
    ranked = sorted(branch_chances(rates, k, rank_rates), key=lambda c: (-c[0], c[2], c[1]))
    return [(j, rank) for _, j, rank in ranked[:branches]]


def _rate(rates: list[float], j: int) -> float:
    return rates[min(j, len(rates) - 1)] if rates else 0.0


def round_time(k: int, costs: dict, hit: float | None = None, settle: float = 1.0) -> float:
    """T(K) from a costs() dict. K = 0 is plain decoding: plain_a + b * load + rtt_plain (a verify with no drafts
    and nothing running beside it). K > 0, sequential (hit None): the draft path
    draft_fixed + K * t_draft + rtt_draft, then the verify path a + b * load * (K + 1) + rtt_target.
    Overlapped, with `hit` = h(K) the chance that a round's drafts were pre-drafted while the previous round
    verified, and `settle` the chance that the round waits for its own pre-draft (of K + 1 tokens, sent beside
    the verify): a verdict that rejects a draft cancels the pre-draft, one that accepts all K waits for it if it
    is still running; only a miss (1 - h) pays the draft path on the critical path. Every K also pays `between`:
    the router's time between two rounds of a request (more rounds per token at small K pay it more often)."""
    return max(costs.get("between", 0.0) + _round_path(k, costs, hit, settle), _MIN_TIME)


def _round_path(k: int, costs: dict, hit: float | None, settle: float) -> float:
    load = costs.get("load", 1.0)
    if k == 0:
        plain_a = costs.get("plain_a", costs["t_verify_a"])
        return max(plain_a + costs["t_verify_b"] * load, 0.0) + costs.get("rtt_plain", costs["rtt_target"])
    fixed = costs.get("draft_fixed", 0.0) + costs["rtt_draft"]      # rtt_draft < 0: drafting hidden (handed off)
    draft = max(fixed + k * costs["t_draft"], 0.0)
    verify = max(costs["t_verify_a"] + costs["t_verify_b"] * load * (k + 1), 0.0) + costs["rtt_target"]
    if hit is None:
        return draft + verify
    predraft = max(fixed + (k + 1) * costs["t_draft"], 0.0)
    return verify + settle * max(predraft - verify, 0.0) + (1.0 - hit) * draft


def readable_costs(costs: dict) -> dict:
    """costs() as status shows them: seconds as milliseconds to 3 decimals, each key saying so (t_draft_ms and
    t_verify_b_ms are per token), the load (rows per target forward) to 2 decimals. t_verify_a_ms and plain_a_ms
    are the verify line's intercepts, extrapolated to a forward of no tokens, and may be negative: only
    a + b * tokens at the sizes the target runs is a time (round_time floors it at 0). So may rtt_draft_ms, where
    handed-off drafting hid behind the verify call's way to the target (round_time floors the draft path at 0)."""
    return {key if key == "load" else f"{key}_ms": round(value, 2) + 0.0 if key == "load"
            else round(value * 1000, 3) + 0.0 for key, value in costs.items()}       # + 0.0: no -0.0


def _decay_add(sums: dict, decay: float, **values: float) -> None:
    for key, value in values.items():
        sums[key] = sums[key] * decay + value


def _log_likelihood(successes: int, n: int, p: float) -> float:
    """Bernoulli log likelihood of `successes` in n trials at rate p (0 log 0 = 0)."""
    failures = n - successes
    return (successes * math.log(p) if successes else 0.0) + (failures * math.log(1.0 - p) if failures else 0.0)


def _fit_line(w: float, sx: float, sy: float, sxx: float, sxy: float,
              prior_slope: float | None = None) -> tuple[float, float]:
    """Weighted ridge least squares of y on x from decayed sums: (intercept, slope >= 0). The ridge pulls the
    slope towards `prior_slope` (None: 0) while x has barely varied; with a prior slope of mean y / mean x (a line
    through the origin) the slope is kept in [_MIN_SLOPE_SHARE, 1] times it, so the intercept is >= 0."""
    if w <= 0:
        return 0.0, 0.0
    mean_x, mean_y = sx / w, sy / w
    var_x = max(sxx / w - mean_x * mean_x, 0.0)
    cov_xy = sxy / w - mean_x * mean_y
    prior = 0.0 if prior_slope is None else prior_slope
    slope = max((cov_xy + _RIDGE * prior) / (var_x + _RIDGE), 0.0)
    if prior_slope is not None and mean_x > 0:
        slope = min(max(slope, _MIN_SLOPE_SHARE * prior_slope), mean_y / mean_x)
    return mean_y - slope * mean_x, slope


def _fit_verify(c: dict) -> tuple[float, float, float]:
    """verify seconds = a + b * (forward tokens) + busy * [drafts in the forward or a pre-draft beside it], by
    weighted ridge least squares (b clamped >= 0): (a, b, busy). With drafts and verify sharing cores, a
    verify costs more than its extra tokens explain; this term keeps that out of T(0)."""
    w = c["w"]
    if w <= 0:
        return 0.0, 0.0, 0.0
    mx, mz, my = c["x"] / w, c["z"] / w, c["y"] / w
    vxx, vzz = c["xx"] / w - mx * mx + _RIDGE, c["zz"] / w - mz * mz + _BUSY_RIDGE
    vxz, vxy, vzy = c["xz"] / w - mx * mz, c["xy"] / w - mx * my, c["zy"] / w - mz * my
    det = vxx * vzz - vxz * vxz
    b = (vxy * vzz - vxz * vzy) / det
    if b < 0:
        b = 0.0
    busy = (vzy - vxz * b) / vzz
    return my - b * mx - busy * mz, b, busy


class KController:
    """Chooses K before each round (choose_k) and learns from each round's outcome and timings (observe)."""

    def __init__(self, config: ControllerConfig | None = None, rng: random.Random | None = None,
                 pool: "KController | None" = None):
        """`pool`: a controller over more traffic (a request's controller gets its pool's). Then costs() are the
        pool's (what a call costs is the deployment's, not the request's, and a short request would not see
        enough plain rounds to measure T(0)), and each a_j is shrunk towards the pool's a_j instead of
        towards prior_acceptance (a request that has drafted 16 rounds is not a blank slate)."""
        self.config = config if config is not None else ControllerConfig()
        self._pool = pool
        self.config.validate()
        self._rng = rng if rng is not None else random.Random()
        self._k = self.config.k
        self._probing = False
        self._probes = 0
        self._hold_plain = False
        self._calls = 0
        self._probed_at, self._probe_gap = 0, 0   # the last probe's call, and the calls to wait after it at load 1
        self._rounds = 0
        self._warm_from = 0                    # the round the last warm-up at `k` began (0, or a reload of k)
        self._drafting = 0                     # rounds observed with K > 0
        self._window: deque = deque()          # recent rounds with K > 0: (round, attempted, accepted)
        self._attempts: list[int] = []         # per position: rounds in the window that attempted it
        self._accepts: list[int] = []          # per position: ... and accepted it
        self._resize_positions()
        self._cost = dict.fromkeys(_COST_KEYS, 0.0)
        self._since = [0, 0, 0]                # threshold policy: rounds, attempted, accepted since its last step
        self._branches = self.config.overlap_branches   # see branches
        self._fits = 0                         # pre-drafts done by their verdict in a row, at that many branches

    @property
    def k(self) -> int:
        """The K the policy currently holds (a probe round returns another K without changing it)."""
        return self.config.k if self.config.policy == "fixed" else self._k

    @property
    def probing(self) -> bool:
        """Whether the last choose_k() returned a probe rather than the policy's K."""
        return self._probing

    @property
    def rounds(self) -> int:
        return self._rounds

    @property
    def _warm_rounds(self) -> int:
        """Rounds since the warm-up at `k` began: at start, or at the reload that last changed k."""
        return self._rounds - self._warm_from

    @property
    def drafting_rounds(self) -> int:
        """Rounds observed with K > 0: the ones that taught it an acceptance rate."""
        return self._drafting

    def choose_k(self) -> int:
        """The K for the next round."""
        self._calls += 1
        self._probing = False
        if self.config.policy == "fixed":
            return self.config.k
        if self.config.policy == "threshold":
            self._threshold_step()
        elif self._warm_rounds >= max(self.config.warmup_rounds, 1):
            self._goodput_step()
        if self._hold_plain:                  # the second round of a K = 0 probe with overlap on (see _probe_k)
            self._hold_plain, self._probing = False, self._k != 0
            return 0
        if self._probe_due():
            probe = self._probe_k()
            self._probing = probe != self._k
            return probe
        return self._k

    def observe(self, k: int, num_accepted: int, timings: RoundTimings | None = None) -> None:
        """Record one round: K drafted, how many were accepted, and what it cost (RoundTimings).
        Positions >= k_max are not tracked."""
        if k < 0 or not 0 <= num_accepted <= k:
            raise ValueError(f"observe: need 0 <= num_accepted <= k (got k={k}, num_accepted={num_accepted})")
        self._rounds += 1
        self._drafting += k > 0
        self._record_acceptance(k, num_accepted)
        if self._pool is None:
            self._record_costs(k, timings if timings is not None else RoundTimings())
        elif timings is not None:             # the guess rates are the request's own
            self._record_guesses(timings, 1.0 - 1.0 / self.config.cost_window)

    def acceptance(self) -> list[float]:
        """Estimated a_j for j in 0..k_max-1, each shrunk towards the rate pooled over all positions (with a
        pool: towards the pool's a_j)."""
        weight, prior = self.config.prior_weight, self.config.prior_acceptance
        if self._pool is not None:
            priors = self._pool.acceptance()
            return [(s + weight * _rate(priors, j)) / (n + weight) if n + weight > 0 else _rate(priors, j)
                    for j, (n, s) in enumerate(zip(self._attempts, self._accepts))]
        attempts, accepts = sum(self._attempts), sum(self._accepts)
        pooled = (accepts + weight * prior) / (attempts + weight) if attempts + weight > 0 else prior
        return [(s + weight * pooled) / (n + weight) if n + weight > 0 else pooled
                for n, s in zip(self._attempts, self._accepts)]

    def costs(self) -> dict:
        """Current cost estimates in seconds: drafting draft_fixed + t_draft per token, t_verify = a + b * (forward
        tokens) with drafts, plain_a + b with none (K = 0, nothing beside it), both round trips (rtt_plain: the
        target's at K = 0), and the load (rows per target forward)."""
        if self._pool is not None:
            return self._pool.costs()
        c = self._cost
        a, b, busy = _fit_verify(c)
        ratio = c["draft_s"] / c["draft_k"] if c["draft_k"] > 0 else 0.0
        fixed, t_draft = _fit_line(c["dw"], c["draft_k"], c["draft_s"], c["draft_kk"], c["draft_ks"], ratio)
        rtt_target = c["rtt_target"] / c["busy_w"] if c["busy_w"] > 0 else 0.0
        return {"t_draft": t_draft, "draft_fixed": fixed,
                "t_verify_a": a + busy, "t_verify_b": b, "plain_a": a,
                "rtt_draft": c["rtt_draft"] / c["dw"] if c["dw"] > 0 else 0.0,
                "rtt_target": rtt_target if c["busy_w"] > 0 or c["plain_w"] <= 0 else c["rtt_plain"] / c["plain_w"],
                "rtt_plain": c["rtt_plain"] / c["plain_w"] if c["plain_w"] > 0 else rtt_target,
                "between": c["between"] / c["between_w"] if c["between_w"] > 0 else 0.0,
                "load": self.load}

    def guess_rate(self) -> float:
        """P(the pre-draft's guess of the target's next token is right | all K drafts accepted): learned from
        the overlapped rounds, shrunk with `prior_weight` towards the pooled acceptance (the guess is one more
        draft position), or for a controller given a `pool`, towards the pool's guess rate."""
        weight, c = self.config.prior_weight, self._cost
        if self._pool is not None:
            prior = self._pool.guess_rate()
        else:
            attempts, accepts = sum(self._attempts), sum(self._accepts)
            prior = (accepts + weight * self.config.prior_acceptance) / (attempts + weight) if attempts + weight \
                else 0.5
        tries = c["guess_tries"] + weight
        return (c["guess_hits"] + weight * prior) / tries if tries > 0 else prior

    def branch_rate(self) -> float:
        """P(the draft's runner-up is the target's correction | a draft rejected): learned from every such round,
        shrunk with `prior_weight` towards 0 (nothing is assumed before it is seen), or for a controller given a
        `pool`, towards the pool's rate."""
        weight, c = self.config.prior_weight, self._cost
        prior = self._pool.branch_rate() if self._pool is not None else 0.0
        tries = c["branch_tries"] + weight
        return (c["branch_hits"] + weight * prior) / tries if tries > 0 else prior

    def third_rate(self) -> float:
        """P(the draft's third choice is the target's correction | a draft rejected and the runner-up there was
        not it): learned from every such round, shrunk with `prior_weight` towards 0, or for a controller given a
        `pool`, towards the pool's rate."""
        weight, c = self.config.prior_weight, self._cost
        prior = self._pool.third_rate() if self._pool is not None else 0.0
        tries = c["third_tries"] + weight
        return (c["third_hits"] + weight * prior) / tries if tries > 0 else prior

    def rank_rates(self) -> list[float]:
        """P(a guess of rank r is the correction | a draft rejected), for the ranks guessed
        (speculation.overlap_branch_guesses): the runner-up, then the third choice."""
        branch = self.branch_rate()
        return [branch, (1.0 - branch) * self.third_rate()][:self.config.overlap_branch_guesses]

    def branch_plan(self, k: int) -> list[tuple[int, int]]:
        """The rejection branches (j, rank) the next pre-draft beside K drafts carries (see branch_plan)."""
        return branch_plan(self.acceptance(), k, self.branches, self.rank_rates())

    def hit_rate(self, k: int, rates: list[float] | None = None) -> float:
        """h(K): the chance that the next round's drafts are already pre-drafted when this round's verdict
        comes back (see overlap_chances)."""
        return self._overlap_chances(self.acceptance() if rates is None else rates)[k][0]

    def _overlap_chances(self, rates: list[float]) -> list[tuple[float, float]]:
        return overlap_chances(rates, self.config.k_max, self.guess_rate(), self.rank_rates(), self.branches)

    def goodput_curve(self) -> dict[int, float]:
        """Modeled goodput E[K] / T(K) (tokens per second) for each K in [k_min, k_max]; with overlap on,
        T(K) counts the draft path only on a miss (1 - h(K))."""
        rates, costs = self.acceptance(), self.costs()
        expected = expected_curve(rates, self.config.k_max)
        if not self.config.overlap:
            return {k: expected[k] / round_time(k, costs) for k in range(self.config.k_min, self.config.k_max + 1)}
        chances = self._overlap_chances(rates)
        return {k: expected[k] / round_time(k, costs, *chances[k])
                for k in range(self.config.k_min, self.config.k_max + 1)}

    @property
    def timed(self) -> bool:
        """Whether a verify has been timed (a request's controller: by its pool). Before that every cost is 0 and
        the goodput curve is E[K] / _MIN_TIME, a number that means nothing."""
        if self._pool is not None:
            return self._pool.timed
        return self._cost["w"] > 0 and self._cost["y"] > 0

    def snapshot(self) -> dict:
        """A JSON-ready view for the admin API, for a person tuning K: rates to 4 decimals, costs in milliseconds
        (3 decimals, keys ending in _ms), goodput in tokens per second; costs and goodput null until timed."""
        timed = self.timed
        return {"policy": self.config.policy, "k": self.k, "probing": self._probing, "rounds": self._rounds,
                "acceptance": [round(a, 4) for a in self.acceptance()],
                "samples": list(self._attempts),
                "costs": readable_costs(self.costs()) if timed else None,
                "overlap": {"guess_rate": round(self.guess_rate(), 4), "branch_rate": round(self.branch_rate(), 4),
                            "third_rate": round(self.third_rate(), 4),
                            "branches": self.branches, "hit_rate": round(self.hit_rate(self.k), 4)},
                "goodput_tokens_per_s": {str(k): round(g, 1) for k, g in self.goodput_curve().items()}
                if timed else None}

    def update_config(self, config: ControllerConfig, restart: bool | None = None) -> None:
        """Apply a new config between rounds: statistics (acceptance, costs) are kept. If `restart` (None: if the
        config's `k` changed), the policy moves to the new `k` and warms up again there, as at start: an operator
        who reloads k expects rounds at it (`warmup_rounds` are rounds at k before the model decides), not a K
        the old statistics chose. Otherwise the current K is only clamped into [k_min, k_max]."""
        config.validate()
        restart = config.k != self.config.k if restart is None else restart
        self.config = config
        while len(self._window) > config.min_samples and self._window[0][0] <= self._rounds - config.window:
            self._window.popleft()
        self._resize_positions()
        self._k = min(max(self._k, config.k_min), config.k_max)
        if restart:
            self._restart_at_k()

    def _restart_at_k(self) -> None:
        """Hold `k` from the next round on, for a fresh warm-up: no goodput step or probe before warmup_rounds
        more rounds, no threshold step before adjust_every, no K = 0 probe left half-way."""
        self._k, self._warm_from = self.config.k, self._rounds
        self._since, self._hold_plain, self._probing = [0, 0, 0], False, False

    # -- policies ----------------------------------------------------------------------------------------------

    def _threshold_step(self) -> None:
        rounds, attempted, accepted = self._since
        if rounds < self.config.adjust_every or attempted == 0:
            return
        rate = accepted / attempted
        if rate > self.config.raise_above:
            self._k = min(self._k + 1, self.config.k_max)
        elif rate < self.config.lower_below:
            self._k = max(self._k - 1, self.config.k_min)
        self._since = [0, 0, 0]

    def _goodput_step(self) -> None:
        curve = self.goodput_curve()
        best = max(curve, key=curve.get)
        if self._k not in curve or curve[best] > curve[self._k] * (1.0 + self.config.hysteresis):
            self._k = best

    def _probe_due(self) -> bool:
        """Whether this call probes: about every probe_every calls (jittered), times the target's load now (rows per
        forward, up to PLAN_LOAD_CAP), as plain decode runs grow with it. Under load a probe costs more (its request
        leaves the batch for a draft call and its own verify, and the streams it delays finish in smaller batches:
        8 demo-pair streams made 12-20 % more target forwards with probes than without) while the pool plans for
        load times as many requests, so it learns as much from fewer probes each; once the load falls, the gap
        already waited is measured against the lower load, and probing resumes at once."""
        every = self.config.probe_every
        if every == 0 or self._warm_rounds < self.config.warmup_rounds:
            return False
        if self._calls - self._probed_at < self._probe_gap * min(max(round(self.load), 1), PLAN_LOAD_CAP):
            return False
        self._probed_at, self._probe_gap = self._calls, self._rng.randint(max(1, every // 2), every + every // 2)
        return True

    def _probe_k(self) -> int:
        """K+1 (K-1 at k_max); of the goodput policy, every _PLAIN_PROBE_EVERY-th probe from K > 0 is K = 0 (k_min 0): with overlap on
        for two rounds, since the first one's verify runs beside the pre-draft its predecessor sent, and only
        the second is plain decoding as K = 0 would run it (what T(0) must be measured on)."""
        low, high = self.config.k_min, self.config.k_max
        if low == high:
            return self._k
        self._probes += 1
        if self._probes % _PLAIN_PROBE_EVERY == 0 and self._plain_in_doubt():
            self._hold_plain = self.config.overlap
            return 0
        if self._rng.random() < self.config.random_probe:
            return self._rng.choice([k for k in range(low, high + 1) if k != self._k])
        return self._k + 1 if self._k < high else self._k - 1

    def _plain_in_doubt(self) -> bool:
        """Whether K = 0 is worth a probe: goodput policy, k_min 0, K > 0, and plain decoding modeled close."""
        if self.config.policy != "goodput" or not self.config.k_min == 0 < self._k:
            return False
        curve = self.goodput_curve()
        return curve[0] >= _PLAIN_PROBE_WORTH * curve[self._k]

    # -- statistics --------------------------------------------------------------------------------------------

    def _record_acceptance(self, k: int, accepted: int) -> None:
        attempted = min(k, accepted + 1)
        if attempted:
            self._window.append((self._rounds, attempted, accepted))
            self._count(attempted, accepted, +1)
        oldest = self._rounds - self.config.window
        while len(self._window) > self.config.min_samples and self._window[0][0] <= oldest:
            _, old_attempted, old_accepted = self._window.popleft()
            self._count(old_attempted, old_accepted, -1)
        if attempted and self._changed():
            recent = list(self._window)[-self.config.change_recent:]
            self._window = deque(recent)
            self._resize_positions()
        since = self._since
        since[0], since[1], since[2] = since[0] + 1, since[1] + attempted, since[2] + accepted

    def _changed(self) -> bool:
        """Likelihood-ratio test of a_0: the last change_recent rounds of the window against the older ones."""
        recent_n, old_n = self.config.change_recent, len(self._window) - self.config.change_recent
        if self.config.change_z <= 0 or old_n < recent_n or not self._accepts or \
                self._window[-recent_n][0] <= self._rounds - 2 * recent_n:   # sparse (e.g. K = 0 probes): skip
            return False
        recent_s = sum(accepted > 0 for _, _, accepted in itertools.islice(reversed(self._window), recent_n))
        old_s = self._accepts[0] - recent_s
        pooled = (recent_s + old_s) / (recent_n + old_n)
        statistic = 2.0 * (_log_likelihood(recent_s, recent_n, recent_s / recent_n)
                           + _log_likelihood(old_s, old_n, old_s / old_n)
                           - _log_likelihood(recent_s + old_s, recent_n + old_n, pooled))
        return statistic > self.config.change_z ** 2

    def _count(self, attempted: int, accepted: int, sign: int) -> None:
        """Add (sign=+1) or remove (-1) one round's outcomes: 0..accepted-1 accepted, `accepted` rejected."""
        for j in range(min(attempted, len(self._attempts))):
            self._attempts[j] += sign
            self._accepts[j] += sign * (j < accepted)

    def _record_costs(self, k: int, t: RoundTimings) -> None:
        """Learn from the round's timings; a call that first absorbed a backlog of committed tokens (a prompt's
        prefill, the draft after rounds at K = 0) is left out of its cost estimates: it is paid once, not per
        round, and counting it would make K = 0 look cheaper the longer the controller stays there."""
        decay = 1.0 - 1.0 / self.config.cost_window
        if t.target_catch_up <= _CATCH_UP["target"]:
            self._record_verify(k, t, decay)
        if t.between_seconds is not None:
            _decay_add(self._cost, decay, between=t.between_seconds, between_w=1.0)
        load_decay = 1.0 - 1.0 / self.config.load_window
        _decay_add(self._cost, load_decay, load=max(t.batch_size, 1) + t.queue_depth, load_w=1.0)
        drafted = k if t.draft_tokens is None else t.draft_tokens
        if drafted > 0 and t.draft_catch_up <= _CATCH_UP["draft"]:
            rtt_draft = t.rtt_seconds if t.draft_rtt_seconds is None else t.draft_rtt_seconds
            _decay_add(self._cost, decay, dw=1.0, draft_s=t.draft_seconds, draft_k=drafted, rtt_draft=rtt_draft,
                       draft_kk=drafted * drafted, draft_ks=drafted * t.draft_seconds)
        self._record_guesses(t, decay)
        self._record_predraft(t)

    def _record_predraft(self, t: RoundTimings) -> None:
        """Size the next pre-drafts' branches: one fewer than a pre-draft that was still running when its verdict
        came back (it would have delayed a hit), one more after _BRANCH_GROW_AFTER in a row that were done, up to
        overlap_branches. A late pre-draft without branches says nothing of what branches cost, and while the
        operator has branches off or lowered, the budget waits as it was for when they are turned back up."""
        if t.predraft_done is None or not self.config.overlap_branches:
            return
        if not t.predraft_done:
            if t.branches:
                self._branches, self._fits = min(self._branches, t.branches - 1), 0
        elif t.branches >= self.branches:
            self._fits += 1
            if self._fits >= _BRANCH_GROW_AFTER:
                self._fits = 0
                if self._branches < self.config.overlap_branches:
                    self._branches += 1

    @property
    def load(self) -> float:
        """The target's load the costs see: rows per forward plus waiting calls (a request's own controller: its
        pool's)."""
        if self._pool is not None:
            return self._pool.load
        c = self._cost
        return c["load"] / c["load_w"] if c["load_w"] > 0 else 1.0

    @property
    def branches(self) -> int:
        """Rejection branches the next pre-draft carries (at most speculation.overlap_branches): as many as keep
        pre-drafts done by the time their verdict comes back, so that a branch never delays a round (a request's
        own controller: its pool's)."""
        if self._pool is not None:
            return self._pool.branches
        return min(self._branches, self.config.overlap_branches)

    def _record_guesses(self, t: RoundTimings, decay: float) -> None:
        if t.guess_hit is not None:
            _decay_add(self._cost, decay, guess_tries=1.0, guess_hits=float(t.guess_hit))
        if t.branch_hit is not None:
            _decay_add(self._cost, decay, branch_tries=1.0, branch_hits=float(t.branch_hit))
        if t.third_hit is not None:
            _decay_add(self._cost, decay, third_tries=1.0, third_hits=float(t.third_hit))

    def _record_verify(self, k: int, t: RoundTimings, decay: float) -> None:
        tokens, verify_s, busy = t.batch_tokens or k + 1, t.verify_seconds, float(k > 0 or t.predraft_beside)
        _decay_add(self._cost, decay, w=1.0, x=tokens, y=verify_s, xx=tokens * tokens, xy=tokens * verify_s,
                   z=busy, zz=busy, xz=tokens * busy, zy=busy * verify_s)
        if busy:
            _decay_add(self._cost, decay, busy_w=1.0, rtt_target=t.rtt_seconds)
        else:
            _decay_add(self._cost, decay, plain_w=1.0, rtt_plain=t.rtt_seconds)

    def _resize_positions(self) -> None:
        """Size the per-position counts for k_max and recount them from the window of rounds."""
        self._attempts = [0] * self.config.k_max
        self._accepts = [0] * self.config.k_max
        for _, attempted, accepted in self._window:
            self._count(attempted, accepted, +1)
