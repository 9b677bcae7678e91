"""Prefix caching: requests whose prompts share a long preamble (a system prompt, a file's header, few-shot
examples) against the same requests with nothing cached, greedy, one request at a time, on one service.

Each prompt is a preamble of about `--prefix-tokens` tokens (the start of a Python module) and then one of the
benchmark's Python snippets. Rows:

- "cached": the preamble as it is, which the workers' prefix caches hold after the first request (the warm-up);
- "not cached": the same prompt behind a first line that is new for every request (`# request 17`), so its first
  block, and so every block, misses: the same work as with the cache off, plus putting the blocks in;
- transformers generate() of the target alone on the "cached" prompts (it keeps no cache between calls).

Repeats are interleaved (each row once, then each again, the specpool rows in turn first); a figure is the median
over repeats, and a ratio the median of the two rows' ratios repeat by repeat (with their range). Time to first
token is the client's wait for the first streamed token (transformers: its streamer's first put after the prompt).

    python -m benchmarks.prefix --config deploy/local.yaml --out benchmarks/results [--heavy-layers 40]
"""
from __future__ import annotations

import itertools
import statistics

from benchmarks.hf_baseline import hf_run, load_hf
from benchmarks.overlap import heavy_config
from benchmarks.plan import PREDICTABLE, BenchConfig
from benchmarks.repeats import paired
from benchmarks.sections import pair_arguments, ratio_lines, write_sections
from benchmarks.service import load_service_config, log, running_data, stream_one

PREAMBLE_LINE = ("import {0}\nfrom {0}.core import {1}, {1}Error\n\n\nclass {1}Handler({1}):\n"
                 "    def __init__(self, name, value=None):\n        self.name = name\n        self.value = value\n\n")
MODULES = ("os", "json", "logging", "socket", "threading", "collections", "pathlib", "functools", "itertools", "re")
CACHED, NOT_CACHED, HF_ROW = "cached", "not cached", "transformers generate()"
PREFIX_TOKENS = 192     # the preamble's length, at least
NUMBERS = itertools.count(1)


def preamble(tokenizer, tokens: int) -> str:
    """The start of a Python module, at least `tokens` tokens long."""
    text = ""
    for module in itertools.cycle(MODULES):
        text += PREAMBLE_LINE.format(module, module.capitalize())
        if len(tokenizer(text).input_ids) >= tokens:
            return text


def specpool_pass(service, prompts: list[str], max_new: int, fresh: bool) -> dict:
    """Each prompt once (`fresh`: behind a first line no request had before): seconds, tokens, TTFTs, cached."""
    runs = [service.client(stream_one, f"# request {next(NUMBERS)}\n{p}" if fresh else p, max_new, None)
            for p in prompts]
    return {"seconds": sum(r["seconds"] for r in runs), "tokens": sum(r["tokens"] for r in runs),
            "ttft": [r["ttft"] for r in runs], "cached_tokens": [r["cached_prompt_tokens"] for r in runs]}


def hf_pass(hf, prompts: list[str], max_new: int) -> dict:
    target, tokenizer = hf
    clocks: list = []
    seconds, tokens = hf_run(target, tokenizer, [[p] for p in prompts], max_new, clocks=clocks)
    return {"seconds": seconds, "tokens": tokens, "ttft": [c.run()["ttft"] for c in clocks], "cached_tokens": []}


def summary(runs: list[dict]) -> dict:
    """Medians over repeats: tokens/s, time to first token (each repeat's median over its prompts), and the prompt
    tokens found cached per request; `rates` and `ttfts` per repeat, for paired ratios."""
    rates = [r["tokens"] / r["seconds"] for r in runs]
    ttfts = [statistics.median(r["ttft"]) for r in runs]
    cached = [c for r in runs for c in r["cached_tokens"]]
    return {"tokens_per_s": statistics.median(rates), "rates": rates, "ttft_s": statistics.median(ttfts),
            "ttfts": ttfts, "cached_tokens": statistics.median(cached) if cached else None}


def prefix_section(service, cfg: BenchConfig, prefix_tokens: int) -> dict:
    """The three rows on one service, repeats interleaved, and the ratios: cached over not cached (tokens/s, and
    time to first token the other way up), and cached over transformers."""
    hf = load_hf(service.service.pools.target_info["model_path"])
    head = preamble(hf[1], prefix_tokens)
    prompts = [head + snippet for snippet in PREDICTABLE]
    service.client(stream_one, head, 4, None)          # the warm-up: the preamble's blocks go in
    runs = {CACHED: [], NOT_CACHED: [], HF_ROW: []}
    for repeat in range(cfg.repeats):
        order = (CACHED, NOT_CACHED) if repeat % 2 == 0 else (NOT_CACHED, CACHED)
        for name in order:
            runs[name].append(specpool_pass(service, prompts, cfg.max_new_tokens, fresh=name == NOT_CACHED))
        runs[HF_ROW].append(hf_pass(hf, prompts, cfg.max_new_tokens))
        log(f"prefix repeat {repeat + 1}: " + ", ".join(
            f"{n} {r[-1]['tokens'] / r[-1]['seconds']:.0f} tokens/s, TTFT {1e3 * statistics.median(r[-1]['ttft']):.1f} ms"
            for n, r in runs.items()))
    rows = {name: summary(r) for name, r in runs.items()}
    return {"prompt_tokens": [len(hf[1](p).input_ids) for p in prompts], "rows": rows, "ratios": ratios(rows)}


def ratios(rows: dict) -> dict:
    """(median of per-repeat ratios, lowest, highest) for the figures the README quotes."""
    def inverted(row: dict) -> dict:                    # a time as a rate, so that paired() divides it the right way
        return {"rates": [1 / t for t in row["ttfts"]]}
    return {"tokens/s cached / not cached": paired(rows[CACHED], rows[NOT_CACHED]),
            "TTFT not cached / cached": paired(inverted(rows[CACHED]), inverted(rows[NOT_CACHED])),
            "tokens/s cached / transformers": paired(rows[CACHED], rows[HF_ROW]),
            "TTFT transformers / cached": paired(inverted(rows[CACHED]), inverted(rows[HF_ROW]))}


def markdown(section: dict) -> str:
    lengths = section["prompt_tokens"]
    lines = [f"Prompts of {min(lengths)}-{max(lengths)} tokens.\n",
             "| row | tokens/s | time to first token ms | prompt tokens found cached (median) |", "|---|---|---|---|"]
    for name, row in section["rows"].items():
        cached = "" if row["cached_tokens"] is None else f"{row['cached_tokens']:.0f}"
        lines.append(f"| {name} | {row['tokens_per_s']:.1f} | {1e3 * row['ttft_s']:.1f} | {cached} |")
    lines.append("")
    lines += ratio_lines(section["ratios"])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = pair_arguments(__doc__.splitlines()[0], max_new_tokens=32, repeats=5)
    parser.add_argument("--prefix-tokens", type=int, default=PREFIX_TOKENS, help="the preamble's length, at least")
    args = parser.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    cfg = BenchConfig(config=args.config, out=args.out, max_new_tokens=args.max_new_tokens, repeats=args.repeats)
    sections = {}
    try:
        data = load_service_config(cfg.config)
        with running_data(data, label=cfg.config) as service:
            sections["demo pair"] = prefix_section(service, cfg, args.prefix_tokens)
        if args.heavy_layers:
            with running_data(heavy_config(data, args.heavy_layers), label="the heavy pair") as service:
                sections["heavy pair"] = prefix_section(service, cfg, args.prefix_tokens)
    finally:
        import ray
        ray.shutdown()
    write_sections(cfg, "prefix", sections, markdown)


if __name__ == "__main__":
    main()
