"""How much the draft's work slows the target's pass when both share this machine's two cores.

Overlap pre-drafts while the target verifies. On separate GPUs that work is free; here the draft worker drafts on
the other core of the same 2-core machine, and the target's pass slows down beside it (shared caches, memory and
the host's scheduling of the VM's cores). This times the heavy pair's target pass in this process, 1 and K + 1
tokens over a KV cache, alone and then beside a neighbour process that drafts with the draft model as a
pre-draft with branches does (a batch of rows, one torch thread), phase after phase, interleaved. The slowdown
is what an overlapped round pays here that it would not on separate hardware; the README's heavy-pair verdict
uses it.

    python -m benchmarks.contention            # about 2 minutes
"""
from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time

NEIGHBOUR_ROWS = 9          # a pre-draft's own row and its rejection branches, drafted as one batch
SETTLE_S = 5.0              # the neighbour loads its model before a "beside" phase is timed


def neighbour(draft_path: str, stop) -> None:
    """Draft steps with `draft_path`, NEIGHBOUR_ROWS rows at a time, one thread, until `stop` is set."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(draft_path).eval()
    rows = torch.randint(0, model.config.vocab_size, (NEIGHBOUR_ROWS, 48))
    with torch.inference_mode():
        while not stop.is_set():
            model(rows)


def phase_ms(model, lengths: tuple, steps: int) -> list[float]:
    """Median ms of the target's pass over each of `lengths` new tokens (100 tokens of cache)."""
    import torch
    from benchmarks.hf_baseline import forward_seconds
    with torch.inference_mode():
        return [1e3 * forward_seconds(model, 100, steps, tokens) for tokens in lengths]


def measure(phases: int, k: int, extra_layers: int) -> dict:
    """{"alone": [[ms per length] per phase], "beside": ...}, phases interleaved."""
    import torch
    from transformers import AutoModelForCausalLM
    from tools.heavy_pair import ensure_heavy_pair
    torch.set_num_threads(1)
    draft, target = ensure_heavy_pair(extra_layers)
    model, lengths = AutoModelForCausalLM.from_pretrained(target).eval(), (1, k + 1)
    context, runs = multiprocessing.get_context("spawn"), {"alone": [], "beside": []}
    for phase in range(phases):
        runs["alone"].append(phase_ms(model, lengths, 20))
        stop = context.Event()
        worker = context.Process(target=neighbour, args=(str(draft), stop), daemon=True)
        worker.start()
        time.sleep(SETTLE_S)
        runs["beside"].append(phase_ms(model, lengths, 20))
        stop.set()
        worker.join()
        print(f"[contention] phase {phase + 1}/{phases}: alone {runs['alone'][-1]}, beside {runs['beside'][-1]}",
              flush=True)
    return {"lengths": lengths, **runs}


def report(runs: dict) -> str:
    """A markdown table: per pass length, median ms alone and beside, and the median per-phase slowdown with its
    range."""
    lines = ["| target pass | alone ms | beside a drafting neighbour ms | slowdown (range over phases) |",
             "|---|---|---|---|"]
    for i, tokens in enumerate(runs["lengths"]):
        alone, beside = [p[i] for p in runs["alone"]], [p[i] for p in runs["beside"]]
        ratios = [b / a for a, b in zip(alone, beside)]
        lines.append(f"| {tokens} token{'s' * (tokens > 1)} | {statistics.median(alone):.1f} | "
                     f"{statistics.median(beside):.1f} | {statistics.median(ratios):.2f}× "
                     f"({min(ratios):.2f}–{max(ratios):.2f}) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phases", type=int, default=5)
    parser.add_argument("--k", type=int, default=8, help="drafts per verify pass (the pass is K + 1 tokens)")
    parser.add_argument("--heavy-layers", type=int, default=40)
    args = parser.parse_args()
    print(report(measure(args.phases, args.k, args.heavy_layers)))


if __name__ == "__main__":
    main()
