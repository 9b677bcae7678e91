"""Trace-driven tests of the adaptive-K controller (router/controller.py): no models, no Ray, no wall clock.

A synthetic environment accepts draft position j with probability alpha (i.i.d. per position) and charges each
round by a cost model in arbitrary time units. Every policy is run on the same trace (common random numbers: the
same uniforms decide acceptance and the same jitter scales the timings), so their throughputs
(tokens / total time) compare like for like. Run with -s to see the measured numbers.
"""
from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass, replace

import pytest

from router.controller import (PLAN_LOAD_CAP, KController, RoundTimings, branch_plan, expected_curve,
                               expected_tokens, overlap_chances, round_time)
from settings.schema import ControllerConfig


def sequential(**changes) -> ControllerConfig:
    """The controller of a router that drafts and verifies strictly in turn (the traces below are timed so)."""
    return ControllerConfig(overlap=False, **changes)


def overlapped(**changes) -> ControllerConfig:
    """The controller of a router that pre-drafts the next round while the target verifies."""
    return ControllerConfig(overlap=True, **changes)

K_MAX = 8
ROUNDS = 3000                  # rounds of a stationary trace
PHASE_ROUNDS = 1500            # rounds of each phase of the phase-change trace
PHASES = (0.9, 0.3, 0.7)       # acceptance per phase
SETTLE_ROUNDS = 200            # the goodput policy settles within this many rounds of each phase start
STATIONARY_TOLERANCE = 0.05    # goodput policy vs the best fixed K on a stationary trace
PHASE_GAIN = 0.10              # goodput policy vs every fixed K on the phase-change trace


@dataclass(frozen=True)
class CostModel:
    """Time per round: [K>0] * (K * t_draft + rtt) + verify_base + verify_per_k * K + rtt, each term jittered."""
    t_draft: float = 0.1
    verify_base: float = 1.0
    verify_per_k: float = 0.05
    rtt: float = 0.2
    jitter: float = 0.1        # each timing is scaled by a factor in [1 - jitter, 1 + jitter]

    def goodput(self, alpha, k: int) -> float:
        """Analytic tokens per time unit: mean tokens per round over the mean round time."""
        tokens = mean_tokens(alpha, k)
        time = (k * self.t_draft + self.rtt if k else 0.0) + self.verify_base + self.verify_per_k * k + self.rtt
        return tokens / time

    def best_k(self, alpha: float) -> int:
        return max(range(K_MAX + 1), key=lambda k: self.goodput(alpha, k))


def rate(alpha, j: int) -> float:
    """Acceptance of draft position j: alpha is one rate for every position or a tuple of per-position rates."""
    return alpha[j] if isinstance(alpha, tuple) else alpha


def mean_tokens(alpha, k: int) -> float:
    """Closed form for one rate, (1 - alpha^(K+1)) / (1 - alpha); the product sum for per-position rates."""
    if not isinstance(alpha, tuple):
        return (1 - alpha ** (k + 1)) / (1 - alpha)
    total, survive = 1.0, 1.0
    for j in range(k):
        survive *= alpha[j]
        total += survive
    return total


@dataclass
class Run:
    throughput: float
    ks: list[int]
    probes: list[bool]


@functools.lru_cache(maxsize=None)
def make_trace(alphas: tuple[float, ...], seed: int, jitter: float) -> tuple:
    """Per round: (alpha, K_MAX uniforms deciding acceptance, 4 timing jitter factors)."""
    rng = random.Random(seed)
    return tuple((alpha, tuple(rng.random() for _ in range(K_MAX)),
                  tuple(rng.uniform(1 - jitter, 1 + jitter) for _ in range(4))) for alpha in alphas)


def simulate(controller: KController, trace: tuple, cost: CostModel) -> Run:
    tokens = elapsed = 0.0
    ks, probes = [], []
    for alpha, uniforms, jit in trace:
        k = controller.choose_k()
        ks.append(k)
        probes.append(controller.probing)
        accepted = 0
        while accepted < k and uniforms[accepted] < rate(alpha, accepted):
            accepted += 1
        draft = k * cost.t_draft * jit[0]
        verify = (cost.verify_base + cost.verify_per_k * k) * jit[1]
        rtt, draft_rtt = cost.rtt * jit[2], (cost.rtt * jit[3] if k else 0.0)
        elapsed += draft + verify + rtt + draft_rtt
        tokens += accepted + 1
        controller.observe(k, accepted, RoundTimings(draft, None, draft_rtt, verify, rtt))
    return Run(tokens / elapsed, ks, probes)


@functools.lru_cache(maxsize=None)
def run_policy(alphas: tuple[float, ...], cost: CostModel, policy: str = "goodput", k: int = 4,
               seed: int = 0) -> Run:
    trace = make_trace(alphas, seed, cost.jitter)
    config = sequential(policy=policy, k=k, k_max=K_MAX)
    return simulate(KController(config, random.Random(seed)), trace, cost)


def fixed_throughputs(alphas: tuple[float, ...], cost: CostModel) -> dict[int, float]:
    return {k: run_policy(alphas, cost, "fixed", k).throughput for k in range(K_MAX + 1)}


def settle_round(ks: list[int], probes: list[bool], optimal: int) -> int:
    """First round after which every non-probe K stays within +-1 of `optimal` (len(ks): never)."""
    last_bad = -1
    for i, (k, probe) in enumerate(zip(ks, probes)):
        if not probe and abs(k - optimal) > 1:
            last_bad = i
    return last_bad + 1


def phase_trace() -> tuple[float, ...]:
    return tuple(alpha for alpha in PHASES for _ in range(PHASE_ROUNDS))


# -- 1-3: throughput and settling against the cost model ----------------------------------------------------------

@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.9])
def test_stationary_goodput_within_5pct_of_best_fixed_k(alpha):
    """Cost model: t_draft 0.1/token, t_verify(K) = 1.0 + 0.05*K, rtt 0.2 per call, 10% jitter."""
    cost, alphas = CostModel(), (alpha,) * ROUNDS
    fixed = fixed_throughputs(alphas, cost)
    best = max(fixed, key=fixed.get)
    adaptive = run_policy(alphas, cost)
    ratio = adaptive.throughput / fixed[best]
    print(f"\nalpha={alpha}: goodput {adaptive.throughput:.4f}, best fixed K={best} {fixed[best]:.4f}, "
          f"ratio {ratio:.3f}, last K {adaptive.ks[-1]}")
    assert ratio >= 1 - STATIONARY_TOLERANCE


def test_phase_change_goodput_beats_every_fixed_k_by_10pct():
    """Acceptance 0.9 -> 0.3 -> 0.7, 1500 rounds each. Cost model as above: t_draft 0.1/token, t_verify(K) =
    1.0 + 0.05*K, rtt 0.2 per call. Then the best K is 8 at 0.9, 1 (0 within 1%) at 0.3 and 4 at 0.7, so no
    single K fits all phases: the analytic per-phase optimum beats the best fixed K by ~18%."""
    cost, alphas = CostModel(), phase_trace()
    assert [cost.best_k(a) for a in PHASES] == [8, 1, 4]          # the premise: the phases want different K
    fixed = fixed_throughputs(alphas, cost)
    best = max(fixed, key=fixed.get)
    adaptive = run_policy(alphas, cost)
    gain = adaptive.throughput / fixed[best] - 1
    print(f"\ngoodput {adaptive.throughput:.4f}; fixed: " + ", ".join(f"K={k} {t:.4f}" for k, t in fixed.items())
          + f"; gain over best fixed (K={best}) {gain:.1%}")
    assert gain >= PHASE_GAIN


def test_settles_after_each_phase_change():
    """Settled: every non-probe K stays within +-1 of the phase's analytic optimum for the rest of the phase."""
    cost = CostModel()
    run = run_policy(phase_trace(), cost)
    settles = []
    for i, alpha in enumerate(PHASES):
        part = slice(i * PHASE_ROUNDS, (i + 1) * PHASE_ROUNDS)
        settles.append(settle_round(run.ks[part], run.probes[part], cost.best_k(alpha)))
    print(f"\nsettle rounds per phase {dict(zip(PHASES, settles))} (bound {SETTLE_ROUNDS})")
    assert max(settles) <= SETTLE_ROUNDS


def modeled_efficiency(ks: list[int], alpha: float, cost: CostModel) -> float:
    """Analytic throughput of the chosen Ks (sum of E[K] over sum of T(K)) relative to the best K's."""
    tokens = [mean_tokens(alpha, k) for k in ks]
    time = sum(e / cost.goodput(alpha, k) for e, k in zip(tokens, ks))
    return sum(tokens) / time / cost.goodput(alpha, cost.best_k(alpha))


def test_recovers_from_k0_when_acceptance_rises():
    """alpha 0.05 -> 0.9 (1000 rounds each), expensive draft (t_draft 0.3): best K is 0, then 6. At K=0 only the
    probes carry acceptance data, so they must notice the change. Near alpha 0.9 goodput is flat (K=5..8 within
    1.5%), so the bar here is: K >= 4 within SETTLE_ROUNDS, then >= 98% of the best K's modeled goodput."""
    cost = CostModel(t_draft=0.3)
    assert (cost.best_k(0.05), cost.best_k(0.9)) == (0, 6)
    run = run_policy((0.05,) * 1000 + (0.9,) * 1000, cost)
    assert settle_round(run.ks[:1000], run.probes[:1000], 0) <= SETTLE_ROUNDS
    ks, probes = run.ks[1000:], run.probes[1000:]
    recovered = next((i for i, (k, probe) in enumerate(zip(ks, probes)) if k >= 4 and not probe), len(ks))
    efficiency = modeled_efficiency(ks[SETTLE_ROUNDS:], 0.9, cost)
    print(f"\nleft K=0 for K>=4 after {recovered} rounds; then {efficiency:.4f} of the best K's goodput")
    assert recovered <= SETTLE_ROUNDS and efficiency >= 0.98


def test_uses_per_position_acceptance():
    """Position-dependent acceptance (a_0 = a_1 = 0.95, then 0.2): the best K is 2, while the single rate pooled
    over positions (~0.7) would suggest K ~ 4 and lose ~8%. Cost model as in the stationary test."""
    cost, profile = CostModel(), (0.95, 0.95) + (0.2,) * (K_MAX - 2)
    assert cost.best_k(profile) == 2 and cost.goodput(profile, 4) < 0.93 * cost.goodput(profile, 2)
    alphas = (profile,) * ROUNDS
    fixed = fixed_throughputs(alphas, cost)
    run = run_policy(alphas, cost)
    ratio = run.throughput / max(fixed.values())
    print(f"\nper-position profile: goodput {ratio:.3f} of the best fixed K ({max(fixed, key=fixed.get)})")
    assert ratio >= 1 - STATIONARY_TOLERANCE


# -- 4: K = 0 --------------------------------------------------------------------------------------------------------

def test_chooses_k0_when_speculation_does_not_pay():
    """alpha 0.05 and a draft token costing half a verify pass: plain decoding is ~35% faster than K=1."""
    cost, alphas = CostModel(t_draft=0.5), (0.05,) * 1000
    assert cost.best_k(0.05) == 0
    run = run_policy(alphas, cost)
    chosen = [k for k, probe in zip(run.ks[100:], run.probes[100:]) if not probe]
    ratio = run.throughput / run_policy(alphas, cost, "fixed", 0).throughput
    print(f"\nK=0 on {chosen.count(0)}/{len(chosen)} non-probe rounds; throughput {ratio:.3f} of fixed K=0")
    assert chosen.count(0) == len(chosen)
    assert ratio >= 0.85        # the price of warm-up at K=4 and of probes (~1 round in 8 at K >= 1)


# -- 5: threshold and fixed policies -----------------------------------------------------------------------------

def drive(controller: KController, rounds: int, accepted_of) -> list[int]:
    """Run rounds with `accepted_of(k)` accepted drafts and fixed timings; return the chosen Ks."""
    ks = []
    for _ in range(rounds):
        k = controller.choose_k()
        ks.append(k)
        controller.observe(k, accepted_of(k), RoundTimings(0.1 * k, verify_seconds=1.0 + 0.05 * k, rtt_seconds=0.2))
    return ks


def test_threshold_policy_steps_k_by_one_within_bounds():
    config = sequential(policy="threshold", k=2, k_min=1, k_max=4, adjust_every=4, probe_every=0)
    controller = KController(config, random.Random(0))
    assert drive(controller, 16, lambda k: k) == [2] * 4 + [3] * 4 + [4] * 8          # rate 1.0 > 0.8: up, clamped
    assert drive(controller, 4, lambda k: min(k, 2)) == [4] * 4                     # rate 0.6: holds
    assert drive(controller, 20, lambda k: 0) == [4] * 4 + [3] * 4 + [2] * 4 + [1] * 8   # rate 0 < 0.4: down, clamped


def test_threshold_policy_leaves_k0_through_probes():
    config = sequential(policy="threshold", k=0, adjust_every=4, probe_every=4, warmup_rounds=0)
    ks = drive(KController(config, random.Random(0)), 200, lambda k: k)
    assert max(ks) == config.k_max and ks[-1] == config.k_max


def test_fixed_policy_never_moves():
    controller = KController(sequential(policy="fixed", k=3), random.Random(0))
    rng = random.Random(1)
    ks = drive(controller, 500, lambda k: rng.randint(0, k))
    assert set(ks) == {3} and controller.k == 3 and not controller.probing


# -- 6: config validation and update_config ---------------------------------------------------------------------

@pytest.mark.parametrize("changes, key", [
    ({"policy": "bogus"}, "policy"),
    ({"k_min": 3, "k": 3, "k_max": 2}, "k_max"),
    ({"k_min": -1}, "k_min"),
    ({"k": 9}, "k"),
    ({"window": 0}, "window"),
    ({"prior_acceptance": 1.5}, "prior_acceptance"),
    ({"lower_below": 0.9}, "lower_below"),
    ({"hysteresis": -0.1}, "hysteresis"),
    ({"probe_every": -1}, "probe_every"),
    ({"change_z": -1.0}, "change_z"),
])
def test_config_errors_name_the_field(changes, key):
    with pytest.raises(ValueError, match=rf"^speculation\.{key}: "):
        replace(ControllerConfig(), **changes).validate()
    with pytest.raises(ValueError, match=rf"^controller\.{key}: "):
        replace(ControllerConfig(), **changes).validate("controller")
    with pytest.raises(ValueError, match=rf"^speculation\.{key}: "):
        KController(replace(ControllerConfig(), **changes))


def test_update_config_keeps_statistics_and_clamps_k():
    controller = KController(sequential(k=2), random.Random(0))
    simulate(controller, make_trace((0.9,) * 300, 0, 0.1), CostModel())
    before = controller.snapshot()
    assert before["k"] >= 5

    controller.update_config(replace(controller.config, k_min=1, k_max=3))          # k itself unchanged
    after = controller.snapshot()
    assert controller.k == 3 and after["rounds"] == before["rounds"] and after["costs"] == before["costs"]
    assert after["samples"] == before["samples"][:3]
    assert after["acceptance"] == pytest.approx(before["acceptance"][:3], abs=0.02)   # pooled prior: 3 positions
    assert controller.choose_k() in (1, 2, 3)

    controller.update_config(replace(controller.config, k_max=8))          # widening recounts from the window
    assert controller.snapshot()["samples"] == before["samples"]
    assert controller.snapshot()["acceptance"] == before["acceptance"]
    with pytest.raises(ValueError, match=r"^speculation\.k: "):
        controller.update_config(replace(controller.config, k=9))
    assert controller.config.k_max == 8



@pytest.mark.parametrize("policy", ["goodput", "threshold"])
def test_a_reload_that_changes_k_holds_it_for_a_fresh_warmup_keeping_the_statistics(policy):
    """The README's warmup_rounds are "rounds at k before the goodput model decides": an operator who reloads k
    expects rounds at it, not the K the old statistics chose (update_config used to clamp K and nothing more)."""
    controller = KController(sequential(policy=policy, k=2, warmup_rounds=16, adjust_every=8), random.Random(0))
    simulate(controller, make_trace((0.9,) * 300, 0, 0.1), CostModel())
    before = controller.snapshot()
    assert controller.k >= 4

    controller.update_config(replace(controller.config, k=1))
    after = controller.snapshot()
    assert controller.k == 1 and after["samples"] == before["samples"] and after["costs"] == before["costs"]
    held = simulate(controller, make_trace((0.9,) * 8, 1, 0.1), CostModel())
    assert held.ks == [1] * 8                       # no model step, no threshold step, no probe
    if policy == "goodput":
        simulate(controller, make_trace((0.9,) * 8, 2, 0.1), CostModel())
        assert controller.choose_k() >= 4           # warmed up: the kept statistics decide again at once


def test_a_reload_that_leaves_k_alone_keeps_the_k_the_policy_chose():
    controller = KController(sequential(k=2), random.Random(0))
    simulate(controller, make_trace((0.9,) * 300, 0, 0.1), CostModel())
    chosen = controller.k
    controller.update_config(replace(controller.config, hysteresis=0.02, probe_every=4))
    assert controller.k == chosen >= 4 and controller.choose_k() != 2


# -- 7: determinism --------------------------------------------------------------------------------------------------

def test_seeded_rng_gives_identical_k_sequences():
    cost, trace = CostModel(), make_trace((0.6,) * 1000, 3, 0.1)
    first = simulate(KController(sequential(), random.Random(11)), trace, cost)
    second = simulate(KController(sequential(), random.Random(11)), trace, cost)
    other = simulate(KController(sequential(), random.Random(12)), trace, cost)
    assert first.ks == second.ks and first.probes == second.probes and first.throughput == second.throughput
    assert other.probes != first.probes                       # the RNG really drives the probe schedule


# -- statistics and the model ------------------------------------------------------------------------------------

def test_status_shows_costs_and_goodput_as_null_until_a_verify_is_timed():
    """Untimed, every cost is 0 and goodput E[K] / 1e-12 (status showed {"0": 1000000000000.0, ...}): null."""
    pool = KController(sequential(), random.Random(0))
    own = KController(sequential(), random.Random(1), pool=pool)
    for controller in (pool, own):
        snapshot = controller.snapshot()
        assert snapshot["costs"] is None and snapshot["goodput_tokens_per_s"] is None
    pool.observe(2, 1, RoundTimings(draft_seconds=0.002, verify_seconds=0.003, rtt_seconds=0.001))
    for controller in (pool, own):
        goodput = controller.snapshot()["goodput_tokens_per_s"]
        assert controller.snapshot()["costs"]["t_verify_b_ms"] == 0.0 and 0 < goodput["0"] < 1000


def test_status_costs_are_milliseconds_to_three_decimals_named_so():
    """Costs were raw seconds with 16 digits; now milliseconds, 3 decimals, the unit in each key, no -0.0. The
    verify line's intercept is an extrapolation to a forward of no tokens and may be negative (a verify costing
    more per token at the larger sizes seen): shown as fitted."""
    controller = KController(sequential(), random.Random(0))
    for tokens, seconds in ((5, 0.002), (9, 0.0045)) * 20:
        controller.observe(tokens - 1, 0, RoundTimings(draft_seconds=0.0011 * (tokens - 1), verify_seconds=seconds,
                                                       rtt_seconds=1e-7, between_seconds=0.00061234))
    costs = controller.snapshot()["costs"]
    assert set(costs) == {key if key == "load" else f"{key}_ms" for key in controller.costs()}
    assert costs["between_ms"] == 0.612 and costs["rtt_target_ms"] == 0.0 and costs["load"] == 1.0
    assert all(value == round(value, 3) for value in costs.values())
    assert "-0.0" not in json.dumps(costs) and costs["t_verify_a_ms"] < 0 < costs["t_verify_b_ms"]
    assert round_time(4, controller.costs()) > 0


def test_round_outcome_counts_per_position():
    controller = KController(sequential(k_max=6, prior_weight=0.0), random.Random(0))
    controller.observe(4, 2)        # positions 0, 1 accepted, 2 rejected, 3.. not attempted
    controller.observe(4, 4)        # 0..3 accepted
    controller.observe(0, 0)        # plain decoding: nothing attempted
    snapshot = controller.snapshot()
    assert snapshot["samples"] == [2, 2, 2, 1, 0, 0]
    assert snapshot["acceptance"][:4] == [1.0, 1.0, 0.5, 1.0]
    assert snapshot["rounds"] == 3


def test_cost_model_fits_timings():
    controller = KController(sequential(), random.Random(0))
    for _ in range(50):
        controller.observe(3, 1, RoundTimings(3 * 0.12, None, 0.3, 1.0 + 0.05 * 3, 0.2))
    single = controller.costs()                               # one K seen: flat line through its mean
    assert single["t_verify_b"] == pytest.approx(0.0, abs=1e-9) and single["t_verify_a"] == pytest.approx(1.15)
    for k in (1, 6) * 50:
        controller.observe(k, 0, RoundTimings(k * 0.12, None, 0.3, 1.0 + 0.05 * k, 0.2))
    costs = controller.costs()
    assert costs["t_draft"] == pytest.approx(0.12) and costs["load"] == 1.0
    assert costs["t_verify_b"] == pytest.approx(0.05, abs=0.002)        # seconds per token of the forward
    assert (costs["rtt_target"], costs["rtt_draft"]) == (pytest.approx(0.2), pytest.approx(0.3))
    assert round_time(0, costs) == pytest.approx(1.0 + 0.2, abs=0.01)
    assert round_time(4, costs) == pytest.approx(4 * 0.12 + 0.3 + 1.0 + 0.05 * 4 + 0.2, abs=0.01)


# -- load: batched verification on a compute-bound target ---------------------------------------------------------

LOAD_ALPHA = 0.7


def loaded_verify_seconds(load: int, k: int) -> float:
    """A target whose forward costs 0.1 s + 0.04 s per token in the batch (every row at the same K)."""
    return 0.1 + 0.04 * load * (k + 1)


def loaded_goodput(load: int, k: int) -> float:
    draft = 0.02 * k + 0.01 if k else 0.0
    return mean_tokens(LOAD_ALPHA, k) / (draft + loaded_verify_seconds(load, k) + 0.01)


def run_loaded(controller: KController, load: int, rounds: int, rng: random.Random) -> float:
    """Rounds at a fixed load; returns the throughput (tokens per second) of the controller's choices."""
    tokens = elapsed = 0.0
    for _ in range(rounds):
        k = controller.choose_k()
        accepted = 0
        while accepted < k and rng.random() < LOAD_ALPHA:
            accepted += 1
        draft, verify = 0.02 * k, loaded_verify_seconds(load, k)
        controller.observe(k, accepted, RoundTimings(draft, None, 0.01, verify, 0.01, batch_size=load,
                                                        batch_tokens=load * (k + 1)))
        tokens += accepted + 1
        elapsed += draft + (0.01 if k else 0.0) + verify + 0.01
    return tokens / elapsed


def test_load_shrinks_k_to_zero_when_the_target_is_compute_bound():
    """At load 1 the cost model's best K is 2; with 16 rows per forward it is 0 (plain decoding), and the
    controller follows the load down and back up, never far below plain decoding."""
    best = {load: max(range(K_MAX + 1), key=lambda k: loaded_goodput(load, k)) for load in (1, 16)}
    assert best == {1: 2, 16: 0}
    controller, rng = KController(sequential(k=4, k_max=K_MAX), random.Random(0)), random.Random(1)
    run_loaded(controller, 1, 300, rng)
    assert loaded_goodput(1, controller.k) >= 0.98 * loaded_goodput(1, best[1])   # K 1 and 2: within 1.2 %
    run_loaded(controller, 16, 50, rng)                  # load rises: K follows within 50 rounds
    assert controller.k == best[16]
    heavy = run_loaded(controller, 16, 400, rng)
    assert heavy >= 0.95 * loaded_goodput(16, 0)         # never well below plain decoding under load
    run_loaded(controller, 1, 100, rng)                  # load falls: speculation comes back
    assert controller.k >= 1
    assert run_loaded(controller, 1, 400, rng) >= 0.95 * loaded_goodput(1, best[1])


def probes_in(controller: KController, load: int, rounds: int, rng: random.Random) -> int:
    """run_loaded's rounds, counting those that were probes."""
    probes = 0
    for _ in range(rounds):
        run_loaded(controller, load, 1, rng)
        probes += controller.probing
    return probes


def test_under_load_probes_thin_out_by_the_load_up_to_four_times_and_resume_as_soon_as_it_falls():
    """A probe under load delays its request and the batch's tail, while the pool plans for load times as many
    requests: probes come about load times (at most PLAN_LOAD_CAP times) less often, and once the load falls,
    the next one is due within probe_every's jittered gap."""
    config = sequential(k=0, k_max=K_MAX, probe_every=8, random_probe=0.0, warmup_rounds=0, load_window=1)
    controller, rng = KController(config, random.Random(0)), random.Random(1)
    alone = probes_in(controller, 1, 800, rng)
    loaded = probes_in(controller, 16, 800, rng)
    assert 80 <= alone <= 120, alone                                       # 800 / 8
    assert abs(loaded - 800 / (8 * PLAN_LOAD_CAP)) <= 9, loaded           # 800 / 32 = 25
    while probes_in(controller, 16, 1, rng) == 0:                          # a probe under load, just now: a gap of
        pass                                                               # 4-12 calls, times 4 while loaded
    assert probes_in(controller, 1, 12, rng) >= 1     # the load fell: due within the gap alone (not 4x it, as a
                                                      # deadline fixed at the last probe, under load, would be)


def test_a_negative_draft_round_trip_never_makes_a_round_cheaper_than_its_verify():
    """Handed-off rounds whose drafting hid behind the verify call's way teach a negative rtt_draft (their wait less
    the draft's compute); at a smaller K than they ran at, the draft path would come out negative: it is floored at
    0, so no K looks faster than its verify alone, in turn or overlapped."""
    costs = {"t_draft": 0.0015, "draft_fixed": 0.0, "rtt_draft": -0.005, "t_verify_a": 0.010, "t_verify_b": 0.0,
             "plain_a": 0.010, "rtt_target": 0.001, "rtt_plain": 0.001, "between": 0.0, "load": 1.0}
    for k in range(1, 9):
        assert round_time(k, costs) >= 0.011 - 1e-12, k
        assert round_time(k, costs, hit=0.5) >= 0.011 - 1e-12, k
    assert round_time(1, costs) == pytest.approx(0.011)


def test_expected_tokens_formula():
    assert expected_tokens([0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.9, 0.5, 0.2], 3) == pytest.approx(1 + 0.9 + 0.45 + 0.09)
    assert expected_tokens([0.6], 4) == pytest.approx((1 - 0.6 ** 5) / 0.4)
    assert expected_curve([0.9, 0.5, 0.2], 4) == pytest.approx([expected_tokens([0.9, 0.5, 0.2], k) for k in range(5)])


# ---- overlap (draft-ahead) --------------------------------------------------------------------------------
# Pipeline cost model: while round r verifies, the draft pre-drafts a guess of the target's next token and
# r+1's K drafts. Round r+1's drafts are ready (no draft call on its critical path) iff r accepted all its K
# drafts and the guess was right (probability alpha, like one more draft position). A verdict that rejects a draft
# cancels the pre-draft; one that accepts all K waits for it if it is still running (as measured on the running
# system: benchmarks/k_trace.py).
OVERLAP_COST = CostModel(t_draft=0.3, verify_base=1.0, verify_per_k=0.05, rtt=0.2, jitter=0.1)


def simulate_overlapped(controller: KController, trace: tuple, cost: CostModel, runner_up: float = 0.0) -> float:
    """`runner_up`: the chance that the draft's runner-up is the target's correction at a rejection, where the
    controller's config pre-drafts a branch (the first overlap_branches positions); such a verdict waits for the
    pre-draft like an all-accepted one, and the next round's drafts are ready."""
    branches = controller.config.overlap_branches
    tokens = elapsed = 0.0
    ready, rng = False, random.Random(7)
    for alpha, uniforms, jit in trace:
        k = controller.choose_k()
        accepted = 0
        while accepted < k and uniforms[accepted] < alpha:
            accepted += 1
        draft = k * cost.t_draft * jit[0]
        verify, rtt = (cost.verify_base + cost.verify_per_k * k) * jit[1], cost.rtt * jit[2]
        draft_path = draft + cost.rtt * jit[3] if k else 0.0
        predraft_path = draft_path + cost.t_draft * jit[0] if k else 0.0
        guess, branched = rng.random() < alpha, k > 0 and accepted < min(k, branches)
        branch_hit = branched and rng.random() < runner_up
        # the verdict: a rejection cancels the pre-draft unless a branch guessed it; all accepted waits for it
        # (measured, benchmarks.k_trace); so does a branch hit
        waited = max(predraft_path - verify - rtt, 0.0) if accepted == k or branch_hit else 0.0
        elapsed += verify + rtt + waited + (0.0 if ready else draft_path)
        hit = k > 0 and ((accepted == k and guess) or branch_hit)
        controller.observe(k, accepted, RoundTimings(draft, None, cost.rtt * jit[3], verify, rtt,
                                                     guess_hit=guess if k and accepted == k else None,
                                                     branch_hit=branch_hit if branched else None))
        ready, tokens = hit, tokens + accepted + 1
    return tokens / elapsed


@pytest.mark.parametrize("alpha", [0.6, 0.8, 0.9])
def test_overlap_model_goodput_within_5pct_of_best_fixed_k(alpha):
    """With drafting off the critical path on a hit, the controller that models overlap keeps up with the best
    fixed K of the overlapped pipeline, and beats the controller that assumes draft and verify run in turn."""
    trace = make_trace((alpha,) * ROUNDS, 0, OVERLAP_COST.jitter)
    fixed = {k: simulate_overlapped(KController(overlapped(policy="fixed", k=k, k_max=K_MAX)), trace,
                                    OVERLAP_COST) for k in range(K_MAX + 1)}
    aware = simulate_overlapped(KController(overlapped(k_max=K_MAX), random.Random(0)), trace, OVERLAP_COST)
    in_turn = simulate_overlapped(KController(sequential(k_max=K_MAX), random.Random(0)), trace, OVERLAP_COST)
    print(f"alpha={alpha}: overlap-aware {aware:.3f}, in-turn model {in_turn:.3f}, "
          f"best fixed {max(fixed.values()):.3f} at K={max(fixed, key=fixed.get)}")
    assert aware >= (1 - STATIONARY_TOLERANCE) * max(fixed.values())
    assert aware >= in_turn * 0.99


def test_overlap_hit_rate_is_all_accepted_times_learned_guess_rate():
    controller = KController(overlapped(k_max=4, prior_weight=0.0, cost_window=10 ** 9), random.Random(0))
    for hit in [True] * 30 + [False] * 10:      # all 2 drafts accepted; the guess right 3 times in 4
        controller.observe(2, 2, RoundTimings(guess_hit=hit))
    for _ in range(40):                         # position 0 accepted, position 1 rejected
        controller.observe(2, 1, RoundTimings())
    assert controller.guess_rate() == pytest.approx(0.75)
    assert controller.hit_rate(1) == pytest.approx(1.0 * 0.75)
    assert controller.hit_rate(2) == pytest.approx(0.5 * 0.75)


@pytest.mark.parametrize("alpha", [0.5, 0.7])
def test_overlap_model_with_rejection_branches_keeps_up_with_the_best_fixed_k(alpha):
    """Rejection branches that guess the correction half the time make more rounds ready (at lower acceptance
    most of all); the controller that learns that rate keeps up with the best fixed K of that pipeline."""
    trace = make_trace((alpha,) * ROUNDS, 0, OVERLAP_COST.jitter)
    fixed = {k: simulate_overlapped(KController(overlapped(policy="fixed", k=k, k_max=K_MAX)), trace,
                                    OVERLAP_COST, runner_up=0.5) for k in range(K_MAX + 1)}
    aware = simulate_overlapped(KController(overlapped(k_max=K_MAX), random.Random(0)), trace, OVERLAP_COST, 0.5)
    unbranched = simulate_overlapped(KController(overlapped(policy="fixed", k=max(fixed, key=fixed.get),
                                                            k_max=K_MAX, overlap_branches=0)), trace, OVERLAP_COST)
    print(f"alpha={alpha}: branch-aware {aware:.3f}, best fixed {max(fixed.values()):.3f} at "
          f"K={max(fixed, key=fixed.get)}, that K without branches {unbranched:.3f}")
    assert aware >= (1 - STATIONARY_TOLERANCE) * max(fixed.values())
    assert max(fixed.values()) > unbranched


def test_overlap_hit_rate_counts_each_branched_rejection_at_the_learned_runner_up_rate():
    config = overlapped(k_max=4, prior_weight=0.0, cost_window=10 ** 9)
    controller = KController(config, random.Random(0))
    for hit in [True] * 30 + [False] * 10:      # all 2 drafts accepted; the guess right 3 times in 4
        controller.observe(2, 2, RoundTimings(guess_hit=hit))
    for hit in [True] * 20 + [False] * 20:      # position 1 rejected; the runner-up the correction 1 time in 2
        controller.observe(2, 1, RoundTimings(branch_hit=hit))
    assert controller.branch_rate() == pytest.approx(0.5)
    assert controller.hit_rate(2) == pytest.approx(0.5 * 0.75 + 1.0 * 0.5 * 0.5)   # a_0 = 1, a_1 = 0.5
    controller.update_config(replace(config, overlap_branches=1))   # the one branch goes where drafts are rejected
    assert controller.branch_plan(2) == [(1, 0)]
    assert controller.hit_rate(2) == pytest.approx(0.5 * 0.75 + 1.0 * 0.5 * 0.5)
    controller.update_config(replace(config, overlap_branches=0))
    assert controller.hit_rate(2) == pytest.approx(0.5 * 0.75)


def test_branch_plan_takes_the_likeliest_verdicts_runner_ups_first_while_nothing_is_learned():
    # P(exactly j accepted) for a = (0.5, 0.8, 0.5): 0.5, 0.1, 0.2; runner-up right 0.6, third 0.4 * 0.5 = 0.2
    rates, rank_rates = [0.5, 0.8, 0.5], [0.6, 0.2]
    assert branch_plan(rates, 3, 6, rank_rates) == [(0, 0), (2, 0), (0, 1), (1, 0), (2, 1), (1, 1)]
    assert branch_plan(rates, 3, 3, rank_rates) == [(0, 0), (2, 0), (0, 1)]
    assert branch_plan(rates, 1, 8, rank_rates) == [(0, 0), (0, 1)]            # no branch past K's drafts
    assert branch_plan(rates, 3, 4, [0.0, 0.0]) == [(0, 0), (1, 0), (2, 0), (0, 1)]
    assert branch_plan(rates, 3, 8, [0.6]) == [(0, 0), (2, 0), (1, 0)]           # one guess per position
    exactly = [0.5, 0.1, 0.2]
    for budget in range(7):                    # h(K) counts the planned branches at their chances
        planned = sum(exactly[j] * rank_rates[rank] for j, rank in branch_plan(rates, 3, budget, rank_rates))
        assert overlap_chances(rates, 3, 0.0, rank_rates, budget)[3][0] == pytest.approx(planned)


def test_overlap_hit_rate_counts_third_choice_branches_at_their_learned_rate():
    config = overlapped(k_max=4, prior_weight=0.0, cost_window=10 ** 9, overlap_branches=4)
    controller = KController(config, random.Random(0))
    for runner_up, third in [(True, None)] * 20 + [(False, True)] * 5 + [(False, False)] * 15:
        controller.observe(2, 0, RoundTimings(branch_hit=runner_up, third_hit=third))   # position 0 rejected
    assert controller.third_rate() == pytest.approx(0.25)
    assert controller.rank_rates() == pytest.approx([0.5, 0.5 * 0.25])
    assert controller.hit_rate(1) == pytest.approx(0.5 + 0.125)      # a_0 = 0: every verdict rejects draft 0
    controller.update_config(replace(config, overlap_branch_guesses=1))
    assert controller.branch_plan(2) == [(0, 0), (1, 0)]
    assert controller.hit_rate(1) == pytest.approx(0.5)


def test_overlap_round_time_counts_drafting_only_on_a_miss():
    costs = {"t_draft": 0.1, "rtt_draft": 0.2, "t_verify_a": 1.0, "t_verify_b": 0.0, "rtt_target": 0.2, "load": 1}
    assert round_time(3, costs) == pytest.approx(0.5 + 1.2)                    # in turn
    assert round_time(3, costs, hit=1.0) == pytest.approx(1.2)                 # the pre-draft (0.6) hides
    assert round_time(3, costs, hit=0.0) == pytest.approx(1.2 + 0.5)
    assert round_time(12, costs, hit=1.0) == pytest.approx(1.3 + 0.2)          # pre-draft longer than verify


def test_predraft_branches_shrink_while_predrafts_outlast_their_verdicts_and_grow_back_when_they_fit():
    controller = KController(overlapped(k_max=4, overlap_branches=3), random.Random(0))
    assert controller.branches == 3
    controller.observe(2, 2, RoundTimings(predraft_done=False, branches=3))     # too slow: one branch fewer
    assert controller.branches == 2
    controller.observe(2, 2, RoundTimings(predraft_done=False, branches=3))     # a late answer of the old size
    assert controller.branches == 2
    for _ in range(2):
        controller.observe(2, 1, RoundTimings(predraft_done=False, branches=controller.branches))
    assert controller.branches == 0
    controller.observe(2, 1, RoundTimings(predraft_done=False, branches=0))
    assert controller.branches == 0
    for expected in (1, 2, 3, 3):                                               # 16 in a row that fit: one more
        for _ in range(16):
            controller.observe(2, 2, RoundTimings(predraft_done=True, branches=controller.branches))
        assert controller.branches == expected
    own = KController(overlapped(k_max=4, overlap_branches=3), random.Random(1), pool=controller)
    controller.observe(2, 2, RoundTimings(predraft_done=False, branches=3))
    assert own.branches == controller.branches == 2                             # a request's: its pool's
    assert controller.snapshot()["overlap"]["branches"] == 2                     # shown by specpool status


def test_a_pool_keeps_its_branch_budget_while_the_operator_turns_branches_off_or_down():
    """Pre-drafts without branches say nothing of what branches cost: a hot reload that turns them off (or lowers
    them) and back finds the budget as it was, not at 0 (where one late pre-draft, or growth capped at the lower
    limit, had left it), even if a branchless pre-draft from before the reload comes back late after it."""
    config = overlapped(k_max=4, overlap_branches=3)
    controller = KController(config, random.Random(0))
    for lowered in (0, 1):
        controller.update_config(replace(config, overlap_branches=lowered))
        assert controller.branches == lowered
        controller.observe(2, 2, RoundTimings(predraft_done=False, branches=0))
        for _ in range(16):
            controller.observe(2, 2, RoundTimings(predraft_done=True, branches=lowered))
        controller.update_config(config)
        controller.observe(2, 2, RoundTimings(predraft_done=False, branches=0))    # planned before the reload
        assert controller.branches == 3


def test_a_request_controller_starts_from_its_pool_guess_and_runner_up_rates():
    """A request's own controller sees few overlapped rounds: its guess and runner-up rates start at its pool's and
    move towards its own (shrinking a few tries towards 0 made it think overlap pays less and drop K)."""
    config = overlapped(k_max=4, prior_weight=8.0, cost_window=10 ** 9)
    pool = KController(config, random.Random(0))
    for _ in range(200):
        pool.observe(2, 1, RoundTimings(branch_hit=True))
        pool.observe(2, 2, RoundTimings(guess_hit=True))
    own = KController(config, random.Random(1), pool=pool)
    assert own.branch_rate() == pytest.approx(pool.branch_rate()) and pool.branch_rate() > 0.95
    assert own.guess_rate() == pytest.approx(pool.guess_rate())
    for _ in range(8):                           # its own runner-ups were never right: halfway after 8 tries
        own.observe(2, 1, RoundTimings(branch_hit=False))
    assert own.branch_rate() == pytest.approx(pool.branch_rate() / 2)
