"""The target engine's batched step, in one process: n concurrent requests' steps as the Batcher hands them over
(the same sessions every step), as the engine runs them (each forward on the last one's batch while it holds the
same sessions: RaggedBatch.holds; each session's cache handed back only when next asked for) against every
session's cache handed back after every step (as before session 17, simulated by asking for every cache). A step
is a decode run's (K = 0: one token per row) or, with --drafts K, a speculative round's: K drafts per row (random
tokens, so nearly all rejected), whose rollback the engine does in place in the batch (RaggedBatch.crop_row; a
crop on each handed-back cache, and a fresh pack of every row, before session 18). Repeats interleaved; prints ms
per step (medians) and the paired ratio.

    python -m benchmarks.batch_step                       # the demo pair, 16 rows, decode steps
    python -m benchmarks.batch_step --drafts 4            # speculative rounds of 4 drafts
    python -m benchmarks.batch_step --rows 8 --steps 96
"""
from __future__ import annotations

import argparse
import functools
import random
import statistics
import time

import torch

from benchmarks.plan import PREDICTABLE, UNPREDICTABLE, BenchConfig
from benchmarks.repeats import paired
from benchmarks.service import load_service_config, log


def started_sessions(engine, tokenizer, rows: int, first_id: int, step) -> list:
    """`rows` sessions started on the benchmark's prompts, each at its first step's request (`step`)."""
    from protos.specpool.v1 import worker_pb2
    prompts = PREDICTABLE + UNPREDICTABLE
    requests = []
    for j in range(rows):
        request = worker_pb2.VerifyRequest(session_id=first_id + j, position=0,
                                           new_token_ids=tokenizer(prompts[j % len(prompts)]).input_ids)
        request.sampling.SetInParent()                                   # greedy
        requests.append(step(request, engine.verify(request)))
    return requests


def next_call(request, answer, drafts: int, vocab: int, rng: random.Random):
    """The row's next step: a decode run's, or a speculative round's with `drafts` random drafts."""
    from target_worker.server import next_step
    step = next_step(request, answer, None, 1 << 30)
    step.draft_token_ids.extend(rng.randrange(vocab) for _ in range(drafts))
    return step


def ms_per_step(engine, tokenizer, rows: int, steps: int, first_id: int, eager: bool, drafts: int) -> float:
    """Median ms per batched step of `rows` requests over `steps` steps (the first two, which pack, left out)."""
    rng, vocab = random.Random(first_id), engine.model.config.vocab_size
    step = functools.partial(next_call, drafts=drafts, vocab=vocab, rng=rng)
    requests, times = started_sessions(engine, tokenizer, rows, first_id, step), []
    for _ in range(steps):
        started = time.perf_counter()
        answers = engine.verify_batch(requests)
        if eager:
            for request in requests:
                engine.sessions._sessions[request.session_id].cache   # noqa: B018 - hands the view back now
        times.append(time.perf_counter() - started)
        requests = [step(r, a) for r, a in zip(requests, answers)]
    for request in requests:
        engine.release(request.session_id)
    return 1e3 * statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=BenchConfig.config)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--drafts", type=int, default=0, help="K drafts per row and step (0: decode steps)")
    args = parser.parse_args()
    from transformers import AutoTokenizer
    from engine.model_pair import resolve_model
    from target_worker.verifier import TargetEngine
    torch.set_num_threads(1)                                             # as the workers run
    config = load_service_config(args.config)
    target, draft = resolve_model(config["target"]["model"]), resolve_model(config["draft"]["model"])
    engine, tokenizer = TargetEngine(target, draft), AutoTokenizer.from_pretrained(target)
    runs = {"as run": [], "handed back": []}
    for repeat in range(args.repeats):
        for name in runs:
            first_id = (2 * repeat + (name == "handed back")) * args.rows + 1
            runs[name].append(ms_per_step(engine, tokenizer, args.rows, args.steps, first_id, name == "handed back",
                                          args.drafts))
        log(f"repeat {repeat + 1}/{args.repeats}: " + ", ".join(f"{n} {v[-1]:.2f} ms" for n, v in runs.items()))
    ratio, low, high = paired({"rates": runs["handed back"]}, {"rates": runs["as run"]})
    kind = f"speculative step (K = {args.drafts})" if args.drafts else "decode step"
    print(f"{args.rows}-row {kind}, as the engine runs it: {statistics.median(runs['as run']):.2f} ms; every cache "
          f"handed back after every step: {statistics.median(runs['handed back']):.2f} ms; handed back / as run = "
          f"{ratio:.2f} ({low:.2f}-{high:.2f} over {args.repeats} repeats)")


if __name__ == "__main__":
    main()
