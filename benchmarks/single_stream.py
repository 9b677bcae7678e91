"""The single-stream rows, one request at a time over the prompt set: transformers generate() and assisted
generation at each K, specpool at K = 0, each fixed K and adaptive (tokens/s, TTFT, ITL, α, tokens per round,
analytic speedup and efficiency, wire bytes per round), sampled-draft wire bytes, and the adaptive K trace
over predictable -> unpredictable -> predictable prompts.

    python -m benchmarks.speedup --quick --concurrency 1   # these rows at K 2 and 4, then a one-level sweep
"""
from __future__ import annotations

import statistics

import torch
import yaml

from benchmarks.hf_baseline import forward_seconds, hf_run, load_hf
from benchmarks.plan import PREDICTABLE, UNPREDICTABLE, BenchConfig
from benchmarks.service import log, recorded, stream_one
from protos.specpool.v1 import admin_pb2

BASE_ROW = "transformers generate()"
SAMPLED_K = 4         # K of the sampled-draft wire measurement
HF_THREADS = (1, 2)   # torch threads of the transformers rows: the goals compare against the best of them


def analytic_speedup(alpha: float, k: int, c: float) -> float:
    """Expected speedup of speculative decoding over the target alone (Leviathan et al. 2023)."""
    if k == 0:
        return 1.0
    tokens = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (k * c + 1)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def latencies(runs: list[dict]) -> dict:
    """Median time to first token, inter-token latency p50 / p99 and the p99 of the client's waits between
    messages (ms) over runs with "ttft", "itl" and "waits"."""
    itl, waits = [g for r in runs for g in r["itl"]], [w for r in runs for w in r["waits"]]
    return {"ttft_ms": 1e3 * statistics.median(r["ttft"] for r in runs),
            "itl_p50_ms": 1e3 * percentile(itl, 0.5), "itl_p99_ms": 1e3 * percentile(itl, 0.99),
            "wait_p99_ms": 1e3 * percentile(waits, 0.99)}


# ---- transformers rows ------------------------------------------------------------------------
def hf_row(target, tokenizer, assistant, k: int, cfg: BenchConfig) -> dict:
    """Median tokens/s over repeats of generate() (assisted at K = k with `assistant`), one prompt at a time."""
    rates, clocks = [], []
    for _ in range(cfg.repeats):
        seconds, tokens = hf_run(target, tokenizer, [[p] for p in cfg.prompts], cfg.max_new_tokens, assistant, k,
                                 clocks)
        rates.append(tokens / seconds)
    return {"tokens_per_s": statistics.median(rates), "k": k, **latencies([c.run() for c in clocks])}


def hf_plan(service, cfg: BenchConfig) -> tuple[list, float]:
    """The transformers rows of the service's pair, each as (name, measure): measure(cfg) runs hf_row at its
    torch thread count (HF_THREADS; rows at more than one named "..., N threads"), so that a caller may run
    them in turn or interleave them with its own rows; and c = t_draft / t_target (one thread, as the workers
    run). The assistant runs beside the target, as assisted generation runs; where the draft pool is on another
    device (a CPU draft beside a GPU target), assisted rows with the assistant there too ("..., draft on cpu")."""
    config = service.service.config
    target, tokenizer = load_hf(service.service.pools.target_info["model_path"], config.target.device,
                                config.target.dtype)
    places, draft = assistants(config, target, tokenizer)
    plan = [(name if count == 1 else f"{name}, {count} threads", at_threads(count, hf_row, target, tokenizer,
                                                                              assistant, k))
            for count in HF_THREADS for name, assistant, k in [(BASE_ROW, None, 0)] + [
                (f"transformers assisted K={k}{suffix}", assistant, k) for assistant, suffix in places for k in cfg.ks]]
    c = at_threads(1, lambda: forward_seconds(draft) / forward_seconds(target))()      # the draft where its pool is
    log(f"cost ratio c = t_draft / t_target = {c:.3f}")
    return plan, c


def draft_path(config) -> str:
    from engine.model_pair import resolve_model
    return resolve_model(config.draft.model)


def assistants(config, target, tokenizer) -> tuple[list[tuple], object]:
    """([(assistant, its rows' name suffix)], the draft on its pool's device): the draft on the target's device,
    and also on the draft pool's where that differs and transformers can run it there (5.17 cannot: its
    min_new_tokens processor meets the assistant's device; the row is then left out, saying why)."""
    path = draft_path(config)
    beside = load_hf(path, config.target.device, config.target.dtype)[0]
    if (config.draft.device, config.draft.dtype) == (config.target.device, config.target.dtype):
        return [(beside, "")], beside
    pooled = load_hf(path, config.draft.device, config.draft.dtype)[0]
    suffix = f", draft on {config.draft.device}"
    elsewhere = config.draft.device != config.target.device and runs_assisted(target, tokenizer, pooled, suffix)
    return [(beside, "")] + ([(pooled, suffix)] if elsewhere else []), pooled


def runs_assisted(target, tokenizer, assistant, suffix: str) -> bool:
    try:
        hf_run(target, tokenizer, [["def"]], 4, assistant, 2)
        return True
    except RuntimeError as error:
        log(f"transformers assisted{suffix} left out: {str(error)[:160]}")
        return False


def at_threads(count: int, measure, *args):
    """measure(*args, *more) run with `count` torch threads (the process's count restored after)."""
    def run(*more):
        threads = torch.get_num_threads()
        torch.set_num_threads(count)
        try:
            return measure(*args, *more)
        finally:
            torch.set_num_threads(threads)
    return run


def hf_rows(service, cfg: BenchConfig) -> tuple[dict, float]:
    """The transformers rows (hf_plan), each measured over cfg.repeats in turn, and c."""
    plan, c = hf_plan(service, cfg)
    rows = {}
    for name, measure in plan:
        rows[name] = measure(cfg)
        log(f"{name}: {rows[name]['tokens_per_s']:.1f} tokens/s")
    return rows, c


# ---- specpool rows ----------------------------------------------------------------------------
def specpool_row(stub, cfg: BenchConfig, k: int | None, call=stream_one) -> dict:
    """One specpool row at K = k (None: adaptive), measured in the client process: each request a GenerateStream
    (stream_one), or a Generate read whole (whole_one)."""
    runs = [[call(stub, p, cfg.max_new_tokens, k) for p in cfg.prompts] for _ in range(cfg.repeats)]
    flat = [r for run in runs for r in run]
    rates = [sum(r["tokens"] for r in run) / sum(r["seconds"] for r in run) for run in runs]
    draft, accepted, rounds = (sum(r[key] for r in flat) for key in ("draft", "accepted", "rounds"))
    return {"tokens_per_s": statistics.median(rates), **latencies(flat),
            "alpha": accepted / draft if draft else 0.0,
            "mean_accepted_len": sum(r["tokens"] for r in flat) / rounds,
            "wire_bytes_per_round": sum(r["wire"] for r in flat) / rounds,
            "mean_k": draft / rounds, "predraft_hits": sum(r["predraft_hits"] for r in flat),
            "staged": sum(r["staged"] for r in flat)}


def with_model_terms(row: dict, k: int | None, c: float, base: float, vocab: int) -> dict:
    """`row` with its K (the mean K when adaptive), speedup over `base` tokens/s, analytic speedup,
    efficiency and the bytes per round of shipping the draft's full probability vectors."""
    kk = k if k is not None else row["mean_k"]
    row.update(k=kk, speedup=row["tokens_per_s"] / base,
               analytic=analytic_speedup(row["alpha"], round(kk), c) if kk else 1.0)
    row["efficiency"] = row["speedup"] / row["analytic"]
    row["full_probs_bytes_per_round"] = round(kk) * vocab * 4
    return row


def specpool_rows(service, cfg: BenchConfig, c: float, base: float, vocab: int) -> dict:
    """specpool at K = 0, each of cfg.ks and adaptive."""
    rows = {}
    for k in (0, *cfg.ks, None):
        name = f"specpool K={k}" if k is not None else "specpool adaptive"
        rows[name] = row = with_model_terms(service.client(specpool_row, cfg, k), k, c, base, vocab)
        log(f"{name}: {row['tokens_per_s']:.1f} tokens/s, alpha {row['alpha']:.2f}, "
            f"speedup {row['speedup']:.2f} (analytic {row['analytic']:.2f})")
    return rows


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


def adaptive_trace(service, cfg: BenchConfig) -> dict:
    """K and accepted drafts of every round of the adaptive policy over predictable, unpredictable, predictable
    prompts, as the router's K selector observed them (a decode run's steps are rounds at K = 0)."""
    with recorded(service.service.router.k_selector) as rounds:
        for prompt in PREDICTABLE + UNPREDICTABLE + PREDICTABLE:
            service.client(stream_one, prompt, cfg.max_new_tokens, None)
    return {"k": [r["k"] for r in rounds], "accepted": [r["accepted"] for r in rounds]}


def single_stream(service, cfg: BenchConfig) -> tuple[dict, dict]:
    """The single-stream rows (transformers, specpool at each K and adaptive), wire bytes, the K trace."""
    transformers, c = hf_rows(service, cfg)
    base = transformers[BASE_ROW]["tokens_per_s"]
    rows = {**transformers, **specpool_rows(service, cfg, c, base, service.service.pools.target_info["vocab_size"])}
    single = {"c": c, "rows": rows, "sampled_k": SAMPLED_K, "wire_sampled": wire_sampled(service, cfg, SAMPLED_K)}
    return single, adaptive_trace(service, cfg)
