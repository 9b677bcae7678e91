"""Workers pinned to cores of their own (`cpus: auto`, as deploy/local.yaml has it) against the same workers
unpinned, two services side by side in one run.

Rows: one stream at K = 0, K = 8 in turn and overlapped, and adaptive; adaptive over n concurrent streams
(`--streams`); each row on both services, the two the other way round every other repeat, and transformers
generate() and assisted generation (K = 6, one thread, the best of its rows in make bench's heavy run) once a
repeat for reference. A figure is the median over repeats, a ratio the median of the two rows' ratios repeat by
repeat, with their range.

    python -m benchmarks.pinning --repeats 7                 # the demo pair
    python -m benchmarks.pinning --repeats 7 --heavy-layers 40 --streams ""
"""
from __future__ import annotations

import argparse
import statistics

from benchmarks.concurrency import sweep_sample
from benchmarks.hf_baseline import hf_run, load_hf
from benchmarks.overlap import heavy_config, measured_row
from benchmarks.plan import PREDICTABLE, BenchConfig
from benchmarks.repeats import paired
from benchmarks.service import load_service_config, log, running_data
from engine.model_pair import resolve_model

PINNED, FREE = "pinned", "not pinned"
SINGLE = (("K=0", 0, False), ("in turn K=8", 8, False), ("overlap K=8", 8, True), ("overlap adaptive", None, True))
GENERATE, ASSISTED = "transformers generate()", "transformers assisted K=6"


def with_cpus(data: dict, cpus) -> dict:
    return {**data, **{pool: {**data[pool], "cpus": cpus} for pool in ("draft", "target")}}


def measures(cfg: BenchConfig, streams: list[int]) -> list:
    """(row, measure(service) -> tokens/s) of every specpool row."""
    single = [(name, lambda s, k=k, overlap=overlap: measured_row(s, cfg, k, {"overlap": overlap})["tokens_per_s"])
              for name, k, overlap in SINGLE]
    return single + [(f"adaptive, {n} streams", lambda s, n=n: sweep_sample(s, cfg, n, None)["tokens_per_s"])
                     for n in streams]


def reference(service, max_new: int) -> dict:
    """transformers' rows, one pass over the prompts each: {row: tokens/s}."""
    target, tokenizer = load_hf(service.service.pools.target_info["model_path"])
    draft, _ = load_hf(resolve_model(service.service.config.draft.model))
    prompts = [[p] for p in PREDICTABLE]
    def rate(**kwargs) -> float:
        seconds, tokens = hf_run(target, tokenizer, prompts, max_new, **kwargs)
        return tokens / seconds
    return {GENERATE: rate, ASSISTED: lambda: rate(assistant=draft, k=6)}


def pinning_section(data: dict, cfg: BenchConfig, streams: list[int], repeats: int) -> dict:
    """pinned (cpus auto) against not pinned: see side_by_side."""
    return side_by_side({PINNED: with_cpus(data, "auto"), FREE: with_cpus(data, "")}, cfg, streams, repeats)


def side_by_side(services: dict[str, dict], cfg: BenchConfig, streams: list[int], repeats: int) -> dict:
    """Two services ({label: config data}) side by side: every row's tokens/s per repeat (each row one pass over
    cfg's prompts a repeat, the two services the other way round every other repeat): {row: {label: [...]}} and
    {transformers row: [...]}."""
    rows, (a, b) = measures(cfg, streams), services
    runs = {name: {a: [], b: []} for name, _ in rows}
    with running_data(services[a], label=a) as first, running_data(services[b], label=b) as second:
        hf = reference(second, cfg.max_new_tokens)
        hf_runs = {name: [] for name in hf}
        for repeat in range(repeats):
            order = [(a, first), (b, second)][::1 if repeat % 2 == 0 else -1]
            for name, measure in rows:
                for label, service in order:
                    runs[name][label].append(measure(service))
            for name, rate in hf.items():
                hf_runs[name].append(rate())
            log(f"repeat {repeat + 1}/{repeats} ({a}/{b}): " + ", ".join(
                f"{name} {r[a][-1]:.0f}/{r[b][-1]:.0f}" for name, r in runs.items()) + " tokens/s")
    return {"rows": runs, "transformers": hf_runs, "labels": [a, b]}


def markdown(section: dict) -> str:
    def ratio(a: list, b: list) -> str:
        median, low, high = paired({"rates": a}, {"rates": b})
        return f"{median:.3f} ({low:.2f}-{high:.2f})"
    first, second = section.get("labels", (PINNED, FREE))
    lines = [f"| row | {first} tokens/s | {second} tokens/s | {first} / {second} |", "|---|---|---|---|"]
    for name, r in section["rows"].items():
        lines.append(f"| {name} | {statistics.median(r[first]):.1f} | {statistics.median(r[second]):.1f} | "
                     f"{ratio(r[first], r[second])} |")
    hf, rows = section["transformers"], section["rows"]
    lines += ["", *(f"- {name}: {statistics.median(rates):.1f} tokens/s" for name, rates in hf.items())]
    for label in (first, second):
        lines.append(f"- {label}: K=0 / generate() {ratio(rows['K=0'][label], hf[GENERATE])}, overlap adaptive / "
                     f"assisted K=6 {ratio(rows['overlap adaptive'][label], hf[ASSISTED])}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None, compare=pinning_section, description: str = __doc__) -> None:
    """Parse the command line, run `compare(data, cfg, streams, repeats)` (a side_by_side) and print its table."""
    parser = argparse.ArgumentParser(description=description.splitlines()[0])
    parser.add_argument("--config", default=BenchConfig.config)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--max-new-tokens", type=int, default=BenchConfig.max_new_tokens)
    parser.add_argument("--heavy-layers", type=int, default=0, help="the heavy pair with this many zero-output "
                        "layers (tools/heavy_pair.py) instead of the config's")
    parser.add_argument("--streams", default="4,16", help="stream counts of the concurrent rows ('': none)")
    args = parser.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    cfg = BenchConfig(config=args.config, max_new_tokens=args.max_new_tokens, repeats=1, prompts=PREDICTABLE)
    data = load_service_config(cfg.config)
    data = heavy_config(data, args.heavy_layers) if args.heavy_layers else data
    try:
        section = compare(data, cfg, [int(n) for n in args.streams.split(",") if n], args.repeats)
    finally:
        import ray
        ray.shutdown()
    print(markdown(section))


if __name__ == "__main__":
    main()
