"""Rows measured in interleaved repeats (every row once, then every row again), as the overlap and prompt-lookup
sections run them: one row from its repeats, and the ratio of two rows repeat by repeat. Each repeat's pair
of rows ran minutes apart at most, so the machine's drift cancels in their ratio; the median of those ratios,
with their range, is what a goal's verdict reads.

    python -m benchmarks.speedup --quick   # the sections that use these
"""
from __future__ import annotations

import statistics


def combine(repeats: list[dict], parts: tuple = ()) -> dict:
    """One row from its repeats: median tokens/s (and each repeat's, "rates"), the mean of every other number
    and of each of the `parts`' ms ("parts_ms", where the repeats have it)."""
    row = {key: statistics.mean(r[key] for r in repeats) for key, value in repeats[0].items()
           if isinstance(value, (int, float))}
    row["rates"] = [r["tokens_per_s"] for r in repeats]
    row["tokens_per_s"] = statistics.median(row["rates"])
    if "parts_ms" in repeats[0]:
        row["parts_ms"] = {part: statistics.mean(r["parts_ms"][part] for r in repeats) for part in parts}
    return row


def paired(row: dict, against: dict) -> tuple[float, float, float]:
    """(median, lowest, highest) of row / against repeat by repeat, from their "rates"."""
    ratios = sorted(a / b for a, b in zip(row["rates"], against["rates"]))
    return statistics.median(ratios), ratios[0], ratios[-1]


def best(rows: list[dict]) -> dict:
    """The row of the highest median tokens/s."""
    return max(rows, key=lambda row: row["tokens_per_s"])
