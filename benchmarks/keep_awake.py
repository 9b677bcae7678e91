"""Keeping the CPUs awake (`*.keep_awake_s`, engine/keep_awake.py) against letting them halt, side by side in one
service: every row with the spinners of the router and of every worker spinning (linger 1 s, the default) and with
them asleep (linger 0), the two in the reverse order every other repeat, so that this machine's drift falls on both
alike. The transformers rows run the same way in this process, with spinners of its own, so that what the spinners
give any program on this machine is not counted as specpool's. tokens/s (median, and the median of the per-repeat
ratios with their range) and a round's time beyond compute (ms).

    python -m benchmarks.keep_awake --repeats 7                    # both pairs: about 25 minutes here
    python -m benchmarks.keep_awake --repeats 7 --heavy-layers 0   # the demo pair only
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import threading

import ray

from benchmarks.overlap import heavy_config, hop_ms, measured_row
from benchmarks.plan import PREDICTABLE, BenchConfig
from benchmarks.repeats import paired
from benchmarks.sections import write_sections
from benchmarks.service import load_service_config, log, running_data
from benchmarks.single_stream import BASE_ROW, hf_plan
from engine.keep_awake import KeepAwake

ROWS = (("in turn K=0", 0, {"overlap": False}),
        ("in turn K=0, one call per token", 0, {"overlap": False, "decode_steps": 1}),
        ("in turn K=8", 8, {"overlap": False}),
        ("overlap K=8", 8, {"overlap": True}),
        ("overlap adaptive", None, {"overlap": True}))
TRANSFORMERS_KS = (2, 6, 8)
TRANSFORMERS = {BASE_ROW} | {f"transformers assisted K={k}" for k in TRANSFORMERS_KS}   # at one torch thread
LINGER = {"on": 1.0, "off": 0.0}


class Spinners:
    """Every spinner of a service (the router's, each worker's) and this process's own, their linger set at once."""

    def __init__(self, service):
        pools = service.service.pools
        self._actors = pools.draft_actors + [rank for ranks in pools.target_actors for rank in ranks]
        self._router, self._here, self._done = service.service.awake, KeepAwake(LINGER["on"]), threading.Event()
        self._toucher = threading.Thread(target=self._touching, daemon=True)   # this process: busy throughout
        self._toucher.start()

    def _touching(self) -> None:
        while not self._done.wait(0.1):
            self._here.touch()

    def set(self, linger_s: float) -> None:
        self._router.linger_s = self._here.linger_s = linger_s
        ray.get([actor.keep_awake.remote(linger_s) for actor in self._actors])

    def close(self) -> None:
        self._done.set()
        self._toucher.join()
        self._here.close()


def pair_section(data: dict, cfg: BenchConfig) -> dict:
    """Each row on and off, repeats interleaved: {row: row_summary}."""
    one = dataclasses.replace(cfg, repeats=1)
    with running_data(data, label="keep_awake on and off") as service:
        plan, _ = hf_plan(service, dataclasses.replace(one, ks=TRANSFORMERS_KS))
        measures = [(name, functools.partial(measured_row, service, one, k, {"decode_steps": 32, **speculation}))
                    for name, k, speculation in ROWS] + [
            (name, functools.partial(measure, one)) for name, measure in plan if name in TRANSFORMERS]
        spinners, runs = Spinners(service), {setting: {name: [] for name, _ in measures} for setting in LINGER}
        try:
            for repeat in range(cfg.repeats):
                for name, measure in measures:
                    for setting in (LINGER if repeat % 2 == 0 else list(LINGER)[::-1]):
                        spinners.set(LINGER[setting])
                        runs[setting][name].append(measure())
                log(f"keep_awake, repeat {repeat + 1}/{cfg.repeats}: " + ", ".join(
                    f"{name} {runs['on'][name][-1]['tokens_per_s']:.0f} / {runs['off'][name][-1]['tokens_per_s']:.0f}"
                    for name, _ in measures) + " tokens/s, on / off")
        finally:
            spinners.close()
    return {name: row_summary(runs["on"][name], runs["off"][name]) for name, _ in measures}


def row_summary(on: list[dict], off: list[dict]) -> dict:
    rates = {"on": [row["tokens_per_s"] for row in on], "off": [row["tokens_per_s"] for row in off]}
    hops = {setting: statistics.median(hop_ms(row) for row in rows) if "parts_ms" in rows[0] else None
            for setting, rows in (("on", on), ("off", off))}
    return {"tokens_per_s": {setting: statistics.median(r) for setting, r in rates.items()}, "hop_ms": hops,
            "on / off": paired({"rates": rates["on"]}, {"rates": rates["off"]}), "rates": rates}


def markdown(section: dict) -> str:
    lines = ["| row | tokens/s on | tokens/s off | on / off (range) | ms per round beyond compute, on / off |",
             "|---|---|---|---|---|"]
    for name, row in section.items():
        (ratio, low, high), hops = row["on / off"], row["hop_ms"]
        lines.append(f"| {name} | {row['tokens_per_s']['on']:.1f} | {row['tokens_per_s']['off']:.1f} | "
                     f"{ratio:.2f} ({low:.2f}–{high:.2f}) | "
                     + (f"{hops['on']:.2f} / {hops['off']:.2f} |" if hops["on"] is not None else "|"))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=BenchConfig.config)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--heavy-layers", type=int, default=BenchConfig.heavy_layers, help="0: the demo pair only")
    args = parser.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    cfg = BenchConfig(config=args.config, out=args.out, repeats=args.repeats, prompts=PREDICTABLE)
    data, sections = load_service_config(cfg.config), {}
    try:
        sections["demo pair"] = pair_section(data, cfg)
        if args.heavy_layers:
            sections["heavy pair"] = pair_section(heavy_config(data, args.heavy_layers), cfg)
    finally:
        ray.shutdown()
    write_sections(cfg, "keep_awake", sections, markdown)


if __name__ == "__main__":
    main()
