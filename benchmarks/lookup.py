"""Prompt lookup (draft.method ngram) against the draft model, both together, transformers prompt lookup and
plain generate(), side by side on two workloads, greedy, one request at a time:

- input-grounded: the pair continues a Python file it has already seen part of. Each prompt is a seed P, the
  target's own greedy continuation of P (the file as this pair writes it), blank lines, and P again, so its
  output repeats spans of the prompt (as far as a 2M-parameter model copies: it does only partly);
- the benchmark's usual prompt set (3 Python snippets, 3 unrelated strings: benchmarks/plan.py).

Rows: transformers generate(); transformers generate(prompt_lookup_num_tokens=draft.ngram_max_tokens,
max_matching_ngram_size=draft.ngram_max); specpool adaptive with draft.method model, ngram and model+ngram
(hot-reloaded on one service, which has a draft pool). Repeats are interleaved (every row once, then every row
again, the specpool rows in reverse order every other repeat) so that the machine's drift falls on every row alike; tokens/s is the median over repeats, and a goal's
ratio the median of the two rows' ratios repeat by repeat (with their range).

    python -m benchmarks.lookup --config deploy/local.yaml --out benchmarks/results   # this section alone
    python -m benchmarks.speedup ...                                                   # includes it
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics

from benchmarks.hf_baseline import hf_run, load_hf
from benchmarks.plan import PREDICTABLE, BenchConfig
from benchmarks.repeats import best, paired
from benchmarks.overlap import heavy_config
from benchmarks.sections import write_sections
from benchmarks.service import (load_service_config, log, reload_section, running, running_data, stream_one,
                                whole_one)
from protos.specpool.v1 import generation_pb2

SEEDS = PREDICTABLE + ["class Node:\n    def __init__(self, name, value=None):\n",
                       "def read_config(path, defaults=None):\n    result = dict(defaults or {})\n",
                       "    def __repr__(self):\n        return "]
METHODS = ("model", "ngram", "model+ngram")
NGRAM_WHOLE = "ngram, read whole"    # unary Generate requests (the other rows stream)
HF_PLAIN, HF_LOOKUP = "transformers generate()", "transformers prompt lookup"
NGRAM = generation_pb2.PROPOSAL_SOURCE_NGRAM


def grounded_prompts(target, tokenizer, file_tokens: int) -> list[str]:
    """Per seed P: P + the target's greedy continuation of it (`file_tokens` tokens) + blank lines + P."""
    prompts = []
    for seed in SEEDS:
        ids = tokenizer(seed, return_tensors="pt").input_ids
        out = target.generate(ids, max_new_tokens=file_tokens, do_sample=False)
        prompts.append(seed + tokenizer.decode(out[0, ids.shape[1]:]) + "\n\n\n" + seed)
    return prompts


def set_method(service, method: str) -> None:
    """Hot-reload draft.method on the running service."""
    reload_section(service, "draft", method=method)


def specpool_run(stub, prompts: list[str], max_new: int, call=stream_one) -> dict:
    """One pass over the prompts at the adaptive policy (in the client process), each request streamed
    (stream_one) or read whole (whole_one)."""
    runs = [call(stub, p, max_new, None) for p in prompts]
    total = {key: sum(r[key] for r in runs) for key in ("tokens", "seconds", "draft", "accepted", "rounds")}
    total["ngram_rounds"] = sum(r["sources"].count(NGRAM) for r in runs)
    return total


def row_summary(runs: list[dict]) -> dict:
    """Median tokens/s over repeats (and each repeat's: "rates"); acceptance, tokens per round and the share of
    n-gram rounds over all."""
    rates = [r["tokens"] / r["seconds"] for r in runs]
    out = {"tokens_per_s": statistics.median(rates), "rates": rates}
    if "rounds" in runs[0]:
        total = {key: sum(r[key] for r in runs) for key in runs[0]}
        out.update(alpha=total["accepted"] / max(total["draft"], 1), tokens_per_round=total["tokens"] / total["rounds"],
                   ngram_share=total["ngram_rounds"] / total["rounds"])
    return out


def workload(service, cfg: BenchConfig, prompts: list[str], hf) -> dict:
    """Every row on `prompts`, repeats interleaved."""
    target, tokenizer, lookup = hf
    batches = [[p] for p in prompts]
    runs = {name: [] for name in (HF_PLAIN, HF_LOOKUP, *METHODS, NGRAM_WHOLE)}
    for repeat in range(cfg.lookup_repeats):
        for name, extra in ((HF_PLAIN, {}), (HF_LOOKUP, lookup)):
            seconds, tokens = hf_run(target, tokenizer, batches, cfg.max_new_tokens, **extra)
            runs[name].append({"tokens": tokens, "seconds": seconds})
        rows = [(m, m, stream_one) for m in METHODS] + [(NGRAM_WHOLE, "ngram", whole_one)]
        for name, method, call in rows if repeat % 2 == 0 else rows[::-1]:   # no row always after the same one
            set_method(service, method)
            runs[name].append(service.client(specpool_run, prompts, cfg.max_new_tokens, call))
        log(f"repeat {repeat + 1}: " + ", ".join(f"{n} {r[-1]['tokens'] / r[-1]['seconds']:.0f}"
                                                   for n, r in runs.items()))
    set_method(service, "model")
    return {name: row_summary(r) for name, r in runs.items()}


def lookup_cost(service, contexts: list[list[int]]) -> dict:
    """Where prompt lookup runs: its cost per drafted token (engine.ngram timed here over the contexts, growing
    token by token as a request's does; the same code runs in the router and in the target), against a draft
    call's round trip (the draft model controller's estimates), seconds."""
    import time

    from engine.ngram import NgramIndex
    from router.request_state import MODEL
    draft, seconds, drafted = service.service.config.draft, 0.0, 0
    for context in contexts:
        index, grown = NgramIndex(draft.ngram_min, draft.ngram_max), []
        started = time.perf_counter()
        for token in context:
            grown.append(token)
            drafted += len(index.propose(grown, draft.ngram_max_tokens))
        seconds += time.perf_counter() - started
    model = service.service.router.k_selector.pools[(MODEL, "greedy")].costs()
    return {"lookup_s_per_token": seconds / max(drafted, 1), "draft_rtt_s": model["rtt_draft"],
            "draft_s_per_token": model["t_draft"]}


def goal_line(name: str, row: dict, against: dict) -> str:
    """One goal's verdict: row / against (repeats.paired: the median of their ratios repeat by repeat, with
    their range) against its mark of 1.0."""
    ratio, lowest, highest = paired(row, against)
    spread = f", {lowest:.2f}-{highest:.2f} over {len(row['rates'])} repeats" if len(row["rates"]) > 1 else ""
    return f"{name} = {ratio:.2f} (goal >= 1.0: {'met' if ratio >= 1.0 else 'missed'}{spread})"


def goals(section: dict) -> list[str]:
    grounded, usual = section["grounded"], section["usual"]
    lines = [goal_line(f"{name} / transformers prompt lookup (input-grounded)", grounded[row], grounded[HF_LOOKUP])
             for name, row in (("ngram", "ngram"), ("ngram read whole", NGRAM_WHOLE))]
    for name, rows in (("input-grounded", grounded), ("usual prompts", usual)):
        lines.append(goal_line(f"model+ngram / better of model and ngram ({name})", rows["model+ngram"],
                               best([rows["model"], rows["ngram"]])))
    return lines


def lookup_section(service, cfg: BenchConfig) -> dict:
    """Both workloads, the lookup cost figures and the goal verdicts."""
    target, tokenizer = load_hf(service.service.pools.target_info["model_path"])
    draft = service.service.config.draft
    lookup = {"prompt_lookup_num_tokens": draft.ngram_max_tokens, "max_matching_ngram_size": draft.ngram_max}
    hf = (target, tokenizer, {"generate_kwargs": lookup})
    grounded = grounded_prompts(target, tokenizer, cfg.max_new_tokens)
    section = {"grounded": workload(service, cfg, grounded, hf), "usual": workload(service, cfg, cfg.prompts, hf),
               "cost": lookup_cost(service, [tokenizer(p).input_ids for p in grounded])}
    section["goals"] = goals(section)
    return section


def markdown(section: dict) -> str:
    lines = ["| row | input-grounded tokens/s | α | tokens/round | n-gram rounds | usual tokens/s | α | tokens/round "
             "| n-gram rounds |", "|---|---|---|---|---|---|---|---|---|"]
    for name in section["grounded"]:
        cells = []
        for r in (section["grounded"][name], section["usual"][name]):
            cells += [f"{r['tokens_per_s']:.1f}", *((f"{r['alpha']:.2f}", f"{r['tokens_per_round']:.2f}",
                                                     f"{100 * r['ngram_share']:.0f} %") if "alpha" in r else ("",) * 3)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    cost = section["cost"]
    lines.append(f"\nPrompt lookup: {1e6 * cost['lookup_s_per_token']:.2f} µs per drafted token; a draft "
                 f"call's round trip: {1e3 * cost['draft_rtt_s']:.2f} ms (+ {1e3 * cost['draft_s_per_token']:.2f} ms "
                 "of draft compute per token)\n")
    return "\n".join(lines) + "\n" + "\n".join(f"- {line}" for line in section["goals"]) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=BenchConfig.config)
    parser.add_argument("--out", default=BenchConfig.out)
    parser.add_argument("--max-new-tokens", type=int, default=BenchConfig.max_new_tokens)
    parser.add_argument("--repeats", type=int, default=BenchConfig.lookup_repeats)
    parser.add_argument("--heavy-layers", type=int, default=0, help="also on the heavy pair with this many "
                        "zero-output layers (tools/heavy_pair.py; its usual set: the Python snippets only)")
    args = parser.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    cfg = BenchConfig(config=args.config, out=args.out, max_new_tokens=args.max_new_tokens,
                      lookup_repeats=args.repeats)
    sections = {}
    try:
        with running(cfg.config) as service:
            sections["demo pair"] = lookup_section(service, cfg)
        if args.heavy_layers:
            heavy = heavy_config(load_service_config(cfg.config), args.heavy_layers)
            with running_data(heavy, label="the heavy pair") as service:
                sections["heavy pair"] = lookup_section(service, dataclasses.replace(cfg, prompts=PREDICTABLE))
    finally:
        import ray
        ray.shutdown()
    write_sections(cfg, "lookup", sections, markdown)


if __name__ == "__main__":
    main()
