"""The target engine's batched decode step, in one process: n concurrent decode runs' steps as the Batcher hands
them over (the same sessions every step, so each forward runs on the last one's batch: RaggedBatch.holds), with
each session's cache handed back lazily (when next asked for, as the engine does) against handed back after
every step (as before session 17, simulated by asking for every session's cache). Repeats interleaved; prints
ms per step (medians) and the paired ratio.

    python -m benchmarks.batch_step                       # the demo pair, 16 rows
    python -m benchmarks.batch_step --rows 8 --steps 96
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.plan import PREDICTABLE, UNPREDICTABLE, BenchConfig
from benchmarks.repeats import paired
from benchmarks.service import load_service_config, log


def started_sessions(engine, tokenizer, rows: int, first_id: int) -> list:
    """`rows` sessions started on the benchmark's prompts, each at its first decode step's request."""
    from protos.specpool.v1 import worker_pb2
    from target_worker.server import next_step
    prompts = PREDICTABLE + UNPREDICTABLE
    requests = []
    for j in range(rows):
        request = worker_pb2.VerifyRequest(session_id=first_id + j, position=0,
                                           new_token_ids=tokenizer(prompts[j % len(prompts)]).input_ids)
        request.sampling.SetInParent()                                   # greedy
        requests.append(next_step(request, engine.verify(request), None, 1 << 30))
    return requests


def ms_per_step(engine, tokenizer, rows: int, steps: int, first_id: int, eager: bool) -> float:
    """Median ms per batched step of `rows` decode runs over `steps` steps (the first two, which pack, left out)."""
    from target_worker.server import next_step
    requests, times = started_sessions(engine, tokenizer, rows, first_id), []
    for _ in range(steps):
        started = time.perf_counter()
        answers = engine.verify_batch(requests)
        if eager:
            for request in requests:
                engine.sessions._sessions[request.session_id].cache   # noqa: B018 - hands the view back now
        times.append(time.perf_counter() - started)
        requests = [next_step(r, a, None, 1 << 30) for r, a in zip(requests, answers)]
    for request in requests:
        engine.release(request.session_id)
    return 1e3 * statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=BenchConfig.config)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    from transformers import AutoTokenizer
    from engine.model_pair import resolve_model
    from target_worker.verifier import TargetEngine
    torch.set_num_threads(1)                                             # as the workers run
    config = load_service_config(args.config)
    target, draft = resolve_model(config["target"]["model"]), resolve_model(config["draft"]["model"])
    engine, tokenizer = TargetEngine(target, draft), AutoTokenizer.from_pretrained(target)
    runs = {"lazy": [], "eager": []}
    for repeat in range(args.repeats):
        for name in runs:
            first_id = (2 * repeat + (name == "eager")) * args.rows + 1
            runs[name].append(ms_per_step(engine, tokenizer, args.rows, args.steps, first_id, name == "eager"))
        log(f"repeat {repeat + 1}/{args.repeats}: " + ", ".join(f"{n} {v[-1]:.2f} ms" for n, v in runs.items()))
    ratio, low, high = paired({"rates": runs["eager"]}, {"rates": runs["lazy"]})
    print(f"{args.rows}-row decode step, handed back lazily: {statistics.median(runs['lazy']):.2f} ms; after every "
          f"step: {statistics.median(runs['eager']):.2f} ms; after every step / lazily = {ratio:.2f} "
          f"({low:.2f}-{high:.2f} over {args.repeats} repeats)")


if __name__ == "__main__":
    main()
