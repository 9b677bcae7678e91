"""What a long prompt costs the streams beside it, with its prefill in chunks (`*.prefill_chunk_tokens`, both pools)
and in one forward: `--streams` clients stream greedy outputs while long prompts arrive, one every `--interval-ms`, answered
or not (900 tokens, near the demo pair's longest context, 4 new tokens each, none in the prefix cache). Per
setting: the streams' longest and p99 wait between messages, their tokens/s, and the long prompts' time to their
answer, medians over repeats that take the settings in turn (a service each, started afresh).

    python -m benchmarks.prefill_chunks --config deploy/local.yaml --chunks 0 256 512 --repeats 5
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

from benchmarks.plan import PREDICTABLE
from benchmarks.service import load_service_config, log, running_data, stream_one
from protos.specpool.v1 import generation_pb2


def long_prompt(tokens: int, n: int) -> list[int]:
    """The n-th long prompt: token IDs of the demo pair's vocabulary, each of the first 697 its own from its first
    token (so that the prefix cache holds none of it)."""
    return [n % 697 + 3] + [(7 * i + n) % 700 + 3 for i in range(1, tokens)]


def long_prompts(stub, tokens: int, interval_s: float, stop: threading.Event) -> list[float]:
    """A long prompt of `tokens` tokens every `interval_s` (each on a thread of its own, whether or not the last one
    was answered, so that every setting gets the same prompts at the same times) until `stop`: each one's time to
    its (whole) answer."""
    times, senders = [], []
    def send(n: int) -> None:
        started = time.perf_counter()
        stub.Generate(generation_pb2.GenerateRequest(prompt_token_ids=long_prompt(tokens, n), max_new_tokens=4))
        times.append(time.perf_counter() - started)
    while not stop.wait(interval_s):
        senders.append(threading.Thread(target=send, args=(len(senders),)))
        senders[-1].start()
    for sender in senders:
        sender.join()
    return times


def streams_beside_long_prompts(stub, streams: int, max_new: int, prompt_tokens: int, interval_s: float) -> dict:
    """`streams` streams of max_new tokens while long prompts go in: their waits and tokens/s, the prompts' times."""
    results, stop, prompts = [None] * streams, threading.Event(), []
    def stream(i: int) -> None:
        results[i] = stream_one(stub, PREDICTABLE[i % len(PREDICTABLE)], max_new, None)
    longs = threading.Thread(target=lambda: prompts.extend(long_prompts(stub, prompt_tokens, interval_s, stop)))
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
    started = time.perf_counter()
    for thread in [longs] + threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    stop.set()
    longs.join()
    waits = sorted(w for r in results for w in r["waits"])
    return {"max_wait_ms": 1e3 * waits[-1], "p99_wait_ms": 1e3 * waits[int(0.99 * (len(waits) - 1))],
            "tokens_per_s": sum(r["tokens"] for r in results) / seconds,
            "long_ms": 1e3 * statistics.median(prompts), "longs": len(prompts)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="deploy/local.yaml")
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 256, 512])
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--prompt-tokens", type=int, default=900)
    parser.add_argument("--interval-ms", type=float, default=250.0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    data, rows = load_service_config(args.config), {chunk: [] for chunk in args.chunks}
    for repeat in range(args.repeats):
        for chunk in args.chunks if repeat % 2 == 0 else args.chunks[::-1]:
            config = {**data, **{pool: {**data.get(pool, {}), "prefill_chunk_tokens": chunk} for pool in ("draft", "target")}}
            with running_data(config, label=f"{args.config}, prefill_chunk_tokens {chunk}") as service:
                row = service.client(streams_beside_long_prompts, args.streams, args.max_new_tokens,
                                     args.prompt_tokens, args.interval_ms / 1e3)
            log(f"repeat {repeat + 1}/{args.repeats}, chunk {chunk}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()))
            rows[chunk].append(row)
    print(f"{args.streams} streams of {args.max_new_tokens} tokens beside a {args.prompt_tokens}-token prompt every "
          f"{args.interval_ms:.0f} ms (medians of {args.repeats} repeats):")
    print("| prefill_chunk_tokens | streams' longest wait (ms) | p99 wait (ms) | p99 wait / off | streams' tokens/s | "
          "long prompt's answer (ms) | answer / off |")
    print("|---|---|---|---|---|---|---|")
    medians = {chunk: {key: statistics.median(r[key] for r in repeats) for key in repeats[0]}
               for chunk, repeats in rows.items()}
    off = medians.get(0)
    for chunk, median in medians.items():
        versus = (lambda key: f"{median[key] / off[key]:.2f}×") if off else (lambda key: "")
        print(f"| {chunk or 'off (0)'} | {median['max_wait_ms']:.1f} | {median['p99_wait_ms']:.1f} | "
              f"{versus('p99_wait_ms')} | {median['tokens_per_s']:.1f} | {median['long_ms']:.1f} | "
              f"{versus('long_ms')} |", flush=True)


if __name__ == "__main__":
    main()
