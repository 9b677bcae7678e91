"""Per-round traces of the running system, for checking the K controller's cost model against what rounds
really cost: each round's K, accepted drafts, source, RoundTimings, wall time by part (Round.parts) and whether
its drafts were pre-drafted, at fixed K with overlap on and off. Rows are interleaved (every (K, overlap) once,
then every one again) so that a shared machine's drift falls on every row alike.

    python -m benchmarks.k_trace --ks 0 1 2 4 6 8 --repeats 3 --out /tmp/k_trace.json

tests/test_controller.py replays traces of this shape against the controller (see `replay` there).
"""
from __future__ import annotations

import argparse
import json

from benchmarks.overlap import set_speculation
from benchmarks.plan import PREDICTABLE, UNPREDICTABLE
from benchmarks.service import log, recorded, running, stream_one


def record_rows(service, prompts: list[str], ks: list, max_new: int, repeats: int) -> dict:
    """{"K=k overlap on|off": {"rounds": [...], "tokens": n, "seconds": s}} over `repeats` interleaved passes;
    k None is the adaptive policy."""
    rows: dict = {}
    with recorded(service.service.router.k_selector) as rounds:
        for repeat in range(repeats):
            for k in ks:
                for overlap in (False, True):
                    name = f"K={'adaptive' if k is None else k} overlap {'on' if overlap else 'off'}"
                    set_speculation(service, overlap=overlap)
                    row = rows.setdefault(name, {"k": k, "overlap": overlap, "rounds": [], "runs": []})
                    for prompt in prompts:
                        rounds.clear()
                        run = service.client(stream_one, prompt, max_new, k)
                        row["rounds"] += rounds
                        row["runs"].append({"tokens": run["tokens"], "seconds": run["seconds"]})
            log(f"repeat {repeat + 1}/{repeats}: " + ", ".join(
                f"{name} {sum(r['tokens'] for r in row['runs']) / sum(r['seconds'] for r in row['runs']):.0f}"
                for name, row in rows.items()))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="deploy/local.yaml")
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 4, 6, 8])
    parser.add_argument("--adaptive", action="store_true", help="also record the adaptive policy")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--out", default="benchmarks/results/k_trace.json")
    args = parser.parse_args(argv)
    ks = [*args.ks, *([None] if args.adaptive else [])]
    with running(args.config) as service:
        rows = record_rows(service, PREDICTABLE + UNPREDICTABLE, ks, args.max_new_tokens, args.repeats)
    with open(args.out, "w") as f:
        json.dump(rows, f)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
