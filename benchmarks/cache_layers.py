"""What a session's KV cache layers hold and what a decode step costs, with session 31's layers (engine/cache_layers.py:
full-attention layers growing in place, sliding-window layers holding the window plus the rollback) and with the
layers before (transformers' DynamicLayer everywhere: a copy of the whole cache on every append, sliding layers
holding the whole context), side by side at each context length, in process (the engine's forwards, no Ray or gRPC).

Three random models built here, nothing downloaded, width 256: "llama", 4 layers of full attention; "mistral", 4
layers each attending over a window of 256 tokens (as Mistral 7B v0.1 does over 4,096); "gemma3", 6 layers, 5 of
them so (as Gemma 3 does over 1,024). Per model and context: a batch of `--rows` sessions prefilled in chunks of
512, then `--steps` greedy decode steps; the bytes the cache tensors hold after them (their storage, each counted
once) and the median step time, medians over `--repeats` repeats that take the two settings in turn.

    python -m benchmarks.cache_layers --contexts 512 2048 8192 --out benchmarks/results
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import engine.modeling as modeling
from benchmarks.service import log
from engine.modeling import extend_batch, load_model
from engine.sampling import Sampling
from engine.sessions import Session

WINDOW, WIDTH, CHUNK = 256, 256, 512


def before_session_31(model):
    """The cache engine.modeling.new_cache gave before session 31: transformers' DynamicLayer on every layer."""
    from transformers import DynamicCache
    return DynamicCache()


SETTINGS = {"session 31": modeling.new_cache, "before": before_session_31}   # the engine's new_cache


def build(family: str, root: Path) -> str:
    """A random model of `family` saved as a Hugging Face folder; returns its path."""
    import transformers
    shape = dict(hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=16384, vocab_size=512, sliding_window=WINDOW)
    if family == "llama":
        shape.pop("sliding_window")
        config = transformers.LlamaConfig(**shape, num_hidden_layers=4)
    elif family == "mistral":
        config = transformers.MistralConfig(**shape, num_hidden_layers=4)
    else:
        kinds = ["sliding_attention"] * 5 + ["full_attention"]
        config = transformers.Gemma3TextConfig(**shape, num_hidden_layers=6, head_dim=64, layer_types=kinds)
    torch.manual_seed(0)
    path = root / family
    transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(path)
    return str(path)


def held_bytes(sessions: list[Session]) -> int:
    """Bytes of the storage behind the sessions' cache tensors, each storage counted once."""
    storages = {}
    for session in sessions:
        for layer in session.cache.layers:
            for tensor in (layer.keys, layer.values):
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def run(model, rows: int, context: int, steps: int) -> tuple[int, float]:
    """(bytes held after the steps, median step seconds) of `rows` sessions of `context` tokens decoding `steps`."""
    sessions = [Session(sampling=Sampling()) for _ in range(rows)]
    prompts = [[(7 * i + r) % 500 + 3 for i in range(context)] for r in range(rows)]
    for start in range(0, context, CHUNK):
        logits, batch = extend_batch(model, sessions, [p[start:start + CHUNK] for p in prompts], [1] * rows)
    times = []
    for _ in range(steps):
        tokens = [[int(row[-1].argmax())] for row in logits]
        started = time.perf_counter()
        logits, batch = extend_batch(model, sessions, tokens, [1] * rows, batch)
        times.append(time.perf_counter() - started)
    return held_bytes(sessions), statistics.median(times)


def measure(path: str, contexts: list[int], rows: int, steps: int, repeats: int) -> list[dict]:
    """Per context: bytes and step time with each setting, medians over repeats taking the settings in turn."""
    model, out = load_model(path), []
    for context in contexts:
        samples = {name: [] for name in SETTINGS}
        for repeat in range(repeats):
            for name, new_cache in SETTINGS.items():
                modeling.new_cache = new_cache
                samples[name].append(run(model, rows, context, steps))
            log(f"{Path(path).name}, {context} tokens, repeat {repeat + 1}/{repeats}")
        modeling.new_cache = SETTINGS["session 31"]
        out.append({"context": context, **{f"{name}_mib": statistics.median(b for b, _ in s) / 2 ** 20
                                           for name, s in samples.items()},
                    **{f"{name}_step_ms": 1e3 * statistics.median(t for _, t in s) for name, s in samples.items()}})
    return out


def table(results: dict[str, list[dict]], rows: int) -> str:
    lines = [f"| model | context | KV cache, session 31 / before (MiB, {rows} rows) | memory ratio | "
             "decode step, session 31 / before (ms) | step time ratio |", "|---|---|---|---|---|---|"]
    for family, points in results.items():
        for p in points:
            new, old = (p["session 31_mib"], p["session 31_step_ms"]), (p["before_mib"], p["before_step_ms"])
            lines.append(f"| {family} | {p['context']} | {new[0]:.1f} / {old[0]:.1f} | {new[0] / old[0]:.2f}x | "
                         f"{new[1]:.2f} / {old[1]:.2f} | {new[1] / old[1]:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="folder for cache_layers.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as root:
        results = {family: measure(build(family, Path(root)), args.contexts, args.rows, args.steps, args.repeats)
                   for family in ("llama", "mistral", "gemma3")}
    text = table(results, args.rows)
    print(text)
    if args.out:
        Path(args.out, "cache_layers.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
