"""specpool against plain decoding and Hugging Face assisted generation, side by side in one run.

    python -m benchmarks.speedup --config deploy/local.yaml --out benchmarks/results

Rows (same pair, prompts and greedy sampling): transformers generate() of the target alone;
transformers assisted generation with the same K; specpool with K = 0; specpool at each fixed K;
specpool with the adaptive policy. Per row: tokens/s (median of --repeats runs), time to first
token, inter-token latency p50/p99, acceptance α, mean accepted length, the cost ratio
c = t_draft / t_target, the analytic speedup (1 - α^(K+1)) / ((1 - α)(Kc + 1)) and
efficiency = measured speedup / analytic speedup, and wire bytes per round in greedy-draft and
sampled-draft mode against shipping the draft's full probability vectors.

Then a concurrency sweep over 1, 2, 4, 8, 16 streams (each stream runs through the prompt set once,
stream j starting at prompt j): aggregate tokens/s of specpool adaptive with request batching on (the
config's draft/target max_batch_size), adaptive with batching off (max_batch_size 1, a fresh service),
K = 0 with batching on, and transformers generate() of the target over the same prompts as left-padded
batches of n (greedy, in process); target (and draft) forward passes per generated token from the
workers' batch_stats(); ratios batching on / off, n streams / 1 stream, adaptive / K = 0 and adaptive /
transformers batched, against their goals.

    python -m benchmarks.speedup --sweep-only --quick --concurrency 1,2   # a smoke run

Writes results.json, results.md, concurrency.png (and, without --sweep-only, speedup.png and
adaptive.png) under --out.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import statistics
import threading
import time
import multiprocessing
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
import yaml

from protos.specpool.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc
from settings.schema import config_from_dict, with_model_paths_from

PREDICTABLE = ["def __init__(self, *args, **kwargs):\n        super().__init__(",
               "import os\nimport sys\n\n\ndef main():\n    parser = argparse.",
               "    for i in range(len(self.items)):\n        if self.items[i] is None:\n"]
UNPREDICTABLE = ["Quartz jackdaws vex my big sphinx; 7 zebras", "xq9 #Lr! vZ2 @@ 1k7 ;;p", "The weather in Oslo"]
QUICK = {"max_new_tokens": 16, "repeats": 1, "ks": (2, 4)}   # --quick, for smoke runs
ON_ADAPTIVE, OFF_ADAPTIVE = "specpool adaptive, batching on", "specpool adaptive, batching off"
ON_K0, HF_BATCHED = "specpool K=0, batching on", "transformers generate(), batched"
GOALS = {"scaling": 3.0, "adaptive / K=0": 0.95, "adaptive / transformers batched": 0.95}
GOAL_STREAMS = 8      # the scaling goal: aggregate tokens/s at 8 streams >= 3x that of 1 stream


@dataclass
class BenchConfig:
    config: str = "deploy/local.yaml"
    out: str = "benchmarks/results"
    max_new_tokens: int = 96
    repeats: int = 3
    ks: tuple = (1, 2, 4, 6, 8)
    concurrency: tuple = (1, 2, 4, 8, 16)
    prompts: list = field(default_factory=lambda: PREDICTABLE + UNPREDICTABLE)
    sweep_only: bool = False          # skip the single-stream rows (transformers, K, wire, trace)


def log(message: str) -> None:
    print(f"[bench] {message}", flush=True)


def analytic_speedup(alpha: float, k: int, c: float) -> float:
    """Expected speedup of speculative decoding over the target alone (Leviathan et al. 2023)."""
    if k == 0:
        return 1.0
    tokens = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (k * c + 1)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


# ---- transformers baselines -------------------------------------------------------------------
def load_hf(path: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    return AutoModelForCausalLM.from_pretrained(path).eval(), tokenizer


class TokenClock:
    """A generate() streamer that stamps each put() of new tokens (the first put() is the prompt), so
    transformers rows get time to first token and inter-token latency like the specpool rows."""

    def __init__(self):
        self.started, self.arrivals = time.perf_counter(), []

    def put(self, value) -> None:
        self.arrivals.append((time.perf_counter(), value.numel()))

    def end(self) -> None:
        pass

    def run(self) -> dict:
        """{"ttft", "itl"} in stream_one's format."""
        times = [t for t, _ in self.arrivals[1:]]
        gaps = [(b - a) / n for (a, _), (b, n) in zip(self.arrivals[1:], self.arrivals[2:]) for _ in range(n)]
        return {"ttft": times[0] - self.started if times else 0.0, "itl": gaps}


@torch.inference_mode()
def hf_run(target, tokenizer, batches, max_new: int, assistant=None, k: int = 0,
           clocks: list | None = None) -> tuple[float, int]:
    """(seconds, new tokens) of generate() over batches of prompts (left-padded), greedy; assisted
    (batches of one prompt only) when `assistant` is given. With `clocks` (batches of one prompt), a
    TokenClock per generate() is appended to it."""
    kwargs = {}
    if assistant is not None:
        assistant.generation_config.num_assistant_tokens = k
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        assistant.generation_config.assistant_confidence_threshold = 0.0
        kwargs["assistant_model"] = assistant
    started, tokens = time.perf_counter(), 0
    for batch in batches:
        inputs = tokenizer(batch, return_tensors="pt", padding=True)
        if clocks is not None:
            clocks.append(TokenClock())
            kwargs["streamer"] = clocks[-1]
        out = target.generate(**inputs, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, **kwargs)
        tokens += out[:, inputs.input_ids.shape[1]:].numel()
    return time.perf_counter() - started, tokens


@torch.inference_mode()
def forward_seconds(model, context: int = 64, steps: int = 20) -> float:
    """Median time of one single-token decoding step with a KV cache of `context` tokens."""
    from transformers import DynamicCache
    cache = DynamicCache(config=model.config)
    model(torch.zeros(1, context, dtype=torch.long), past_key_values=cache, use_cache=True)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        model(torch.zeros(1, 1, dtype=torch.long), past_key_values=cache, use_cache=True)
        times.append(time.perf_counter() - started)
        cache.crop(-1)
    return statistics.median(times)


# ---- specpool rows ----------------------------------------------------------------------------
def stream_one(stub, prompt: str, max_new: int, k: int | None, temperature: float = 0.0) -> dict:
    request = generation_pb2.GenerateRequest(prompt=prompt, max_new_tokens=max_new)
    request.sampling.temperature = temperature
    if temperature:
        request.sampling.seed = 1
    if k is not None:
        request.speculation.k = k
    started, arrivals, chunks = time.perf_counter(), [], []
    for chunk in stub.GenerateStream(request):
        arrivals.append(time.perf_counter())
        chunks.append(chunk)
    stats = chunks[-1].stats
    gaps = [(b - a) / len(c.token_ids) for a, b, c in zip(arrivals, arrivals[1:], chunks[1:]) for _ in c.token_ids]
    return {"seconds": arrivals[-1] - started, "tokens": sum(len(c.token_ids) for c in chunks),
            "ttft": arrivals[0] - started, "itl": gaps, "draft": stats.draft_tokens,
            "accepted": stats.accepted_tokens, "rounds": stats.target_passes, "wire": stats.wire_bytes,
            "k_per_round": list(stats.k_per_round), "accepted_per_round": [len(c.token_ids) - 1 for c in chunks]}


def latencies(runs: list[dict]) -> dict:
    """Median time to first token and inter-token latency p50 / p99 (ms) over runs with "ttft" and "itl"."""
    itl = [g for r in runs for g in r["itl"]]
    return {"ttft_ms": 1e3 * statistics.median(r["ttft"] for r in runs),
            "itl_p50_ms": 1e3 * percentile(itl, 0.5), "itl_p99_ms": 1e3 * percentile(itl, 0.99)}


def specpool_row(stub, cfg: BenchConfig, k: int | None) -> dict:
    runs = [[stream_one(stub, p, cfg.max_new_tokens, k) for p in cfg.prompts] for _ in range(cfg.repeats)]
    flat = [r for run in runs for r in run]
    rates = [sum(r["tokens"] for r in run) / sum(r["seconds"] for r in run) for run in runs]
    draft, accepted, rounds = (sum(r[key] for r in flat) for key in ("draft", "accepted", "rounds"))
    return {"tokens_per_s": statistics.median(rates), **latencies(flat),
            "alpha": accepted / draft if draft else 0.0,
            "mean_accepted_len": sum(r["tokens"] for r in flat) / rounds,
            "wire_bytes_per_round": sum(r["wire"] for r in flat) / rounds,
            "mean_k": draft / rounds}


def wire_sampled(service, cfg: BenchConfig, k: int) -> float:
    """Wire bytes per round in sampled-draft mode (hot-reloaded for the measurement)."""
    config = service.data
    sampled = {**config, "speculation": {**(config.get("speculation") or {}), "draft_sampling": "sampled"}}
    service.admin.Reload(admin_pb2.ReloadRequest(config_yaml=yaml.safe_dump(sampled)))
    try:
        runs = [service.client(stream_one, p, cfg.max_new_tokens, k, 1.0) for p in cfg.prompts]
    finally:
        service.admin.Reload(admin_pb2.ReloadRequest(config_yaml=yaml.safe_dump(config)))
    return sum(r["wire"] for r in runs) / sum(r["rounds"] for r in runs)


# ---- concurrency sweep ------------------------------------------------------------------------
def stream_prompts(cfg: BenchConfig, j: int) -> list[str]:
    """Stream j's prompts: the prompt set from prompt j on, so that concurrent requests differ."""
    j %= len(cfg.prompts)
    return cfg.prompts[j:] + cfg.prompts[:j]


def run_streams(stub, cfg: BenchConfig, n: int, k: int | None) -> tuple[int, float]:
    """(tokens, seconds) of n concurrent streams, each running through its prompts once."""
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


def sweep_level(service, cfg: BenchConfig, n: int, k: int | None) -> dict:
    """Medians over repeats of aggregate tokens/s, forward passes per generated token and mean batch
    (rows per forward pass) of each pool."""
    samples = []
    for _ in range(cfg.repeats):
        before = batch_stats(service.service.pools)
        tokens, seconds = service.client(run_streams, cfg, n, k)
        after = batch_stats(service.service.pools)
        sample = {"tokens_per_s": tokens / seconds}
        for pool in after:
            passes, rows = (now - then for now, then in zip(after[pool], before[pool]))
            sample[f"{pool}_passes_per_token"] = passes / tokens
            sample[f"{pool}_mean_batch"] = rows / max(1, passes)
        samples.append(sample)
    return {key: statistics.median(sample[key] for sample in samples) for key in samples[0]}


def specpool_sweep(service, cfg: BenchConfig, name: str, k: int | None) -> dict:
    result = {}
    for n in cfg.concurrency:
        result[n] = level = sweep_level(service, cfg, n, k)
        log(f"{name}, {n} stream(s): {level['tokens_per_s']:.1f} tokens/s, {level['target_passes_per_token']:.3f} "
            f"target passes/token, mean target batch {level['target_mean_batch']:.2f}")
    return result


def hf_batched_sweep(cfg: BenchConfig, model_path: str) -> dict:
    """transformers generate() of the target over the sweep's prompts, as left-padded batches of n."""
    target, tokenizer = load_hf(model_path)
    hf_run(target, tokenizer, [cfg.prompts[:2]], 4)     # warm-up
    result = {}
    for n in cfg.concurrency:
        batches = [[stream_prompts(cfg, j)[i] for j in range(n)] for i in range(len(cfg.prompts))]
        rates = [tokens / seconds for seconds, tokens in
                 (hf_run(target, tokenizer, batches, cfg.max_new_tokens) for _ in range(cfg.repeats))]
        result[n] = {"tokens_per_s": statistics.median(rates)}
        log(f"{HF_BATCHED}, {n} stream(s): {result[n]['tokens_per_s']:.1f} tokens/s")
    return result


def sweep_ratios(sweep: dict) -> dict:
    """Per stream count: batching on / off, adaptive / K=0, adaptive / transformers batched; and each
    variant's aggregate tokens/s over its own at the fewest streams ("scaling")."""
    def ratio(a: str, b: str) -> dict:
        return {n: sweep[a][n]["tokens_per_s"] / sweep[b][n]["tokens_per_s"] for n in sweep[a]}

    def scaling(variant: dict) -> dict:
        return {n: level["tokens_per_s"] / variant[min(variant)]["tokens_per_s"] for n, level in variant.items()}
    return {"batching on / off": ratio(ON_ADAPTIVE, OFF_ADAPTIVE), "adaptive / K=0": ratio(ON_ADAPTIVE, ON_K0),
            "adaptive / transformers batched": ratio(ON_ADAPTIVE, HF_BATCHED),
            "scaling": {name: scaling(variant) for name, variant in sweep.items()}}


def verdict(name: str, ratios: dict, goal: float | None = None) -> str:
    """One line of ratios per stream count, e.g. "name: 1: 1.20x, 2: 0.90x (goal >= 0.95x: missed at 2 streams)"."""
    text = f"{name}: " + ", ".join(f"{n}: {r:.2f}x" for n, r in ratios.items())
    if goal is None:
        return text
    missed = [str(n) for n, r in ratios.items() if r < goal]
    return text + f" (goal >= {goal:g}x: " + (f"missed at {', '.join(missed)} streams)" if missed else "met)")


def goal_lines(ratios: dict) -> list[str]:
    scaling = ratios["scaling"][ON_ADAPTIVE]
    lines = [verdict(f"{ON_ADAPTIVE}, n streams / {min(scaling)}", scaling)]
    if min(scaling) == 1 and GOAL_STREAMS in scaling:
        lines.append(verdict(f"{GOAL_STREAMS} streams / 1 stream ({ON_ADAPTIVE})",
                             {GOAL_STREAMS: scaling[GOAL_STREAMS]}, GOALS["scaling"]))
    lines.append(verdict("batching on / off (specpool adaptive)", ratios["batching on / off"]))
    return lines + [verdict(f"specpool {key}", ratios[key], GOALS[key])
                    for key in ("adaptive / K=0", "adaptive / transformers batched")]


# ---- the run ----------------------------------------------------------------------------------
_STUBS: dict = {}


def client_call(address: str, fn, *args):
    """fn(stub, *args) in the client process, over one channel per address."""
    if address not in _STUBS:
        _STUBS[address] = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(address))
    return fn(_STUBS[address], *args)


class InProcessService:
    """specpool serve on a background event loop, as the tests run it, from a config dict. The timed
    requests come from a separate client process (client()), as real clients do, so that client threads
    never compete with the router for this process's GIL."""

    def __init__(self, data: dict):
        from router.service import Service
        self.data = data
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.service = asyncio.run_coroutine_threadsafe(Service(config_from_dict(data)).start(), self.loop).result()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.service.port}")
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.admin = admin_pb2_grpc.AdminStub(self.channel)
        self.clients = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        self.client(stream_one, PREDICTABLE[0], 8, None)   # warm-up, so that no row pays for first calls

    def client(self, fn, *args):
        """fn(stub, *args) run in the client process against this service."""
        return self.clients.submit(client_call, f"127.0.0.1:{self.service.port}", fn, *args).result()

    def stop(self) -> None:
        self.clients.shutdown()
        self.channel.close()
        asyncio.run_coroutine_threadsafe(self.service.stop(1.0), self.loop).result()


@contextlib.contextmanager
def running(cfg: BenchConfig, batching: bool):
    """A fresh specpool from --config on any free port (batching off: max_batch_size 1 for the draft
    and the target), stopped (its actors killed) on exit; Ray stays up for the next one."""
    data = with_model_paths_from(yaml.safe_load(Path(cfg.config).read_text()) or {}, Path(cfg.config).parent)
    data["router"] = {**(data.get("router") or {}), "port": 0}
    if not batching:
        data.update({pool: {**(data.get(pool) or {}), "max_batch_size": 1} for pool in ("draft", "target")})
    log(f"starting specpool from {cfg.config}, batching {'on' if batching else 'off'}")
    service = InProcessService(data)
    try:
        yield service
    finally:
        service.stop()


def batching_config(service) -> dict:
    return {pool: {"max_batch_size": getattr(service.service.config, pool).max_batch_size,
                   "batch_wait_ms": getattr(service.service.config, pool).batch_wait_ms}
            for pool in ("draft", "target")}


def hf_rows(service, cfg: BenchConfig) -> tuple[dict, float]:
    from engine.model_pair import resolve_model
    target, tokenizer = load_hf(service.service.pools.target_info["model_path"])
    draft, _ = load_hf(resolve_model(service.service.config.draft.model))
    c = forward_seconds(draft) / forward_seconds(target)
    log(f"cost ratio c = t_draft / t_target = {c:.3f}")
    rows = {}
    for name, assistant, k in [("transformers generate()", None, 0)] + [
            (f"transformers assisted K={k}", draft, k) for k in cfg.ks]:
        rates, clocks = [], []
        for _ in range(cfg.repeats):
            seconds, tokens = hf_run(target, tokenizer, [[p] for p in cfg.prompts], cfg.max_new_tokens, assistant, k,
                                     clocks)
            rates.append(tokens / seconds)
        rows[name] = {"tokens_per_s": statistics.median(rates), "k": k, **latencies([c.run() for c in clocks])}
        log(f"{name}: {rows[name]['tokens_per_s']:.1f} tokens/s")
    return rows, c


def specpool_rows(service, cfg: BenchConfig, c: float, base: float, vocab: int) -> dict:
    rows = {}
    for k in (0, *cfg.ks, None):
        name = f"specpool K={k}" if k is not None else "specpool adaptive"
        row = service.client(specpool_row, cfg, k)
        kk = k if k is not None else row["mean_k"]
        row.update(k=kk, speedup=row["tokens_per_s"] / base,
                   analytic=analytic_speedup(row["alpha"], round(kk), c) if kk else 1.0)
        row["efficiency"] = row["speedup"] / row["analytic"]
        row["full_probs_bytes_per_round"] = round(kk) * vocab * 4
        rows[name] = row
        log(f"{name}: {row['tokens_per_s']:.1f} tokens/s, alpha {row['alpha']:.2f}, "
            f"speedup {row['speedup']:.2f} (analytic {row['analytic']:.2f})")
    return rows


def adaptive_trace(stub, cfg: BenchConfig) -> dict:
    k, accepted = [], []
    for prompt in PREDICTABLE + UNPREDICTABLE + PREDICTABLE:
        run = stream_one(stub, prompt, cfg.max_new_tokens, None)
        k += run["k_per_round"]
        accepted += run["accepted_per_round"]
    return {"k": k, "accepted": accepted}


def single_stream(service, cfg: BenchConfig) -> tuple[dict, dict]:
    """The single-stream rows (transformers, specpool at each K and adaptive), wire bytes, the K trace."""
    rows, c = hf_rows(service, cfg)
    base = rows["transformers generate()"]["tokens_per_s"]
    rows.update(specpool_rows(service, cfg, c, base, service.service.pools.target_info["vocab_size"]))
    single = {"c": c, "rows": rows, "sampled_k": 4, "wire_sampled": wire_sampled(service, cfg, 4)}
    return single, service.client(adaptive_trace, cfg)


def run(cfg: BenchConfig) -> tuple[dict, dict | None]:
    """Everything, services one after another: batching on (single-stream rows, adaptive and K=0
    sweeps), batching off (adaptive sweep), then transformers batched with no service running."""
    results, trace, sweep = {"bench": dataclasses.asdict(cfg), "batching": {}}, None, {}
    with running(cfg, batching=True) as service:
        if not cfg.sweep_only:
            results["single"], trace = single_stream(service, cfg)
        sweep[ON_ADAPTIVE] = specpool_sweep(service, cfg, ON_ADAPTIVE, None)
        sweep[ON_K0] = specpool_sweep(service, cfg, ON_K0, 0)
        results["batching"]["on"] = batching_config(service)
        model_path = service.service.pools.target_info["model_path"]
    with running(cfg, batching=False) as service:
        sweep[OFF_ADAPTIVE] = specpool_sweep(service, cfg, OFF_ADAPTIVE, None)
        results["batching"]["off"] = batching_config(service)
    sweep[HF_BATCHED] = hf_batched_sweep(cfg, model_path)
    results.update(sweep=sweep, ratios=sweep_ratios(sweep))
    results["goals"] = goal_lines(results["ratios"])
    return results, trace


# ---- reporting --------------------------------------------------------------------------------
def single_markdown(single: dict) -> str:
    header = ("| row | tokens/s | TTFT ms | ITL p50 / p99 ms | α | tokens/round | analytic | efficiency "
              "| wire B/round (greedy) | full q B/round |\n|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for name, r in single["rows"].items():
        head = (f"| {name} | {r['tokens_per_s']:.1f} | {r['ttft_ms']:.1f} | {r['itl_p50_ms']:.1f} / "
                f"{r['itl_p99_ms']:.1f} |")
        if "alpha" not in r:
            lines.append(head + " | | | | | |")
            continue
        lines.append(head + f" {r['alpha']:.2f} | {r['mean_accepted_len']:.2f} | "
                     f"{r['analytic']:.2f} | {r['efficiency']:.2f} | {r['wire_bytes_per_round']:.0f} | "
                     f"{r['full_probs_bytes_per_round']} |")
    return (header + "\n".join(lines) + f"\n\nc = t_draft / t_target = {single['c']:.3f}; sampled-draft wire "
            f"bytes per round at K={single['sampled_k']}: {single['wire_sampled']:.0f}\n\n")


def sweep_markdown(results: dict) -> str:
    sweep, ratios, names = results["sweep"], results["ratios"], (ON_ADAPTIVE, OFF_ADAPTIVE, ON_K0, HF_BATCHED)
    keys = ("batching on / off", "adaptive / K=0", "adaptive / transformers batched")
    lines = ["| streams | " + " | ".join(f"{name} tokens/s" for name in names) + " | " + " | ".join(keys)
             + " | target passes/token (adaptive on / off / K=0) | mean target batch (adaptive on / off / K=0) |",
             "|---" * (len(names) + len(keys) + 3) + "|"]
    for n in sweep[ON_ADAPTIVE]:
        lines.append(f"| {n} | " + " | ".join(f"{sweep[name][n]['tokens_per_s']:.1f}" for name in names) + " | "
                     + " | ".join(f"{ratios[key][n]:.2f}" for key in keys) + " | "
                     + " / ".join(f"{sweep[name][n]['target_passes_per_token']:.3f}" for name in names[:3]) + " | "
                     + " / ".join(f"{sweep[name][n]['target_mean_batch']:.2f}" for name in names[:3]) + " |")
    return ("\n".join(lines) + "\n\n" + "\n".join(f"- {line}" for line in results["goals"])
            + f"\n\nbatching config: {json.dumps(results['batching'])}\n")


def markdown(results: dict) -> str:
    return (single_markdown(results["single"]) if "single" in results else "") + sweep_markdown(results)


def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def concurrency_plot(sweep: dict, out: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, variant in sweep.items():
        ax.plot(list(variant), [level["tokens_per_s"] for level in variant.values()], "o-", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(sweep[ON_ADAPTIVE]), [str(n) for n in sweep[ON_ADAPTIVE]])
    ax.set(xlabel="concurrent streams", ylabel="aggregate tokens/s", title="specpool throughput vs concurrency")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "concurrency.png", dpi=120)


def plots(single: dict, adaptive_trace: dict, out: Path) -> None:
    plt = pyplot()
    rows = {n: r for n, r in single["rows"].items() if n.startswith("specpool K=")}
    ks = [r["k"] for r in rows.values()]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ks, [r["speedup"] for r in rows.values()], "o-", label="measured")
    ax.plot(ks, [r["analytic"] for r in rows.values()], "s--", label="analytic (measured α, c)")
    ax.set(xlabel="K", ylabel="speedup over transformers generate()", title="specpool speedup vs K")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=120)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    top.step(range(len(adaptive_trace["k"])), adaptive_trace["k"], where="post")
    top.set(ylabel="K")
    accepted = adaptive_trace["accepted"]
    window = 8
    rolling = [sum(accepted[max(0, i - window):i + 1]) / max(1, sum(adaptive_trace["k"][max(0, i - window):i + 1]))
               for i in range(len(accepted))]
    bottom.plot(rolling)
    bottom.set(xlabel="round", ylabel=f"acceptance (rolling {window})")
    top.set_title("adaptive K over predictable → unpredictable → predictable prompts")
    fig.tight_layout()
    fig.savefig(out / "adaptive.png", dpi=120)


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=BenchConfig.config)
    parser.add_argument("--out", default=BenchConfig.out)
    parser.add_argument("--max-new-tokens", type=int, help=f"default {BenchConfig.max_new_tokens}")
    parser.add_argument("--repeats", type=int, help=f"default {BenchConfig.repeats}")
    parser.add_argument("--concurrency", type=lambda text: tuple(int(n) for n in text.split(",")),
                        help="stream counts of the sweep, e.g. 1,2,4 (default 1,2,4,8,16)")
    parser.add_argument("--sweep-only", action="store_true", help="only the concurrency sweep")
    parser.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK} unless given")
    args = vars(parser.parse_args(argv))
    chosen = {key: value for key, value in args.items() if value is not None and key != "quick"}
    return BenchConfig(**{**(QUICK if args["quick"] else {}), **chosen})


def write_outputs(results: dict, trace: dict | None, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "results.md").write_text(markdown(results))
    concurrency_plot(results["sweep"], out)
    if trace is not None:
        plots(results["single"], trace, out)
    print(markdown(results))


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    torch.set_num_threads(1)
    try:
        results, trace = run(cfg)
    finally:
        import ray
        ray.shutdown()      # the local Ray instance the services started, with its agents
    write_outputs(results, trace, Path(cfg.out))


if __name__ == "__main__":
    main()
