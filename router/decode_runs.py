"""Decode runs: up to `decode_steps` tokens in one target call, with no round trip between the target's steps.

A round at K = 0 is a decode run; so is every round of a request whose only proposer is prompt lookup, the target
then looking up its own drafts, and an n-gram round of model+ngram, until a lookup misses (router/round_plan.py,
run_plan). The target answers each step as it is sampled, or holds it up to `answer_delay_ms`
(`unstreamed_answer_delay_ms` for a request read whole, KSelector.answer_delay_s) to send several in one message.
Each step is a round here, as it would have been one call at a time.
"""
from __future__ import annotations

import contextlib
import time
from typing import AsyncIterator

import grpc

from protos.specpool.v1 import worker_pb2
from router.controller import RoundTimings
from router.recovery import recover_target
from router.request_state import NGRAM, NO_DRAFTS, RequestState, Round, logprobs_asked
from router.request_stats import record, record_start
from router.round_timing import round_parts, split_wall
from router.worker_client import TargetClient


async def decode_run(state: RequestState, target: TargetClient, steps: int, source: int, answer_delay_s: float = 0.0,
                     lookup: worker_pb2.PromptLookup | None = None) -> AsyncIterator[list[Round]]:
    """Up to `steps` tokens in one target call, with no round trip between the target's steps: plain decoding
    (K = 0), or with `lookup` the target drafting by prompt lookup over the session's committed tokens. Each step
    is a round here, as it would have been one call at a time. The target answers each step as soon as it is
    sampled, or holds it up to `answer_delay_s` to send it with later ones; yields the rounds of each message, each
    timed as its share of the time since the previous message (so the K controller learns what a round costs in a
    run). The caller commits each message's rounds before asking for the next; closing the iterator early
    withdraws the call."""
    extra = logprobs_asked(state)
    if lookup is not None:
        extra["lookup"] = lookup
    answers = target.decode_run(state.session_id, state.tokens, state.target_synced, steps,
                                state.stop_ids | state.eos_ids, state.target_start, state.timeout(target.timeout),
                                answer_delay_us=int(answer_delay_s * 1e6), **extra)
    state.stats.target_calls += 1
    started = time.perf_counter()
    async with contextlib.aclosing(answers):
        async for verdict, wire in answers:
            state.stats.wire_bytes += wire
            state.stats.target_answers += 1
            for step in (*verdict.earlier, verdict):
                record_start(state, step, "target")
            answered = [step for step in (*verdict.earlier, verdict) if not step.missed]
            share, held = (time.perf_counter() - started) / max(len(answered), 1), len(state.tokens)
            rounds = [run_step(state, step, share, source) for step in answered]
            for round_ in rounds:                  # the target holds every committed token but the last
                state.target_synced = held + round_.accepted
                held += len(round_.committed)
            if rounds:
                yield rounds
            if verdict.missed:                     # its lookup found no match: the run ends
                return
            started = time.perf_counter()


def run_step(state: RequestState, step: worker_pb2.VerifyResponse, wall: float, source: int) -> Round:
    """A decode run's step as a round of `wall` seconds (recorded in the request's stats)."""
    compute, rtt, worker = split_wall(wall, step)
    timings = RoundTimings(verify_seconds=compute, rtt_seconds=rtt, batch_size=step.batch_size,
                           batch_tokens=step.batch_tokens, queue_depth=step.queue_depth)
    drafts, accepted = list(step.draft_token_ids), step.num_accepted
    round_ = Round(drafts, accepted, drafts[:accepted] + [step.next_token_id], timings,
                   source=NGRAM if drafts else source, logprobs=list(step.logprobs))
    round_.parts = round_parts(wall, NO_DRAFTS, False, timings, worker, 0.0)
    record(state.stats, round_)
    return round_


async def resilient_run(state: RequestState, target: TargetClient, steps: int, recovery_s: float, source: int,
                        answer_delay_s: float = 0.0, lookup: worker_pb2.PromptLookup | None = None
                        ) -> AsyncIterator[list[Round]]:
    """decode_run surviving a target failure as resilient_round does: the run goes on, re-prefilled, for the
    tokens it has left. Each outage has its own `recovery_s`: an answer after a recovery ends the outage, so a
    later failure of a long run waits its full bound again."""
    give_up = None
    while steps > 0:
        try:
            async with contextlib.aclosing(decode_run(state, target, steps, source, answer_delay_s, lookup)) as run:
                async for rounds in run:
                    give_up = None
                    steps -= sum(len(round_.committed) for round_ in rounds)
                    yield rounds
            return
        except grpc.aio.AioRpcError as exc:
            give_up = await recover_target(state, target, exc, give_up, recovery_s)
