"""What a windowed model's KV cache holds, and what a decode step costs, with sliding-window layers trimmed to the
window plus the rollback (engine/window_cache.py, the default) and holding the whole context (as before session 31),
side by side at each context length, in process (the target engine's forwards, no Ray or gRPC).

Two random models built here, nothing downloaded: "mistral", every layer attending over a window of 256 tokens
(as Mistral 7B v0.1 does over 4,096), and "gemma3", 5 of every 6 layers so (as Gemma 3 does over 1,024). Each is a
4-layer (6-layer) model of width 256, so that contexts of thousands of tokens run in seconds on a CPU. Per family
and context: a batch of `--rows` sessions prefilled in chunks of 512, then `--steps` greedy decode steps; the bytes
the cache tensors hold after them (their storage, each counted once) and the median step time, medians over
`--repeats` repeats that take the two settings in turn.

    python -m benchmarks.window_memory --contexts 512 2048 8192 --out benchmarks/results
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import engine.window_cache as window_cache
from benchmarks.service import log
from engine.modeling import extend_batch, load_model
from engine.sampling import Sampling
from engine.sessions import Session

WINDOW, WIDTH, CHUNK = 256, 256, 512
UNTRIMMED = 10 ** 9          # ROLLBACK_TOKENS that keeps every column: what sliding layers held before


def build(family: str, root: Path) -> str:
    """A random model of `family` saved as a Hugging Face folder; returns its path."""
    import transformers
    shape = dict(hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=16384, vocab_size=512, sliding_window=WINDOW)
    if family == "mistral":
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
    """Per context: bytes and step time trimmed and untrimmed, medians over repeats taking the settings in turn."""
    model, out = load_model(path), []
    for context in contexts:
        samples = {"trimmed": [], "untrimmed": []}
        for repeat in range(repeats):
            for name, rollback in (("trimmed", 160), ("untrimmed", UNTRIMMED)):
                window_cache.ROLLBACK_TOKENS = rollback
                samples[name].append(run(model, rows, context, steps))
            log(f"{Path(path).name}, {context} tokens, repeat {repeat + 1}/{repeats}")
        window_cache.ROLLBACK_TOKENS = 160
        out.append({"context": context, **{f"{name}_mib": statistics.median(b for b, _ in s) / 2 ** 20
                                           for name, s in samples.items()},
                    **{f"{name}_step_ms": 1e3 * statistics.median(t for _, t in s) for name, s in samples.items()}})
    return out


def table(results: dict[str, list[dict]], rows: int) -> str:
    lines = [f"| model | context | KV cache trimmed / whole context (MiB, {rows} rows) | memory ratio | "
             "decode step trimmed / whole (ms) | step time ratio |", "|---|---|---|---|---|---|"]
    for family, points in results.items():
        for p in points:
            lines.append(f"| {family} | {p['context']} | {p['trimmed_mib']:.1f} / {p['untrimmed_mib']:.1f} | "
                         f"{p['trimmed_mib'] / p['untrimmed_mib']:.2f}x | {p['trimmed_step_ms']:.2f} / "
                         f"{p['untrimmed_step_ms']:.2f} | {p['trimmed_step_ms'] / p['untrimmed_step_ms']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="folder for window_memory.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as root:
        results = {family: measure(build(family, Path(root)), args.contexts, args.rows, args.steps, args.repeats)
                   for family in ("mistral", "gemma3")}
    text = table(results, args.rows)
    print(text)
    if args.out:
        Path(args.out, "window_memory.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
