"""The speculative loop, run by the router for each request.

One round: the draft worker appends the newly committed tokens to its cache and proposes K tokens;
the target worker runs one forward over its new tokens plus the K drafts and rejection-samples
them, answering how many it accepted and the next token. The router commits those tokens and is
the source of truth for them: each worker's `synced` count says how many committed tokens its
cache holds, so a round sends only what is new, and a worker that lost its cache is re-prefilled.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

import grpc

from protos.specpool.v1 import generation_pb2, worker_pb2
from router.worker_client import DraftClient, TargetClient


@dataclass
class RequestState:
    """Everything the router knows about one request in flight."""
    session_id: int
    tokens: list[int]                      # prompt + committed output
    prompt_len: int
    max_new_tokens: int
    sampling: generation_pb2.SamplingParams  # normalised: top_p and seed always set
    fixed_k: int | None                    # the request's own K, or None for the router's policy
    draft_mode: int                        # worker_pb2.DRAFT_MODE_*
    max_context: int
    stop_ids: frozenset = frozenset()
    eos_ids: frozenset = frozenset()
    draft_synced: int = 0                  # committed tokens held in the draft worker's cache
    target_synced: int = 0                 # committed tokens held in the target worker's cache
    finish_reason: int = generation_pb2.FINISH_REASON_UNSPECIFIED
    controller: object = None              # the request's own KController (router.k_selection)
    deadline: float | None = None          # time.monotonic() by which the client wants its answer
    stats: generation_pb2.GenerationStats = field(default_factory=generation_pb2.GenerationStats)

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    def timeout(self, limit: float) -> float:
        """A worker call's timeout: `limit`, or less if the client's deadline comes sooner."""
        return limit if self.deadline is None else max(0.0, min(limit, self.deadline - time.monotonic()))


@dataclass
class Round:
    """What one round did and what it cost (seconds), for the K controller and the metrics."""
    k: int
    accepted: int
    tokens: list[int]
    draft_seconds: float = 0.0       # the draft worker's compute
    draft_rtt_seconds: float = 0.0   # the rest of the draft call
    verify_seconds: float = 0.0      # the target worker's compute
    rtt_seconds: float = 0.0         # the rest of the verify call
    batch_size: int = 1              # rows in the target forward that verified this round
    batch_tokens: int = 0            # tokens in that forward
    queue_depth: int = 0             # verify calls waiting at the target meanwhile


class KPolicy(Protocol):
    def choose_k(self, state: "RequestState") -> int: ...
    def observe(self, state: "RequestState", round_: Round) -> None: ...


def clamp_k(state: RequestState, k: int) -> int:
    """No drafts past max_new_tokens (a round commits up to K + 1) or past the context window."""
    remaining = state.max_new_tokens - state.generated
    room = state.max_context - len(state.tokens) - 1 if state.max_context else k
    return max(0, min(k, remaining - 1, room))


def split_time(started: float, response) -> tuple[float, float]:
    """(worker compute, the rest of the call) in seconds, from the worker's compute_us stamp."""
    total = time.perf_counter() - started
    compute = min(response.compute_us / 1e6, total)
    return compute, total - compute


async def propose(state: RequestState, draft: DraftClient, k: int, round_: Round) -> bytes:
    """Fill round_.tokens with K drafts; returns their hidden states (sampled mode). A draft worker that
    is unreachable costs this round its drafts, not the request: the round runs as plain decoding."""
    if not draft.healthy:
        return b""
    started = time.perf_counter()
    try:
        response, wire = await draft.propose(state.session_id, state.tokens, state.draft_synced, k,
                                             state.sampling, state.draft_mode, state.timeout(draft.timeout))
    except grpc.aio.AioRpcError as exc:
        if exc.code() not in WORKER_DOWN:
            raise
        draft.mark_failed()
        state.draft_synced = 0            # whatever comes back up has no cache for us
        return b""
    round_.draft_seconds, round_.draft_rtt_seconds = split_time(started, response)
    state.stats.wire_bytes += wire
    round_.tokens = list(response.draft_token_ids)
    return response.draft_hidden_states


async def speculative_round(state: RequestState, draft: DraftClient | None, target: TargetClient,
                            k: int) -> Round:
    """Draft K, verify them in one target pass; the round's tokens are the 1..K+1 the target committed to."""
    committed_before = len(state.tokens)
    round_ = Round(k=0, accepted=0, tokens=[])
    hidden = await propose(state, draft, k, round_) if k > 0 and draft else b""
    drafts = round_.tokens
    started = time.perf_counter()
    verdict, wire = await target.verify(state.session_id, state.tokens, state.target_synced, drafts, hidden,
                                        state.sampling, state.timeout(target.timeout))
    round_.verify_seconds, round_.rtt_seconds = split_time(started, verdict)
    round_.k, round_.accepted = len(drafts), verdict.num_accepted
    round_.batch_size, round_.batch_tokens, round_.queue_depth = \
        verdict.batch_size, verdict.batch_tokens, verdict.queue_depth
    if drafts:   # the draft cached the committed tokens and its first K-1 drafts
        state.draft_synced = committed_before + min(round_.accepted, len(drafts) - 1)
    state.target_synced = committed_before + round_.accepted
    record(state.stats, round_, wire)
    round_.tokens = drafts[:round_.accepted] + [verdict.next_token_id]
    return round_


def record(stats: generation_pb2.GenerationStats, round_: Round, wire: int) -> None:
    stats.wire_bytes += wire
    stats.target_passes += 1
    stats.draft_tokens += round_.k
    stats.accepted_tokens += round_.accepted
    stats.k_per_round.append(round_.k)


def commit(state: RequestState, new_tokens: list[int]) -> list[int]:
    """Append tokens until a stop token, EOS or max_new_tokens; returns what was committed."""
    committed = []
    for token in new_tokens:
        state.tokens.append(token)
        committed.append(token)
        if token in state.stop_ids:
            state.finish_reason = generation_pb2.FINISH_REASON_STOP
        elif token in state.eos_ids:
            state.finish_reason = generation_pb2.FINISH_REASON_EOS
        elif state.generated >= state.max_new_tokens:
            state.finish_reason = generation_pb2.FINISH_REASON_LENGTH
        if state.finish_reason:
            break
    return committed


async def resilient_round(state: RequestState, draft: DraftClient | None, target: TargetClient, k: int,
                          recovery_s: float) -> Round:
    """A round that survives a target failure: wait for the target group to be restarted, then run the
    round again; the restarted target has no cache, so it is re-prefilled. The round gives up (re-raising
    the failure) `recovery_s` after its first failure, or at the client's deadline if that comes sooner."""
    give_up = None
    while True:
        try:
            return await speculative_round(state, draft, target, k)
        except grpc.aio.AioRpcError as exc:
            now = time.monotonic()
            give_up = give_up if give_up is not None else now + recovery_s
            left = min(state.timeout(recovery_s), give_up - now)
            if exc.code() not in WORKER_DOWN or left <= 0:
                raise
            target.mark_failed()
            state.target_synced = 0
            try:
                await target.wait_recovered(left)
            except asyncio.TimeoutError:
                raise exc from None


async def generate(state: RequestState, draft: DraftClient | None, target: TargetClient,
                   policy: KPolicy, recovery_s: float = 60.0) -> AsyncIterator[list[int]]:
    """Run rounds until the request finishes, yielding each round's committed tokens.
    Both workers' caches for this session are released however the request ends."""
    try:
        while not state.finish_reason:
            k = clamp_k(state, state.fixed_k if state.fixed_k is not None else policy.choose_k(state))
            round_ = await resilient_round(state, draft, target, k, recovery_s)
            policy.observe(state, round_)
            yield commit(state, round_.tokens)
    finally:
        await release(state.session_id, [w for w in (draft, target) if w is not None])


async def release(session_id: int, workers: list) -> None:
    """Best-effort: a worker that is down has lost the cache anyway; LRU eviction is the backstop."""
    await asyncio.gather(*(w.release(session_id) for w in workers), return_exceptions=True)


WORKER_DOWN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL)
DRAFT_MODES = {"greedy": worker_pb2.DRAFT_MODE_GREEDY, "sampled": worker_pb2.DRAFT_MODE_SAMPLED}
