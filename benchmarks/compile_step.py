"""What torch.compile would give a worker's forwards: a target's decode step (1 token) and verify pass (K + 1 = 5
tokens) over a 64-token KV cache, eager against `torch.compile(model.forward, dynamic=True)` (and on CUDA also
mode="reduce-overhead", CUDA graphs), in this process, with the time the first compiled call took. The workers run
eager today; this measures the lever before anyone pulls it.

    python -m benchmarks.compile_step                                   # the demo target, on the CPU
    python -m benchmarks.compile_step --device cuda --heavy-layers 8    # a heavy target, on a GPU
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks.hf_baseline import forward_seconds, load_hf
from tools.heavy_pair import DEMO_PAIR, ensure_heavy_pair

MODES = {"cpu": (None,), "cuda": (None, "reduce-overhead")}     # torch.compile modes measured per device type
TOKENS = (1, 5)                                                 # a decode step, a verify pass at K = 4


def step_ms(model) -> dict:
    """Median ms of each of TOKENS' forwards over a 64-token cache."""
    return {tokens: 1e3 * forward_seconds(model, 64, 50, tokens) for tokens in TOKENS}


def compiled_rows(model, device_type: str) -> dict:
    """name -> (ms per TOKENS, seconds the first calls took) for eager and each compile mode."""
    rows = {"eager": (step_ms(model), 0.0)}
    eager_forward = model.forward
    for mode in MODES[device_type]:
        model.forward = torch.compile(eager_forward, dynamic=True, mode=mode)
        started = time.perf_counter()
        for tokens in TOKENS:
            forward_seconds(model, 64, 2, tokens)              # compiles each shape's graph
        rows[f"compiled ({mode or 'default'})"] = (step_ms(model), time.perf_counter() - started)
    model.forward = eager_forward
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--heavy-layers", type=int, default=0, help="the heavy pair's target with this many zero-output "
                                                                    "layers (tools/heavy_pair.py; 0: the demo target)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    path = str(ensure_heavy_pair(args.heavy_layers)[1] if args.heavy_layers else DEMO_PAIR / "target")
    model, _ = load_hf(path, args.device, args.dtype)
    rows = compiled_rows(model, torch.device(args.device).type)
    eager = rows["eager"][0]
    print(f"| {path} on {args.device}, {args.dtype} | " + " | ".join(f"{t} token(s) ms" for t in TOKENS)
          + " | time / eager's | first calls s |\n|---|---|---|---|---|")
    for name, (ms, first) in rows.items():
        print(f"| {name} | " + " | ".join(f"{ms[t]:.3f}" for t in TOKENS) + " | "
              + " / ".join(f"{ms[t] / eager[t]:.2f}x" for t in TOKENS) + f" | {first:.1f} |")


if __name__ == "__main__":
    main()
