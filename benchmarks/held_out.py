"""Issue #11's own check, as a new user would make it: the demo pair, one stream, greedy, on Python prompts that are
not in the benchmark's prompt set (nor among prompt lookup's seeds), specpool's adaptive policy and K = 0 against
the best transformers row over K and torch threads, side by side in one service.

The goals' ratios in `make bench` are measured on the benchmark's own prompt set (benchmarks/plan.py), which the
defaults were tuned on over many sessions. This runs the same rows (pair_rows: every row once, then every row
again, the transformers rows among them; a ratio is the median of the two rows' ratios repeat by repeat) on prompts
nobody tuned on, so that a goal met there but missed here shows.

    python -m benchmarks.held_out                      # 3 repeats, 96 new tokens: about 5 minutes here
    python -m benchmarks.held_out --repeats 5 --out benchmarks/results
"""
from __future__ import annotations

import argparse
import dataclasses

from benchmarks.overlap import READ_WHOLE, best_transformers, measured_section, pair_rows
from benchmarks.plan import BenchConfig
from benchmarks.repeats import paired
from benchmarks.report import overlap_markdown
from benchmarks.sections import write_sections
from benchmarks.service import running

HELD_OUT = ["def load(path):\n    with open(path, encoding=\"utf-8\") as handle:\n        ",
            "class Counter:\n    \"\"\"Count hashable items.\"\"\"\n\n    def __init__(self, iterable=None):\n",
            "try:\n    import json\nexcept ImportError:\n    ",
            "if __name__ == \"__main__\":\n    import sys\n    ",
            "    for key, value in sorted(self.items()):\n        if ",
            "def _check_arg(name, value, allowed):\n    if value not in allowed:\n        raise "]
ROWS = (("in turn K=0", 0, False), ("in turn adaptive", None, False), ("overlap adaptive", None, True),
        ("in turn K=0" + READ_WHOLE, 0, False), ("overlap adaptive" + READ_WHOLE, None, True))
GOALS = {"adaptive / best assisted": ("overlap adaptive", "assisted"),
         "in-turn adaptive / best assisted": ("in turn adaptive", "assisted"),
         "adaptive read whole / best assisted": ("overlap adaptive" + READ_WHOLE, "assisted"),
         "K=0 / generate()": ("in turn K=0", "generate"),
         "K=0 read whole / generate()": ("in turn K=0" + READ_WHOLE, "generate")}


def plan(configured: dict, cfg: BenchConfig) -> list[tuple[str, int | None, dict]]:
    """pair_rows' specpool rows: K = 0 and the adaptive policy, streamed and read whole."""
    return [(name, k, {**configured, "overlap": overlap}) for name, k, overlap in ROWS]


def held_out_section(service, cfg: BenchConfig) -> dict:
    """The transformers rows and ROWS on HELD_OUT, interleaved, and the goals' ratios with their ranges."""
    transformers, rows, c = pair_rows(service, dataclasses.replace(cfg, prompts=HELD_OUT), plan)
    assisted, generate = best_transformers(transformers)
    against = {"assisted": assisted, "generate": generate}
    measured = {key: paired(rows[name], against[which]) for key, (name, which) in GOALS.items()}
    return measured_section(c, transformers, rows, measured, prompts=HELD_OUT)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=BenchConfig.config)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--max-new-tokens", type=int, default=BenchConfig.max_new_tokens)
    parser.add_argument("--repeats", type=int, default=BenchConfig.repeats)
    args = parser.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    cfg = BenchConfig(config=args.config, out=args.out, max_new_tokens=args.max_new_tokens, repeats=args.repeats)
    try:
        with running(cfg.config) as service:
            section = held_out_section(service, cfg)
    finally:
        import ray
        ray.shutdown()
    write_sections(cfg, "held_out", {"demo pair, held-out prompts": section},
                   lambda s: overlap_markdown("Held-out Python prompts", s))


if __name__ == "__main__":
    main()
