"""specpool against plain decoding and Hugging Face assisted generation, side by side in one run.

    python -m benchmarks.speedup --config deploy/local.yaml --out benchmarks/results

Rows (same pair, prompts and greedy sampling): transformers generate() of the target alone;
transformers assisted generation with the same K; specpool with K = 0; specpool at each fixed K;
specpool with the adaptive policy. Per row: tokens/s (median of --repeats runs), time to first
token, inter-token latency p50/p99, acceptance α, mean accepted length, the cost ratio
c = t_draft / t_target, the analytic speedup (1 - α^(K+1)) / ((1 - α)(Kc + 1)) and
efficiency = measured speedup / analytic speedup, and wire bytes per round in greedy-draft and
sampled-draft mode against shipping the draft's full probability vectors. Then a concurrency sweep.
Writes results.json, results.md, speedup.png and adaptive.png under --out.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
import yaml

from protos.specpool.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc
from router.config import load_config

PREDICTABLE = ["def __init__(self, *args, **kwargs):\n        super().__init__(",
               "import os\nimport sys\n\n\ndef main():\n    parser = argparse.",
               "    for i in range(len(self.items)):\n        if self.items[i] is None:\n"]
UNPREDICTABLE = ["Quartz jackdaws vex my big sphinx; 7 zebras", "xq9 #Lr! vZ2 @@ 1k7 ;;p", "The weather in Oslo"]


@dataclass
class BenchConfig:
    config: str = "deploy/local.yaml"
    out: str = "benchmarks/results"
    max_new_tokens: int = 96
    repeats: int = 3
    ks: tuple = (1, 2, 4, 6, 8)
    concurrency: tuple = (1, 2, 4, 8)
    prompts: list = field(default_factory=lambda: PREDICTABLE + UNPREDICTABLE)


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
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


@torch.inference_mode()
def hf_run(target, tokenizer, prompts, max_new: int, assistant=None, k: int = 0) -> tuple[float, int]:
    """(seconds, new tokens) of generate() over all prompts, greedy; assisted when `assistant` is given."""
    kwargs = {}
    if assistant is not None:
        assistant.generation_config.num_assistant_tokens = k
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        assistant.generation_config.assistant_confidence_threshold = 0.0
        kwargs["assistant_model"] = assistant
    started, tokens = time.perf_counter(), 0
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = target.generate(ids, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, **kwargs)
        tokens += out.shape[1] - ids.shape[1]
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


def specpool_row(stub, cfg: BenchConfig, k: int | None) -> dict:
    runs = [[stream_one(stub, p, cfg.max_new_tokens, k) for p in cfg.prompts] for _ in range(cfg.repeats)]
    flat = [r for run in runs for r in run]
    rates = [sum(r["tokens"] for r in run) / sum(r["seconds"] for r in run) for run in runs]
    draft, accepted, rounds = (sum(r[key] for r in flat) for key in ("draft", "accepted", "rounds"))
    itl = [g for r in flat for g in r["itl"]]
    return {"tokens_per_s": statistics.median(rates), "ttft_ms": 1e3 * statistics.median(r["ttft"] for r in flat),
            "itl_p50_ms": 1e3 * percentile(itl, 0.5), "itl_p99_ms": 1e3 * percentile(itl, 0.99),
            "alpha": accepted / draft if draft else 0.0,
            "mean_accepted_len": sum(r["tokens"] for r in flat) / rounds,
            "wire_bytes_per_round": sum(r["wire"] for r in flat) / rounds,
            "mean_k": draft / rounds}


def wire_sampled(stub, admin, config: dict, cfg: BenchConfig, k: int) -> float:
    """Wire bytes per round in sampled-draft mode (hot-reloaded for the measurement)."""
    sampled = {**config, "speculation": {**config.get("speculation", {}), "draft_sampling": "sampled"}}
    admin.Reload(admin_pb2.ReloadRequest(config_yaml=yaml.safe_dump(sampled)))
    try:
        runs = [stream_one(stub, p, cfg.max_new_tokens, k, temperature=1.0) for p in cfg.prompts]
    finally:
        admin.Reload(admin_pb2.ReloadRequest(config_yaml=yaml.safe_dump(config)))
    return sum(r["wire"] for r in runs) / sum(r["rounds"] for r in runs)


def concurrency_sweep(stub, cfg: BenchConfig, k: int | None) -> dict:
    """Aggregate tokens/s with n concurrent streams, each running through the prompt set once."""
    result = {}
    for n in cfg.concurrency:
        with ThreadPoolExecutor(n) as pool:
            started = time.perf_counter()
            runs = list(pool.map(lambda i: [stream_one(stub, p, cfg.max_new_tokens, k) for p in cfg.prompts],
                                 range(n)))
            seconds = time.perf_counter() - started
        result[n] = sum(r["tokens"] for run in runs for r in run) / seconds
        log(f"concurrency {n}, k={k}: {result[n]:.1f} tokens/s")
    return result


# ---- the run ----------------------------------------------------------------------------------
class InProcessService:
    """specpool serve on a background event loop, as the tests run it."""

    def __init__(self, config_path: str):
        from router.cli import Service
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.service = asyncio.run_coroutine_threadsafe(Service(load_config(config_path)).start(), self.loop).result()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.service.port}")
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.admin = admin_pb2_grpc.AdminStub(self.channel)

    def stop(self) -> None:
        self.channel.close()
        asyncio.run_coroutine_threadsafe(self.service.stop(1.0), self.loop).result()


def hf_rows(service, cfg: BenchConfig) -> tuple[dict, float]:
    from target_worker.model_pair import resolve_model
    target, tokenizer = load_hf(service.service.pools.target_info["model_path"])
    draft, _ = load_hf(resolve_model(service.service.config.draft.model))
    c = forward_seconds(draft) / forward_seconds(target)
    log(f"cost ratio c = t_draft / t_target = {c:.3f}")
    rows = {}
    for name, assistant, k in [("transformers generate()", None, 0)] + [
            (f"transformers assisted K={k}", draft, k) for k in cfg.ks]:
        rates = []
        for _ in range(cfg.repeats):
            seconds, tokens = hf_run(target, tokenizer, cfg.prompts, cfg.max_new_tokens, assistant, k)
            rates.append(tokens / seconds)
        rows[name] = {"tokens_per_s": statistics.median(rates), "k": k}
        log(f"{name}: {rows[name]['tokens_per_s']:.1f} tokens/s")
    return rows, c


def specpool_rows(service, cfg: BenchConfig, c: float, base: float, vocab: int) -> dict:
    rows = {}
    for k in (0, *cfg.ks, None):
        name = f"specpool K={k}" if k is not None else "specpool adaptive"
        row = specpool_row(service.stub, cfg, k)
        kk = k if k is not None else row["mean_k"]
        row.update(k=kk, speedup=row["tokens_per_s"] / base,
                   analytic=analytic_speedup(row["alpha"], round(kk), c) if kk else 1.0)
        row["efficiency"] = row["speedup"] / row["analytic"]
        row["full_probs_bytes_per_round"] = round(kk) * vocab * 4
        rows[name] = row
        log(f"{name}: {row['tokens_per_s']:.1f} tokens/s, alpha {row['alpha']:.2f}, "
            f"speedup {row['speedup']:.2f} (analytic {row['analytic']:.2f})")
    return rows


def markdown(results: dict) -> str:
    header = ("| row | tokens/s | TTFT ms | ITL p50 / p99 ms | α | tokens/round | analytic | efficiency "
              "| wire B/round (greedy) | full q B/round |\n|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for name, r in results["rows"].items():
        if "alpha" not in r:
            lines.append(f"| {name} | {r['tokens_per_s']:.1f} | | | | | | | | |")
            continue
        lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {r['ttft_ms']:.1f} | {r['itl_p50_ms']:.1f} / "
                     f"{r['itl_p99_ms']:.1f} | {r['alpha']:.2f} | {r['mean_accepted_len']:.2f} | "
                     f"{r['analytic']:.2f} | {r['efficiency']:.2f} | {r['wire_bytes_per_round']:.0f} | "
                     f"{r['full_probs_bytes_per_round']} |")
    sweep = "\n".join(f"| {n} | {results['sweep']['off'][n]:.1f} | {results['sweep']['on'][n]:.1f} |"
                      for n in results["sweep"]["on"])
    return (header + "\n".join(lines) + f"\n\nc = t_draft / t_target = {results['c']:.3f}; sampled-draft wire "
            f"bytes per round at K={results['sampled_k']}: {results['wire_sampled']:.0f}\n\n"
            "| streams | tokens/s K=0 | tokens/s adaptive |\n|---|---|---|\n" + sweep + "\n")


def plots(results: dict, adaptive_trace: dict, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = {n: r for n, r in results["rows"].items() if n.startswith("specpool K=")}
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


def adaptive_trace(stub, cfg: BenchConfig) -> dict:
    k, accepted = [], []
    for prompt in PREDICTABLE + UNPREDICTABLE + PREDICTABLE:
        run = stream_one(stub, prompt, cfg.max_new_tokens, None)
        k += run["k_per_round"]
        accepted += run["accepted_per_round"]
    return {"k": k, "accepted": accepted}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=BenchConfig.config)
    parser.add_argument("--out", default=BenchConfig.out)
    parser.add_argument("--max-new-tokens", type=int, default=BenchConfig.max_new_tokens)
    parser.add_argument("--repeats", type=int, default=BenchConfig.repeats)
    args = parser.parse_args()
    cfg = BenchConfig(config=args.config, out=args.out, max_new_tokens=args.max_new_tokens, repeats=args.repeats)
    torch.set_num_threads(1)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    log(f"starting specpool from {cfg.config}")
    service = InProcessService(cfg.config)
    try:
        rows, c = hf_rows(service, cfg)
        base = rows["transformers generate()"]["tokens_per_s"]
        vocab = service.service.pools.target_info["vocab_size"]
        rows.update(specpool_rows(service, cfg, c, base, vocab))
        config = yaml.safe_load(Path(cfg.config).read_text())
        results = {"c": c, "rows": rows, "sampled_k": 4,
                   "wire_sampled": wire_sampled(service.stub, service.admin, config, cfg, 4),
                   "sweep": {"off": concurrency_sweep(service.stub, cfg, 0),
                             "on": concurrency_sweep(service.stub, cfg, None)}}
        trace = adaptive_trace(service.stub, cfg)
    finally:
        service.stop()
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "results.md").write_text(markdown(results))
    plots(results, trace, out)
    print(markdown(results))


if __name__ == "__main__":
    main()
