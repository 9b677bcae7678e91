"""The target's engine in a process of its own (`target.engine_process: true`) against on a thread of the gRPC
process (the default), two services side by side in one run, both `cpus: auto` (deploy/local.yaml).

Rows as benchmarks.pinning has them: one stream at K = 0, K = 8 in turn and overlapped, and adaptive; adaptive over
n concurrent streams (`--streams`); transformers generate() and assisted generation once a repeat for reference.
A figure is the median over repeats, a ratio the median of the two rows' ratios repeat by repeat, with their range.

    python -m benchmarks.engine_process --repeats 5 --streams 4,16          # the demo pair
    python -m benchmarks.engine_process --repeats 5 --heavy-layers 40 --streams ""
"""
from __future__ import annotations

from benchmarks import pinning
from benchmarks.plan import BenchConfig

PROCESS, THREAD = "engine process", "engine thread"


def with_engine_process(data: dict, on: bool) -> dict:
    return {**data, "target": {**data["target"], "cpus": "auto", "engine_process": on},
            "draft": {**data["draft"], "cpus": "auto"}}


def engine_process_section(data: dict, cfg: BenchConfig, streams: list[int], repeats: int) -> dict:
    return pinning.side_by_side({PROCESS: with_engine_process(data, True), THREAD: with_engine_process(data, False)},
                                cfg, streams, repeats)


if __name__ == "__main__":
    pinning.main(compare=engine_process_section, description=__doc__)
