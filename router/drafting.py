"""A round's drafts and its pre-draft: the draft worker's calls (draft_call; chained_call, a draft call with the next
round's pre-draft chained to it, speculation.chain_predrafts; predraft), drafts handed straight to the target
(hand_off, speculation.hand_off) and prompt-lookup drafts the router makes itself (ngram_proposal). A draft worker
that is unreachable costs the round its drafts, never the request."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from typing import AsyncIterator, Awaitable, Callable

import grpc

from protos.specpool.v1 import worker_pb2
from router.overlap import cancel, guesses
from router.request_state import MODEL, NGRAM, NO_DRAFTS, WORKER_DOWN, Proposal, RequestState, logprobs_asked
from router.request_stats import record_start
from router.round_timing import split_time
from router.worker_client import DraftClient, TargetClient


async def draft_call(state: RequestState, draft: DraftClient, tokens: list[int], synced: int, k: int,
                     branches: list[tuple[int, int]] = (), hand_to: tuple[str, int] = ("", 0)) -> Proposal | None:
    """K draft tokens after `tokens`, of which the draft holds `synced`, each with its runner-up and third choice
    (and the drafts of each branch (j, token): Proposal.branches; with `hand_to`, also handed to that target). A
    draft worker that is unreachable costs the round its drafts, not the request (None: plain decoding)."""
    started, state.draft_called = time.perf_counter(), True
    try:
        response, wire = await draft.propose(state.session_id, tokens, synced, k, state.session_start,
                                             state.draft_mode, state.timeout(draft.timeout), runner_ups=True,
                                             branches=[(len(state.tokens) + j, t) for j, t in branches],
                                             hand_to=hand_to, committed=len(state.tokens))
    except grpc.aio.AioRpcError as exc:
        return draft_lost(state, draft, exc)
    return drafted(state, response, wire, started, branches)


def draft_lost(state: RequestState, draft: DraftClient, exc: grpc.aio.AioRpcError) -> None:
    """A draft call's failure: an unreachable draft worker, or one out of device memory for this request (it serves
    on, without this session), costs the round its drafts (None); past the client's deadline the request is over,
    not the draft worker, and any other failure is the request's (raised)."""
    out_of_memory = exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    if not (out_of_memory or exc.code() in WORKER_DOWN) or state.timeout(1.0) <= 0:
        raise exc
    if out_of_memory:
        state.count_out_of_memory("draft")
    else:
        draft.mark_failed(exc)
    state.draft_synced = 0            # whatever comes back up, or the worker that dropped the session, has no cache


def drafted(state: RequestState, response: worker_pb2.ProposeResponse, wire: int, started: float,
            branches: list[tuple[int, int]]) -> Proposal:
    """A draft call's answer, sent at `started`, as a Proposal (its branches keyed by the points (j, token))."""
    state.stats.wire_bytes += wire
    record_start(state, response, "draft")
    timing = split_time(started, response)
    return Proposal(list(response.draft_token_ids), response.draft_hidden_states, *timing,
                    runner_ups=list(response.runner_up_token_ids), thirds=list(response.third_choice_token_ids),
                    branches={point: Proposal(list(b.token_ids), b.hidden_states, *timing, cached=False,
                                              runner_ups=list(b.runner_up_token_ids),
                                              thirds=list(b.third_choice_token_ids))
                              for point, b in zip(branches, response.branch_drafts) if b.token_ids})


async def chained_call(state: RequestState, draft: DraftClient, k: int, next_k: int, branches,
                       hand_to: tuple[str, int], first: asyncio.Future) -> Proposal | None:
    """A draft call with the next round's pre-draft chained to it (speculation.chain_predrafts): its K drafts go to
    `first` (None: the draft worker is unreachable) and the worker pre-drafts right after them, with no router
    round trip between: `next_k` drafts past a guess, and the planned rejection `branches` (j, rank) the drafts
    have (guesses). Returns that pre-draft, as predraft's task does (None where it was lost)."""
    then = worker_pb2.ChainedPredraft(k=next_k + 1, branch_at=[j for j, _ in branches],
                                      branch_rank=[rank for _, rank in branches])
    started, state.draft_called = time.perf_counter(), True
    answers = draft.propose_chained(state.session_id, state.tokens, state.draft_synced, k, state.session_start,
                                    state.draft_mode, state.timeout(draft.timeout), then, hand_to,
                                    committed=len(state.tokens))
    async with contextlib.aclosing(answers):
        proposal = await handing_to(first, first_drafts(state, draft, answers, started))
        if proposal is None:
            return None
        state.stats.predrafts += 1
        started = time.perf_counter()
        try:
            response, wire = await anext(answers)
        except StopAsyncIteration:             # a draft worker that does not chain: no pre-draft
            return None
        except grpc.aio.AioRpcError as exc:    # lost (the worker is down, or the session was evicted)
            return draft_lost(state, draft, exc) if exc.code() in WORKER_DOWN else None
    started = min(started, time.perf_counter() - response.handler_us / 1e6)    # it began before the drafts got here
    return drafted(state, response, wire, started, guesses(proposal, branches))


async def first_drafts(state: RequestState, draft: DraftClient, answers: AsyncIterator, started: float
                       ) -> Proposal | None:
    """A chained call's first answer, its drafts (None: the draft worker is unreachable, as draft_call's)."""
    try:
        return drafted(state, *await anext(answers), started, ())
    except grpc.aio.AioRpcError as exc:
        return draft_lost(state, draft, exc)


async def handing_to(first: asyncio.Future, call: Awaitable):
    """`call`'s outcome, handed to `first` as well, unless whoever waited there gave up."""
    try:
        result = await call
    except BaseException as exc:
        if not first.done():
            first.cancel() if isinstance(exc, asyncio.CancelledError) else first.set_exception(exc)
        raise
    if not first.done():
        first.set_result(result)
    return result


async def propose_chained(state: RequestState, draft: DraftClient, k: int, next_k: int, branches,
                          hand_to: TargetClient | None = None) -> tuple[Proposal, asyncio.Task | None]:
    """propose's K model drafts, the next round's pre-draft chained to them on the draft worker (chained_call), and
    that pre-draft's task (None, with n-gram drafts instead, where the draft worker was unreachable)."""
    loop, calls = asyncio.get_running_loop(), []

    def drafting(to: tuple[str, int]) -> asyncio.Future:
        first = loop.create_future()
        calls.append(loop.create_task(chained_call(state, draft, k, next_k, branches, to, first)))
        return first
    try:
        proposal = await (hand_off(state, hand_to, k, drafting) if hand_to is not None else drafting(("", 0)))
    except BaseException:
        await cancel(calls[0] if calls else None)
        raise
    if proposal is None or proposal.source != MODEL or not proposal.tokens:
        await cancel(calls[0])
        return proposal or ngram_proposal(state, k), None
    return proposal, calls[0]


def ngram_proposal(state: RequestState, k: int) -> Proposal:
    """Up to K drafts by prompt lookup, timed as the draft compute of the round (no call, no round trip)."""
    if k == 0 or state.ngram is None:
        return NO_DRAFTS
    started = time.perf_counter()
    tokens = state.ngram.propose(state.tokens, k)
    return Proposal(tokens, seconds=time.perf_counter() - started, source=NGRAM) if tokens else NO_DRAFTS


async def propose(state: RequestState, draft: DraftClient | None, k: int, source: int = MODEL,
                  hand_to: TargetClient | None = None) -> Proposal:
    """This round's K drafts, drafted now (on the critical path), from `source`; model drafts `hand_to` the target
    straight from the draft worker, if given (hand_off). A draft worker that turns out to be unreachable leaves the
    round n-gram drafts (if the context has a match)."""
    if k == 0 or source == NGRAM:
        return ngram_proposal(state, k)
    if draft is None or not draft.healthy:
        return NO_DRAFTS
    if hand_to is not None:
        return await hand_off(state, hand_to, k, lambda to: draft_call(state, draft, state.tokens, state.draft_synced,
                                                                       k, hand_to=to))
    return await draft_call(state, draft, state.tokens, state.draft_synced, k) or ngram_proposal(state, k)


HANDOFF_IDS = itertools.count(1)


async def hand_off(state: RequestState, target: TargetClient, k: int,
                   drafting: Callable[[tuple[str, int]], Awaitable[Proposal | None]]) -> Proposal:
    """K model drafts handed straight to the target (speculation.hand_off, engine/handoff.py): the verify call goes
    out beside the draft call (`drafting(hand_to)`: draft_call's or chained_call's drafts) and waits on the target
    for them, and the router's copy follows once the draft's answer is here. The proposal's `staged` is that call.
    An unreachable draft worker withdraws it."""
    handoff_id, sent = next(HANDOFF_IDS), time.perf_counter()
    waiting = asyncio.ensure_future(target.verify(
        state.session_id, state.tokens, state.target_synced, [], b"", state.target_start,
        state.timeout(target.timeout), handoff_id=handoff_id, **logprobs_asked(state)))
    try:
        proposal = await drafting((target.address, handoff_id))
    except BaseException:
        await cancel(waiting)
        raise
    if proposal is None:
        await cancel(waiting)
        return ngram_proposal(state, k)
    copy = worker_pb2.DraftHandoff(session_id=state.session_id, handoff_id=handoff_id, draft_token_ids=proposal.tokens,
                                   draft_hidden_states=proposal.hidden, from_router=True)
    target.handoffs.send(copy)
    state.stats.wire_bytes += copy.ByteSize()
    proposal.staged, proposal.handed_at = waiting, sent
    return proposal


def predraft(state: RequestState, draft: DraftClient | None, proposal: Proposal, next_k: int,
             branches: list[tuple[int, int]]) -> asyncio.Task | None:
    """Send the pre-draft, to run while the target verifies the proposal's drafts: past them, a guess of the
    target's next token and then `next_k` drafts of the next round; and for each rejection branch (j, token),
    `next_k` drafts after "drafts[:j], then token" (the task's result: that Proposal, or None if the draft is
    unreachable). The draft holds the committed tokens and drafts[:-1] (what proposing them cached), or for
    drafts of a branch, the committed tokens it is synced to."""
    if next_k == 0 or draft is None or not draft.healthy:
        return None
    drafts = proposal.tokens
    held = len(state.tokens) + len(drafts) - 1 if drafts and proposal.cached else state.draft_synced
    state.stats.predrafts += 1
    return asyncio.get_running_loop().create_task(
        draft_call(state, draft, state.tokens + drafts, held, next_k + 1, branches))
