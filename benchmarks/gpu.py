"""specpool on a GPU: the demo and heavy pairs served with both pools on one CUDA device (half a GPU each in Ray's
accounting), against transformers generate() and assisted generation on the same device. The rows are
benchmarks/overlap.py's, fewer of them (a lent GPU comes by the minute): measured interleaved repeat by repeat,
each with where a round's wall time went.

    python -m benchmarks.gpu --out /tmp/gpu                  # on a machine with a CUDA device
    python -m benchmarks.gpu --device cpu --quick            # the same rows on the CPU: a smoke run of this script
    python -m benchmarks.gpu --dtype bfloat16 --skip-demo    # the heavy pair alone, in a GPU deployment's dtype
    python -m benchmarks.gpu --draft-device cpu --dtype bfloat16 --skip-demo   # the draft on the host's cores

With `--draft-device cpu` the draft pool runs on the machine's CPU cores (float32, pinned to a core of its own)
and the target on the GPU: draft and target on separate hardware, as the product deploys them, on a machine with
one GPU. Both pools on one GPU instead time-slice it between their processes (session 37: a heavy pass 1.2-1.9x
slower beside two other processes), which measures that contention rather than the design. The transformers rows
then try assisted generation with the assistant on the CPU too (transformers 5.17 cannot run it: the row is left
out, saying why), and the goals take the best of every row.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
from pathlib import Path

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from benchmarks.overlap import best_transformers, heavy_config, pair_rows
from benchmarks.plan import PREDICTABLE, QUICK, BenchConfig
from benchmarks.repeats import paired
from benchmarks.report import overlap_markdown
from benchmarks.service import load_service_config, log, running_data


def gpu_plan(configured: dict, cfg: BenchConfig) -> list[tuple[str, int | None, dict]]:
    """In turn at K = 0, in turn and overlapped at each of cfg.ks and adaptive."""
    return [("in turn K=0", 0, {**configured, "overlap": False})] + [
        (f"{'overlap' if overlap else 'in turn'} {'adaptive' if k is None else f'K={k}'}", k,
         {**configured, "overlap": overlap}) for k in (*cfg.ks, None) for overlap in (False, True)]


def on_device(data: dict, device: str, dtype: str = "float32", draft_device: str | None = None) -> dict:
    """The config `data` with both pools on `device` in `dtype` (on CUDA each takes half of one GPU), or the draft
    on `draft_device` (in float32 there unless that is a GPU), HTTP off."""
    data = {**copy.deepcopy(data), "http": {"port": -1}}
    shared = draft_device is None or _gpu(draft_device) == _gpu(device)
    for pool, pool_device in (("draft", draft_device or device), ("target", device)):
        cuda = pool_device.startswith("cuda")
        data[pool].update(device=pool_device, num_gpus=(0.5 if shared else 1.0) if cuda else 0.0,
                          dtype=dtype if cuda or shared else "float32")
    return data


def _gpu(device: str) -> str:
    """A CUDA device's name with its index ("cuda" is "cuda:0"), any other device's as it is."""
    return f"{device}:0" if device == "cuda" else device


def gpu_ratios(transformers: dict, rows: dict, ks: tuple) -> dict:
    """(median, lowest, highest) over the repeats of the ratios that issue #11's goals name."""
    assisted, base = best_transformers(transformers)
    pairs = {"overlap adaptive / best assisted": (rows["overlap adaptive"], assisted),
             "in turn K=0 / generate()": (rows["in turn K=0"], base)}
    pairs.update({f"overlap / in turn at K={k}": (rows[f"overlap K={k}"], rows[f"in turn K={k}"]) for k in ks})
    return {key: paired(row, against) for key, (row, against) in pairs.items()}


def section(data: dict, cfg: BenchConfig) -> dict:
    """One pair's transformers and specpool rows, interleaved, and their ratios."""
    with running_data(data) as service:
        transformers, rows, c = pair_rows(service, cfg, gpu_plan)
    measured = gpu_ratios(transformers, rows, cfg.ks)
    return {"c": c, "transformers": transformers, "rows": rows,
            "ratios": {key: value[0] for key, value in measured.items()},
            "ratio_ranges": {key: value[1:] for key, value in measured.items()}}


def parse_args(argv: list[str] | None = None) -> tuple[BenchConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=BenchConfig.config)
    parser.add_argument("--out", default="benchmarks/results/gpu")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--draft-device", default=None, help="the draft pool's device (default: --device's; cpu: "
                        "draft and target on separate hardware)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                        help="both pools' and the transformers rows' (bfloat16: what a GPU deployment runs)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ks", type=lambda text: tuple(int(k) for k in text.split(",")), default=(4,))
    parser.add_argument("--heavy-layers", type=int, default=40, help="zero-output layers of the heavy pair (0: skip)")
    parser.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK}")
    parser.add_argument("--skip-demo", action="store_true", help="the heavy pair alone (the demo pair's GPU passes "
                        "cost their launches: its ratios are noise)")
    args = parser.parse_args(argv)
    cfg = BenchConfig(config=args.config, out=args.out, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                      ks=args.ks, heavy_layers=args.heavy_layers)
    if args.quick:
        cfg = dataclasses.replace(cfg, max_new_tokens=QUICK["max_new_tokens"], repeats=QUICK["repeats"])
    return cfg, args


def main(argv: list[str] | None = None) -> None:
    cfg, args = parse_args(argv)
    data = on_device(load_service_config(cfg.config), args.device, args.dtype, args.draft_device)
    where = f"{args.device}, {args.dtype}" + (f", draft on {args.draft_device}" if args.draft_device else "")
    pairs = {} if args.skip_demo else {"demo pair": (data, cfg)}
    if cfg.heavy_layers:
        pairs["heavy pair"] = (heavy_config(data, cfg.heavy_layers), dataclasses.replace(cfg, prompts=PREDICTABLE))
    results = {}
    for name, (pair_data, pair_cfg) in pairs.items():
        log(f"{name} on {where}")
        results[name] = section(pair_data, pair_cfg)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    text = "".join(overlap_markdown(f"{name} on {where}", results[name]) for name in results)
    (out / "gpu.json").write_text(json.dumps({"bench": dataclasses.asdict(cfg), "device": args.device,
                                              "draft_device": args.draft_device or args.device, "dtype": args.dtype,
                                              **results}, indent=2))
    (out / "gpu.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
