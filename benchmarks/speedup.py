"""specpool against plain decoding and Hugging Face assisted generation, side by side in one run.

    python -m benchmarks.speedup --config deploy/local.yaml --out benchmarks/results   # what `make bench` runs

Rows (same pair, prompts and greedy sampling; benchmarks/single_stream.py): transformers generate() of the
target alone and transformers assisted generation with the same K, each with 1 and with 2 torch threads (the
goals compare against the best of them); specpool with K = 0; specpool at each fixed
K; specpool with the adaptive policy. Per row: tokens/s (median of --repeats runs), time to first token,
inter-token latency p50/p99, acceptance α, mean accepted length, the cost ratio c = t_draft / t_target, the
analytic speedup (1 - α^(K+1)) / ((1 - α)(Kc + 1)) and efficiency = measured speedup / analytic speedup, and
wire bytes per round in greedy-draft and sampled-draft mode against shipping the draft's full probability
vectors.

Then a concurrency sweep over 1, 2, 4, 8, 16 streams (benchmarks/concurrency.py; each stream runs through the
prompt set once, stream j starting at prompt j): aggregate tokens/s of specpool adaptive with request batching
on (the config's draft/target max_batch_size), adaptive with batching off (max_batch_size 1, a fresh
service), K = 0 with batching on, and transformers generate() of the target over the same prompts as
left-padded batches of n (greedy, in process, interleaved with the two batching-on rows while their service is up
and idle); target (and draft) forward passes per generated token from the
workers' batch_stats(); ratios batching on / off, n streams / 1 stream, adaptive / K = 0 and adaptive /
transformers batched, against their goals.

    python -m benchmarks.speedup --sweep-only --quick --concurrency 1,2   # a smoke run

Then the overlap rows (benchmarks/overlap.py): in turn against overlapped at each K, K = 0 and adaptive, each
with the breakdown of a round's wall time, on the demo pair and on the heavy pair (tools/heavy_pair.py), the
transformers rows measured again among them, interleaved repeat by repeat: the goals' ratios come from there.

Then prompt lookup (benchmarks/lookup.py; `python -m benchmarks.lookup` runs it alone): draft.method model, ngram
and model+ngram against transformers prompt lookup and generate(), on an input-grounded workload and this set.

Then prefix caching (benchmarks/prefix.py; `python -m benchmarks.prefix` runs it alone): prompts sharing a preamble
the prefix caches hold, against the same behind a first line new for every request, and transformers generate(),
on both pairs.

Writes results.json, results.md, concurrency.png (and, without --sweep-only, speedup.png and adaptive.png)
under --out (benchmarks/report.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")   # Ray forks while gRPC threads run; keep that quiet

import torch

from benchmarks.concurrency import (HF_BATCHED, OFF_ADAPTIVE, ON_ADAPTIVE, ON_K0, batching_config, goal_lines,
                                    hf_batched_sampler, specpool_sweep, sweep_ratios)
from benchmarks.lookup import lookup_section
from benchmarks.prefix import PREFIX_TOKENS, prefix_section
from benchmarks.plan import QUICK, BenchConfig
from benchmarks.report import write_outputs
from benchmarks.overlap import heavy_config, heavy_section, overlap_section
from benchmarks.service import load_service_config, running, running_data
from benchmarks.single_stream import single_stream


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=BenchConfig.config)
    parser.add_argument("--out", default=BenchConfig.out)
    parser.add_argument("--max-new-tokens", type=int, help=f"default {BenchConfig.max_new_tokens}")
    parser.add_argument("--repeats", type=int, help=f"default {BenchConfig.repeats}")
    parser.add_argument("--lookup-repeats", type=int, help=f"of the prompt-lookup rows (default "
                        f"{BenchConfig.lookup_repeats})")
    parser.add_argument("--concurrency", type=lambda text: tuple(int(n) for n in text.split(",")),
                        help="stream counts of the sweep, e.g. 1,2,4 (default 1,2,4,8,16)")
    parser.add_argument("--sweep-only", action="store_true", help="only the concurrency sweep")
    parser.add_argument("--heavy-layers", type=int, help="zero-output layers of the heavy pair (0: skip it; default "
                        f"{BenchConfig.heavy_layers})")
    parser.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK} unless given")
    args = vars(parser.parse_args(argv))
    chosen = {key: value for key, value in args.items() if value is not None and key != "quick"}
    return BenchConfig(**{**(QUICK if args["quick"] else {}), **chosen})


def run(cfg: BenchConfig) -> tuple[dict, dict | None]:
    """Everything, services one after another: batching on (single-stream rows; adaptive, K=0 and transformers
    batched sweeps, interleaved), batching off (adaptive sweep)."""
    results, trace, sweep = {"bench": dataclasses.asdict(cfg), "batching": {}}, None, {}
    with running(cfg.config, batching=True) as service:
        if not cfg.sweep_only:
            results["single"], trace = single_stream(service, cfg)
            results["overlap"] = overlap_section(service, cfg)
            results["lookup"] = lookup_section(service, cfg)
            results["prefix"] = {"demo pair": prefix_section(service, cfg, PREFIX_TOKENS)}
        hf_batched = hf_batched_sampler(cfg, service.service.pools.target_info["model_path"])
        sweep.update(specpool_sweep(service, cfg, {ON_ADAPTIVE: None, ON_K0: 0, HF_BATCHED: hf_batched}))
        results["batching"]["on"] = batching_config(service)
    with running(cfg.config, batching=False) as service:
        sweep.update(specpool_sweep(service, cfg, {OFF_ADAPTIVE: None}))
        results["batching"]["off"] = batching_config(service)
    if cfg.heavy_layers and not cfg.sweep_only:
        results["heavy"] = heavy_section(load_service_config(cfg.config), cfg, cfg.heavy_layers)
        with running_data(heavy_config(load_service_config(cfg.config), cfg.heavy_layers), label="the heavy pair") \
                as service:
            results["prefix"]["heavy pair"] = prefix_section(service, cfg, PREFIX_TOKENS)
    results.update(sweep=sweep, ratios=sweep_ratios(sweep))
    results["goals"] = goal_lines(results["ratios"])
    return results, trace


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    torch.set_num_threads(1)
    try:
        results, trace = run(cfg)
    finally:
        from router.launch import disconnect
        disconnect()        # the local Ray instance the services started, with its agents
    write_outputs(results, trace, Path(cfg.out))


if __name__ == "__main__":
    main()
