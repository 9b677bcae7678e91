"""What CUDA graphs would give a worker's forwards, without the compiler: a decode step (1 token) and a verify
pass (K + 1 = 5 tokens) over a 64-token context, timed three ways in this process:

- eager over a DynamicCache, as the workers run today;
- eager over a StaticCache (preallocated, written in place at `cache_position`), the shape a graph needs;
- that same forward captured once in a `torch.cuda.CUDAGraph` and replayed (CUDA only): one launch for the
  whole pass instead of one per kernel, with no Python in between.

A replay writes the same cache slots each time, as a pass at the same position would, and its logits are
compared with the eager static forward's. On the CPU the graph row is left out; the script still counts the host
reads (`.item()`, `bool()`, `.tolist()`, which capture refuses) of a static forward taking capture's paths.
The workers run eager today: this measures the lever before anyone pulls it (torch.compile's CUDA graphs did not
finish compiling the heavy target within 4 minutes in sessions 36 and 37).

    python -m benchmarks.cuda_graphs --device cuda --dtype bfloat16 --heavy-layers 40   # on a GPU
    python -m benchmarks.cuda_graphs                                                    # the CPU check
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from benchmarks.hf_baseline import forward_seconds, load_hf, synchronize
from tools.heavy_pair import DEMO_PAIR, ensure_heavy_pair

CONTEXT, TOKENS, STEPS = 64, (1, 5), 50   # cached tokens, a pass's new tokens (decode, verify at K = 4), timed calls


def static_pass(model, tokens: int):
    """A call of one pass of `tokens` new tokens after CONTEXT cached ones over a StaticCache (its logits), its
    input tensors fixed so that a graph may capture it."""
    from transformers import StaticCache

    from engine.modeling import cache_keyword
    cache, keyword = StaticCache(config=model.config, max_cache_len=CONTEXT + 16), cache_keyword(type(model))
    device = model.device
    model(torch.zeros(1, CONTEXT, dtype=torch.long, device=device), **{keyword: cache},
          cache_position=torch.arange(CONTEXT, device=device), use_cache=True)
    ids = torch.zeros(1, tokens, dtype=torch.long, device=device)
    position = torch.arange(CONTEXT, CONTEXT + tokens, device=device)

    def forward():
        for layer in cache.layers:            # back to CONTEXT tokens in place (5.x layers count on the device)
            if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
                layer.cumulative_length.fill_(CONTEXT)
        return model(ids, **{keyword: cache}, cache_position=position, use_cache=True).logits
    return forward


def median_ms(call, device, steps: int = STEPS) -> float:
    """Median ms of `call`, each timed from an idle `device` until it is idle again."""
    times = []
    for _ in range(steps):
        synchronize(device)
        started = time.perf_counter()
        call()
        synchronize(device)
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def captured(forward) -> tuple:
    """(replay, the graph's logits tensor) of `forward` captured in a CUDA graph after warm-up on a side stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = forward()
    return graph.replay, logits


@contextlib.contextmanager
def counting_host_syncs():
    """Count the calls that read a tensor's value on the host (capture refuses them) while the block runs, with
    transformers told that a CUDA stream is capturing (it takes other paths then, e.g. for the mask)."""
    from transformers.utils import import_utils
    counts = {"item": 0, "__bool__": 0, "tolist": 0}
    originals = {name: getattr(torch.Tensor, name) for name in counts}
    capturing = import_utils.is_cuda_stream_capturing
    import_utils.is_cuda_stream_capturing = lambda: True

    def counted(name):
        def call(self, *args):
            counts[name] += 1
            return originals[name](self, *args)
        return call
    for name in counts:
        setattr(torch.Tensor, name, counted(name))
    try:
        yield counts
    finally:
        import_utils.is_cuda_stream_capturing = capturing
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


@torch.inference_mode()
def rows(model) -> dict:
    """tokens -> {row name: ms or a note}."""
    out = {}
    for tokens in TOKENS:
        forward = static_pass(model, tokens)
        row = {"eager, dynamic cache": 1e3 * forward_seconds(model, CONTEXT, STEPS, tokens),
               "eager, static cache": median_ms(forward, model.device)}
        with counting_host_syncs() as syncs:
            expected = forward().float()
        row["host reads in a static pass"] = sum(syncs.values())
        if model.device.type == "cuda":
            row.update(graph_row(forward, expected, model.device))
        out[tokens] = row
    return out


def graph_row(forward, expected, device) -> dict:
    """The replayed graph's ms and its logits' largest difference from eager's, or why capture failed."""
    try:
        replay, logits = captured(forward)
    except Exception as error:                      # noqa: BLE001 -- a study: report what capture refused
        return {"graph replay": f"capture failed: {type(error).__name__}: {str(error)[:200]}"}
    ms = median_ms(replay, device)
    return {"graph replay": ms, "graph max |logit diff|": (logits.float() - expected).abs().max().item()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--heavy-layers", type=int, default=40, help="the heavy target's zero-output layers "
                                                                     "(tools/heavy_pair.py)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    models = {"demo draft": str(DEMO_PAIR / "draft"), "demo target": str(DEMO_PAIR / "target"),
              f"heavy target (+{args.heavy_layers})": str(ensure_heavy_pair(args.heavy_layers)[1])}
    print(f"| model on {args.device}, {args.dtype} | new tokens | ms: eager, dynamic cache | eager, static cache | "
          "graph replay | eager dynamic / graph | host reads in a static pass | graph max logit diff |\n"
          "|---|---|---|---|---|---|---|---|", flush=True)
    for name, path in models.items():
        model, _ = load_hf(path, args.device, args.dtype)
        for tokens, row in rows(model).items():
            print(table_line(name, tokens, row), flush=True)


def table_line(name: str, tokens: int, row: dict) -> str:
    graph = row.get("graph replay", "-")
    speedup = f"{row['eager, dynamic cache'] / graph:.1f}x" if isinstance(graph, float) else "-"
    cells = [row["eager, dynamic cache"], row["eager, static cache"], graph, speedup,
             row["host reads in a static pass"], row.get("graph max |logit diff|", "-")]
    return f"| {name} | {tokens} | " + " | ".join(f"{c:.3f}" if isinstance(c, float) else str(c) for c in cells) + " |"


if __name__ == "__main__":
    main()
