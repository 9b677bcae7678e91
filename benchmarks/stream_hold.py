"""Held answers under load: speculation.answer_delay_max_ms at its default (40: a streamed run's answers are held
up to answer_delay_ms x the target's rows per forward, at most 40 ms) against 10 (= answer_delay_ms: no growth),
at 1, 4 and 16 concurrent streams, K = 0 and adaptive, hot-reloaded on one service, repeats interleaved. Prints
each repeat, then per row the median tokens/s and the paired ratio with its range.

    python -m benchmarks.stream_hold                  # the local default (the demo pair), 3 repeats
    python -m benchmarks.stream_hold --streams 8,16 --repeats 5
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics

from benchmarks.concurrency import run_streams
from benchmarks.overlap import as_configured, set_speculation
from benchmarks.plan import BenchConfig
from benchmarks.repeats import paired
from benchmarks.service import log, running

CAPS = (10, 40)       # answer_delay_max_ms: no growth (the default answer_delay_ms), the default cap


def one_repeat(service, cfg: BenchConfig, streams: list[int], runs: dict) -> None:
    """Every (streams, K, cap) row once, appending its aggregate tokens/s to runs[row]."""
    configured = as_configured(service)
    for n in streams:
        for k in (0, None):
            for cap in CAPS:
                set_speculation(service, **configured, answer_delay_max_ms=cap)
                tokens, seconds = service.client(run_streams, cfg, n, k)
                runs.setdefault((n, k, cap), []).append(tokens / seconds)


def report(runs: dict, streams: list[int]) -> None:
    for n in streams:
        for k in (0, None):
            held, flat = ({"rates": runs[(n, k, cap)]} for cap in reversed(CAPS))
            ratio, low, high = paired(held, flat)
            print(f"{n} stream(s), {'adaptive' if k is None else f'K={k}'}: held up to {CAPS[1]} ms "
                  f"{statistics.median(held['rates']):.1f} tokens/s, {CAPS[0]} ms {statistics.median(flat['rates']):.1f}; "
                  f"ratio {ratio:.2f} ({low:.2f}-{high:.2f} over {len(flat['rates'])} repeats)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=BenchConfig.config)
    parser.add_argument("--streams", default="1,4,16")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cfg, streams, runs = dataclasses.replace(BenchConfig(), config=args.config), \
        [int(n) for n in args.streams.split(",")], {}
    with running(cfg.config) as service:
        for repeat in range(args.repeats):
            one_repeat(service, cfg, streams, runs)
            log(f"repeat {repeat + 1}/{args.repeats}: " + ", ".join(
                f"{n}/{'adaptive' if k is None else k}/{cap} ms {v[-1]:.0f}" for (n, k, cap), v in runs.items()))
    report(runs, streams)


if __name__ == "__main__":
    main()
