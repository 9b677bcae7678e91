"""The concurrency sweep: n concurrent streams (stream j runs through the prompt set once, starting at prompt
j) for each n of --concurrency. Aggregate tokens/s of specpool adaptive with batching on (the config's
max_batch_size) and off (max_batch_size 1), K = 0 with batching on and transformers generate() of the target as
left-padded batches of n (in this process, the service up and idle), those three interleaved repeat by repeat;
forward passes per generated token and mean batch from the workers'
batch_stats(); the ratios between them and their goals.

    python -m benchmarks.speedup --sweep-only --quick --concurrency 1,2   # a smoke run of the sweep alone
"""
from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from benchmarks.hf_baseline import hf_run, load_hf
from benchmarks.plan import BenchConfig
from benchmarks.repeats import paired
from benchmarks.service import log, stream_one

ON_ADAPTIVE, OFF_ADAPTIVE = "specpool adaptive, batching on", "specpool adaptive, batching off"
ON_K0, HF_BATCHED = "specpool K=0, batching on", "transformers generate(), batched"
GOALS = {"scaling": 3.0, "adaptive / K=0": 0.95, "adaptive / transformers batched": 0.95}
GOAL_STREAMS = 8      # the scaling goal: aggregate tokens/s at 8 streams >= 3x that of 1 stream


def stream_prompts(cfg: BenchConfig, j: int) -> list[str]:
    """Stream j's prompts: the prompt set from prompt j on, so that concurrent requests differ."""
    j %= len(cfg.prompts)
    return cfg.prompts[j:] + cfg.prompts[:j]


def run_streams(stub, cfg: BenchConfig, n: int, k: int | None) -> tuple[int, float]:
    """(tokens, seconds) of n concurrent streams, each running through its prompts once (in the client process)."""
    def one(j: int) -> int:
        return sum(stream_one(stub, p, cfg.max_new_tokens, k)["tokens"] for p in stream_prompts(cfg, j))
    with ThreadPoolExecutor(n) as pool:
        started = time.perf_counter()
        tokens = sum(pool.map(one, range(n)))
        return tokens, time.perf_counter() - started


def batch_stats(pools) -> dict:
    """The workers' cumulative batch_stats() (forward passes, rows), summed over the draft replicas
    and the target replicas' rank 0: {"draft": (passes, rows), "target": (passes, rows)}."""
    import ray
    got = {"draft": ray.get([actor.batch_stats.remote() for actor in pools.draft_actors]),
           "target": ray.get([ranks[0].batch_stats.remote() for ranks in pools.target_actors])}
    return {pool: (sum(s["forward_passes"] for s in stats), sum(s["rows"] for s in stats))
            for pool, stats in got.items()}


def target_cpu_s(pools) -> float:
    """CPU seconds the target replicas' rank 0 processes have used, summed."""
    import ray
    return sum(ray.get([ranks[0].cpu_seconds.remote() for ranks in pools.target_actors]))


def sweep_sample(service, cfg: BenchConfig, n: int, k: int | None) -> dict:
    """One run of n streams: aggregate tokens/s, per pool forward passes per generated token and mean batch (rows
    per forward pass), and how busy the target was (target_busy: its rank 0's CPU seconds per second of the run,
    a mean over replicas; near 1, its one core is the bottleneck)."""
    pools = service.service.pools
    before, cpu, started = batch_stats(pools), target_cpu_s(pools), time.perf_counter()
    tokens, seconds = service.client(run_streams, cfg, n, k)
    busy = (target_cpu_s(pools) - cpu) / (time.perf_counter() - started) / len(pools.target_actors)
    after = batch_stats(pools)
    sample = {"tokens_per_s": tokens / seconds, "target_busy": busy}
    for pool in after:
        passes, rows = (now - then for now, then in zip(after[pool], before[pool]))
        sample[f"{pool}_passes_per_token"] = passes / tokens
        sample[f"{pool}_mean_batch"] = rows / max(1, passes)
    return sample


def specpool_sweep(service, cfg: BenchConfig, variants: dict) -> dict:
    """{name: {n: level}} of the running service for each named K (None: adaptive; a callable: sample(n), another
    system's, such as hf_batched_sampler's) and stream count n: medians
    over repeats of sweep_sample() and each repeat's tokens/s ("rates"), the variants' samples interleaved (each
    variant once, then each again, in the reverse order every other repeat), so that the machine's drift over
    minutes, and whatever the sample before leaves behind, falls on all of them alike and their ratio compares
    like with like (sweep_ratios pairs them repeat by repeat)."""
    result: dict = {name: {} for name in variants}
    for n in cfg.concurrency:
        samples = {name: [] for name in variants}
        for repeat in range(cfg.repeats):
            for name, k in list(variants.items())[::-1 if repeat % 2 else 1]:
                samples[name].append(k(n) if callable(k) else sweep_sample(service, cfg, n, k))
        for name, runs in samples.items():
            result[name][n] = level = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
            level["rates"] = [run["tokens_per_s"] for run in runs]
            log(f"{name}, {n} stream(s): {level['tokens_per_s']:.1f} tokens/s" + (
                f", {level['target_passes_per_token']:.3f} target passes/token, mean target batch "
                f"{level['target_mean_batch']:.2f}, target busy {level['target_busy']:.2f}" if "target_busy" in level
                else ""))
    return result


def hf_batched_sampler(cfg: BenchConfig, model_path: str):
    """sample(n): one run of transformers generate() of the target over the sweep's prompts as left-padded batches
    of n, in this process ({"tokens_per_s"}), for specpool_sweep to interleave with the service's samples."""
    target, tokenizer = load_hf(model_path)
    hf_run(target, tokenizer, [cfg.prompts[:2]], 4)     # warm-up

    def sample(n: int) -> dict:
        batches = [[stream_prompts(cfg, j)[i] for j in range(n)] for i in range(len(cfg.prompts))]
        seconds, tokens = hf_run(target, tokenizer, batches, cfg.max_new_tokens)
        return {"tokens_per_s": tokens / seconds}
    return sample


def batching_config(service) -> dict:
    """The running service's max_batch_size and batch_wait_ms per pool."""
    return {pool: {"max_batch_size": getattr(service.service.config, pool).max_batch_size,
                   "batch_wait_ms": getattr(service.service.config, pool).batch_wait_ms}
            for pool in ("draft", "target")}


def sweep_ratios(sweep: dict) -> dict:
    """Per stream count: batching on / off, adaptive / K=0, adaptive / transformers batched; and each
    variant's aggregate tokens/s over its own at the fewest streams ("scaling"). Adaptive / K=0 and adaptive /
    transformers batched, whose samples were taken side by side, are the median of their ratios repeat by repeat
    (benchmarks/repeats.py `paired`); batching on / off, measured apart, is a ratio of medians."""
    def ratio(a: str, b: str) -> dict:
        return {n: sweep[a][n]["tokens_per_s"] / sweep[b][n]["tokens_per_s"] for n in sweep[a]}

    def side_by_side(a: str, b: str) -> dict:
        return {n: paired(sweep[a][n], sweep[b][n])[0] for n in sweep[a]}

    def scaling(variant: dict) -> dict:
        return {n: level["tokens_per_s"] / variant[min(variant)]["tokens_per_s"] for n, level in variant.items()}
    return {"batching on / off": ratio(ON_ADAPTIVE, OFF_ADAPTIVE), "adaptive / K=0": side_by_side(ON_ADAPTIVE, ON_K0),
            "adaptive / transformers batched": side_by_side(ON_ADAPTIVE, HF_BATCHED),
            "scaling": {name: scaling(variant) for name, variant in sweep.items()}}


def verdict(name: str, ratios: dict, goal: float | None = None) -> str:
    """One line of ratios per stream count, e.g. "name: 1: 1.20x, 2: 0.90x (goal >= 0.95x: missed at 2 streams)"."""
    text = f"{name}: " + ", ".join(f"{n}: {r:.2f}x" for n, r in ratios.items())
    if goal is None:
        return text
    missed = [str(n) for n, r in ratios.items() if r < goal]
    return text + f" (goal >= {goal:g}x: " + (f"missed at {', '.join(missed)} streams)" if missed else "met)")


def goal_lines(ratios: dict) -> list[str]:
    """The sweep's verdicts: scaling with streams, batching on / off, adaptive against its baselines."""
    scaling = ratios["scaling"][ON_ADAPTIVE]
    lines = [verdict(f"{ON_ADAPTIVE}, n streams / {min(scaling)}", scaling)]
    if min(scaling) == 1 and GOAL_STREAMS in scaling:
        lines.append(verdict(f"{GOAL_STREAMS} streams / 1 stream ({ON_ADAPTIVE})",
                             {GOAL_STREAMS: scaling[GOAL_STREAMS]}, GOALS["scaling"]))
    lines.append(verdict("batching on / off (specpool adaptive)", ratios["batching on / off"]))
    return lines + [verdict(f"specpool {key}", ratios[key], GOALS[key])
                    for key in ("adaptive / K=0", "adaptive / transformers batched")]
