"""Overlap and the hop, per pair: specpool drafting and verifying in turn against overlapped (draft-ahead) at
the same K, K = 0 against transformers generate(), the adaptive policy both ways, and where a round's wall
time goes (compute, worker queue/thread hop and transport per call, the wait for a pre-draft, the router:
the router's specpool_round_seconds{part} counters), with the transformers rows the goals compare against
measured interleaved among them. Run on the demo pair and on the heavy pair (tools/heavy_pair.py: the demo
target plus zero-output layers, so a target pass costs many hops, as on a GPU).

    python -m benchmarks.speedup --quick   # includes these rows at K 2 and 4 on both pairs
"""
from __future__ import annotations

import dataclasses
import functools

from benchmarks.plan import PREDICTABLE, BenchConfig
from benchmarks.service import log, reload_section, running_data, stream_one, whole_one
from benchmarks.repeats import best, combine, paired
from benchmarks.single_stream import BASE_ROW, hf_plan, specpool_row, with_model_terms
from settings.schema import SpeculationConfig
from router.round_timing import PARTS


def set_speculation(service, **values) -> None:
    """Hot-reload speculation.<key> = value (overlap, decode_steps) on the running service."""
    reload_section(service, "speculation", **values)


ONE_CALL_PER_TOKEN = "in turn K=0, one call per token"   # decode runs off (speculation.decode_steps 1)
EACH_ANSWER_AT_ONCE = "in turn K=0, each answer at once"  # decode runs, speculation.answer_delay_ms 0
HELD_LONGER_MS = 40                                        # ... and with answers held up to this long:
HELD_LONGER = f"in turn K=0, answers held up to {HELD_LONGER_MS} ms"
NO_BRANCHES = ", no branches"                              # speculation.overlap_branches 0
NOT_STAGED = ", not staged"                                # speculation.stage_predrafts false
ONE_GUESS = ", one guess per position"                     # speculation.overlap_branch_guesses 1
HANDED_OFF = ", handed off"                                # speculation.hand_off true (the rounds that
                                                           # draft now: in turn, or overlapped and chained)
NOT_CHAINED = ", not chained"                              # speculation.chain_predrafts false
VARIANTS = ((NO_BRANCHES, {"overlap_branches": 0}), (NOT_STAGED, {"stage_predrafts": False}),
            (ONE_GUESS, {"overlap_branch_guesses": 1}), (NOT_CHAINED, {"chain_predrafts": False}),
            (HANDED_OFF, {"hand_off": True}))    # overlapped rows at K = max and adaptive, one setting changed
READ_WHOLE = ", read whole"                                # unary Generate (the rest: GenerateStream)


def counters(service) -> dict:
    """The router's cumulative round seconds per part, and its rounds (target passes)."""
    metrics = service.service.router.metrics
    parts = {s.labels["part"]: s.value for m in metrics.round_seconds.collect() for s in m.samples
             if s.name.endswith("_total")}
    rounds = next(s.value for m in metrics.target_passes.collect() for s in m.samples if s.name.endswith("_total"))
    return {**parts, "rounds": rounds}


def measured_row(service, cfg: BenchConfig, k: int | None, speculation: dict, whole: bool = False) -> dict:
    """specpool_row at K = k (None: adaptive) with these speculation settings (overlap, decode_steps,
    answer_delay_ms), streamed or (`whole`) read whole, plus ms per round by part."""
    set_speculation(service, **speculation)
    before = counters(service)
    row = service.client(specpool_row, cfg, k, whole_one if whole else stream_one)
    after = counters(service)
    rounds = max(after["rounds"] - before["rounds"], 1)
    row["parts_ms"] = {part: 1e3 * (after.get(part, 0.0) - before.get(part, 0.0)) / rounds for part in PARTS}
    row["hits"] = row.pop("predraft_hits", 0) / rounds
    row["staged"] = row.pop("staged", 0) / rounds
    return row


def pair_rows(service, cfg: BenchConfig, plan=None, only: set | None = None,
              alternate: bool = False) -> tuple[dict, dict, float]:
    """(transformers rows, specpool rows, c) of the service's pair. specpool: the rows of `plan(configured
    settings, cfg)` (specpool_plan by default) with their analytic terms; transformers: hf_plan's rows, or those of
    them named in `only`. Repeats are interleaved, the transformers rows among them: every row once, then every row
    again (`alternate`: in the reverse order every other repeat). So this noisy machine's drift over the run falls
    on every row alike, and the goals' ratios compare rows measured side by side. tokens/s is the median over
    repeats, the rest their mean."""
    transformers, c = hf_plan(service, cfg)
    transformers = [(name, measure) for name, measure in transformers if only is None or name in only]
    settings = as_configured(service)
    specpool = (plan or specpool_plan)(settings, cfg)
    measures = transformers + [(name, functools.partial(measured_row, service, k=k, speculation=speculation,
                                                        whole=name.endswith(READ_WHOLE)))
                               for name, k, speculation in specpool]
    runs = {name: [] for name, _ in measures}
    for repeat in range(cfg.repeats):
        for name, measure in (measures[::-1] if alternate and repeat % 2 else measures):
            runs[name].append(measure(dataclasses.replace(cfg, repeats=1)))
        log(f"overlap rows, repeat {repeat + 1}/{cfg.repeats}: " + ", ".join(
            f"{name} {runs[name][-1]['tokens_per_s']:.0f}" for name, _ in measures) + " tokens/s")
    set_speculation(service, **settings)
    hf = {name: combine(runs[name]) for name, _ in transformers}
    base, vocab = hf[BASE_ROW]["tokens_per_s"], service.service.pools.target_info["vocab_size"]
    return hf, {name: with_model_terms(combine(runs[name], PARTS), k, c, base, vocab) for name, k, _ in specpool}, c


def as_configured(service) -> dict:
    """The speculation settings that specpool_plan's rows vary, as the service's config has them."""
    configured = SpeculationConfig(**(service.data.get("speculation") or {}))
    return {key: getattr(configured, key) for key in ("overlap", "decode_steps", "answer_delay_ms",
                                                      "overlap_branches", "stage_predrafts",
                                                      "overlap_branch_guesses", "chain_predrafts", "hand_off")}


def specpool_plan(configured: dict, cfg: BenchConfig) -> list[tuple[str, int | None, dict]]:
    """(name, K or None for adaptive, speculation settings) of each specpool row: K = 0 three more ways, in turn
    and overlapped at K = 0, each of cfg.ks and adaptive, the VARIANTS of overlap at the largest K and
    adaptive, in turn handed off at the largest K, and two rows read whole."""
    return [(ONE_CALL_PER_TOKEN, 0, {**configured, "overlap": False, "decode_steps": 1}),
            (EACH_ANSWER_AT_ONCE, 0, {**configured, "overlap": False, "answer_delay_ms": 0}),
            (HELD_LONGER, 0, {**configured, "overlap": False, "answer_delay_ms": HELD_LONGER_MS})] + [
        (f"{'overlap' if overlap else 'in turn'} {'adaptive' if k is None else f'K={k}'}", k,
         {**configured, "overlap": overlap})
        for k in (0, *cfg.ks, None) for overlap in ((False,) if k == 0 else (False, True))] + [
        (f"overlap {'adaptive' if k is None else f'K={k}'}{suffix}", k, {**configured, "overlap": True, **changed})
        for suffix, changed in VARIANTS for k in (max(cfg.ks), None)] + [
        (f"in turn K={max(cfg.ks)}{HANDED_OFF}", max(cfg.ks), {**configured, "overlap": False, "hand_off": True})] + [
        (f"{name}{READ_WHOLE}", k, {**configured, "overlap": overlap})
        for name, k, overlap in (("in turn K=0", 0, False), ("overlap adaptive", None, True))]


def heavy_config(data: dict, extra_layers: int) -> dict:
    """The service config `data` serving the heavy pair instead."""
    from tools.heavy_pair import ensure_heavy_pair
    draft, target = ensure_heavy_pair(extra_layers)
    return {**data, "draft": {**data["draft"], "model": str(draft)}, "target": {**data["target"], "model": str(target)}}


def overlap_section(service, cfg: BenchConfig) -> dict:
    """The pair's transformers and overlap rows, measured interleaved, and the ratios the goals name."""
    transformers, rows, c = pair_rows(service, cfg)
    figures, ranges = ratios(transformers, rows, cfg.ks)
    return {"c": c, "transformers": transformers, "rows": rows, "ratios": figures, "ratio_ranges": ranges}


def heavy_section(data: dict, cfg: BenchConfig, extra_layers: int) -> dict:
    """overlap_section on the heavy pair (predictable prompts only: a pass is slow)."""
    heavy_cfg = dataclasses.replace(cfg, prompts=PREDICTABLE)
    with running_data(heavy_config(data, extra_layers)) as service:
        return {"extra_layers": extra_layers, **overlap_section(service, heavy_cfg)}


def ratios(transformers: dict, rows: dict, ks: tuple) -> tuple[dict, dict]:
    """The figures the goals of issue #11 name, from one run, and the range over repeats of each ratio of two
    rows (repeats.paired: a ratio is the median of the two rows' ratios repeat by repeat). Against the best
    transformers row over K and torch threads (generate() for K = 0)."""
    assisted, base = best_transformers(transformers)
    top = max(ks)
    pairs = {"adaptive / best assisted": ("overlap adaptive", assisted),
             "in-turn adaptive / best assisted": ("in turn adaptive", assisted),
             "adaptive read whole / best assisted": ("overlap adaptive" + READ_WHOLE, assisted),
             "K=0 / generate()": ("in turn K=0", base),
             "K=0 read whole / generate()": ("in turn K=0" + READ_WHOLE, base),
             "K=0 one call per token / generate()": (ONE_CALL_PER_TOKEN, base),
             "K=0 each answer at once / generate()": (EACH_ANSWER_AT_ONCE, base),
             f"K=0 answers held up to {HELD_LONGER_MS} ms / generate()": (HELD_LONGER, base)}
    pairs.update({f"overlap / in turn at K={k}": (f"overlap K={k}", rows[f"in turn K={k}"]) for k in ks})
    for name in (f"overlap K={top}", "overlap adaptive"):
        pairs.update({f"{name}: with branches / without": (name, rows[name + NO_BRANCHES]),
                      f"{name}: staged / not staged": (name, rows[name + NOT_STAGED]),
                      f"{name}: two guesses per position / one": (name, rows[name + ONE_GUESS]),
                      f"{name}: chained / not chained": (name, rows[name + NOT_CHAINED]),
                      f"{name}: handed off / not": (name + HANDED_OFF, rows[name])})
    pairs[f"in turn K={top}: handed off / not"] = (f"in turn K={top}{HANDED_OFF}", rows[f"in turn K={top}"])
    measured = {key: paired(rows[name], against) for key, (name, against) in pairs.items()}
    out = {key: value[0] for key, value in measured.items()}
    out.update({"ms per token beyond compute (K=0, decode runs)": hop_ms(rows["in turn K=0"]),
                "hop ms per call (K=0 one call per token, beyond compute)": hop_ms(rows[ONE_CALL_PER_TOKEN]),
                f"hop ms per round (in turn K={top}, both calls, beyond compute)": hop_ms(rows[f"in turn K={top}"]),
                f"hop ms per round (overlap K={top}, beyond compute)": hop_ms(rows[f"overlap K={top}"]),
                f"hop ms per round (overlap K={top}, not staged, beyond compute)":
                    hop_ms(rows[f"overlap K={top}{NOT_STAGED}"]),
                f"hop ms per round (overlap K={top}, not chained, beyond compute)":
                    hop_ms(rows[f"overlap K={top}{NOT_CHAINED}"]),
                f"hop ms per round (overlap K={top}, handed off, beyond compute)":
                    hop_ms(rows[f"overlap K={top}{HANDED_OFF}"]),
                f"hop ms per round (in turn K={top}, handed off, beyond compute)":
                    hop_ms(rows[f"in turn K={top}{HANDED_OFF}"]),
                "target pass ms (K=0)": rows["in turn K=0"]["parts_ms"]["verify_compute"],
                "overlap adaptive efficiency (vs in-turn analytic)": rows["overlap adaptive"]["efficiency"]})
    return out, {key: value[1:] for key, value in measured.items()}


def measured_section(c: float, transformers: dict, rows: dict, measured: dict, **extra) -> dict:
    """A pair's section as overlap_markdown shows it, from its rows and its ratios `measured` (repeats.paired's
    (median, lowest, highest) per ratio)."""
    return {"c": c, "transformers": transformers, "rows": rows, **extra,
            "ratios": {key: value[0] for key, value in measured.items()},
            "ratio_ranges": {key: value[1:] for key, value in measured.items()}}


def best_transformers(transformers: dict) -> tuple[dict, dict]:
    """(the best assisted generation row, the best generate() row) over K and torch threads: what goals compare
    against."""
    return (best([r for name, r in transformers.items() if not name.startswith(BASE_ROW)]),
            best([r for name, r in transformers.items() if name.startswith(BASE_ROW)]))


def hop_ms(row: dict) -> float:
    """A round's wall time beyond the workers' compute."""
    return sum(v for part, v in row["parts_ms"].items() if not part.endswith("compute"))
