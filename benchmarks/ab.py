"""Overlapped rounds as configured against the same rounds with some speculation settings changed, side by side in
one service (the heavy pair by default), repeats interleaved row by row (every other repeat each pair of rows the
other way round: a fixed-K row leaves the pool's statistics to the adaptive row after it, so each adaptive row
follows a fixed-K row every other repeat): tokens/s (median, and the median of the
per-repeat ratios), the pre-draft hits and staged rounds per round, and a round's time beyond compute (ms), part by
part. make bench's overlap section has such rows among its others ("..., not staged", "..., one guess per
position"); this is one A/B alone, quicker.

    python -m benchmarks.ab --against overlap_branch_guesses=1 --repeats 7 --heavy-layers 40
    python -m benchmarks.ab --against stage_predrafts=false
    python -m benchmarks.ab --against hand_off=true --in-turn --heavy-layers 0 --k 4
"""
from __future__ import annotations

import argparse
import statistics

import yaml

from benchmarks.overlap import heavy_config, hop_ms, measured_row
from benchmarks.plan import PREDICTABLE, BenchConfig
from benchmarks.service import load_service_config, log, running_data
from settings.schema import SpeculationConfig


def plan(k: int, configured: dict, against: dict, overlap: bool = True) -> list[tuple[str, int | None, dict]]:
    """(row, K or None for adaptive, speculation settings): each K as configured, then with `against`. Every row
    sets each key it compares (a reload keeps the settings of the row before)."""
    config = SpeculationConfig(**configured)
    variant = ", " + ", ".join(f"{key}={value}" for key, value in against.items())
    base = {key: getattr(config, key) for key in against}
    mode = "overlap" if overlap else "in turn"
    return [(f"{mode} {name}{suffix}", kk, {"overlap": overlap, **(against if suffix else base)})
            for name, kk in ((f"K={k}", k), ("adaptive", None)) for suffix in ("", variant)]


def swapped(rows: list) -> list:
    """The rows with each pair (as configured, with the settings changed) the other way round."""
    return [row for pair in zip(rows[1::2], rows[::2]) for row in pair]


def summary(name: str, rows: list[dict]) -> str:
    parts = {part: statistics.mean(row["parts_ms"][part] for row in rows) for part in rows[0]["parts_ms"]}
    return (f"{name}: {statistics.median(row['tokens_per_s'] for row in rows):.1f} tokens/s, "
            f"TTFT {statistics.median(row['ttft_ms'] for row in rows):.1f} ms, "
            f"{statistics.mean(row['mean_accepted_len'] for row in rows):.2f} tokens/round, "
            f"{statistics.mean(row['hits'] for row in rows):.2f} hits/round, "
            f"{statistics.mean(row['staged'] for row in rows):.2f} staged/round, "
            f"{hop_ms({'parts_ms': parts}):.2f} ms/round beyond compute ("
            + " / ".join(f"{part} {ms:.2f}" for part, ms in parts.items()) + ")")


def setting(text: str) -> tuple[str, object]:
    """speculation key=value, the value read as YAML (false, 1, 0.5)."""
    key, _, value = text.partition("=")
    return key, yaml.safe_load(value)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", type=setting, action="append", required=True,
                        help="a speculation setting to change, key=value (repeatable)")
    parser.add_argument("--config", default="deploy/local.yaml")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--heavy-layers", type=int, default=40, help="0: the config's own pair")
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--in-turn", action="store_true", help="rows with speculation.overlap false")
    args = parser.parse_args(argv)
    data = load_service_config(args.config)
    data = heavy_config(data, args.heavy_layers) if args.heavy_layers else data
    cfg, rows = BenchConfig(prompts=PREDICTABLE, repeats=1), plan(args.k, data.get("speculation") or {},
                                                                   dict(args.against), not args.in_turn)
    runs: dict[str, list[dict]] = {name: [] for name, *_ in rows}
    with running_data(data) as service:
        for repeat in range(args.repeats):
            for name, k, speculation in rows if repeat % 2 == 0 else swapped(rows):
                runs[name].append(measured_row(service, cfg, k, speculation))
            log(f"repeat {repeat + 1}/{args.repeats}: "
                + ", ".join(f"{name} {runs[name][-1]['tokens_per_s']:.1f}" for name in runs) + " tokens/s")
    for name, measured in runs.items():
        print(summary(name, measured))
    for (name, *_), (variant, *_) in zip(rows[::2], rows[1::2]):
        ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs[name], runs[variant])]
        ttfts = [b["ttft_ms"] / a["ttft_ms"] for a, b in zip(runs[name], runs[variant])]
        print(f"{name} against{variant[len(name) + 1:]}: tokens/s {statistics.median(ratios):.3f} (per repeat: "
              + ", ".join(f"{r:.2f}" for r in ratios) + f"); TTFT, theirs / this: {statistics.median(ttfts):.3f} "
              "(per repeat: " + ", ".join(f"{r:.2f}" for r in ttfts) + ")")


if __name__ == "__main__":
    main()
