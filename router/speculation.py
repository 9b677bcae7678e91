"""The speculative loop, run by the router for each request.

One round: the draft worker appends the newly committed tokens to its cache and proposes K tokens;
the target worker runs one forward over its new tokens plus the K drafts and rejection-samples
them, answering how many it accepted and the next token. The router commits those tokens and is
the source of truth for them: each worker's `synced` count says how many committed tokens its
cache holds, so a round sends only what is new, and a worker that lost its cache is re-prefilled.

With overlap on, while the target verifies round r the draft already drafts round r+1 after the likeliest
verdicts (router/overlap.py), so that a verdict it guessed sends the next verify at once. A request's first round
(`speculation.prefill_first`; greedy-draft mode) verifies no drafts: the target prefills and answers the first
token while the pre-draft beside it prefills the draft, guesses that token and drafts round 2, so the first token
waits for no draft work.

The parts, one module each: the request's state and a round's data (router/request_state.py); the drafts and the
pre-draft (router/drafting.py); what follows a pre-draft (router/overlap.py); choosing each round's source and K
(router/round_plan.py); decode runs (router/decode_runs.py); a round's time split (router/round_timing.py); the
request's stats (router/request_stats.py); the wait for a failed target (router/recovery.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import AsyncIterator

import grpc

from protos.specpool.v1 import generation_pb2
from router.controller import RoundTimings
from router.decode_runs import resilient_run
from router.drafting import predraft, propose, propose_chained
from router.overlap import StagedCall, cancel, correction_guessed, guesses, settle, staged_answer, sync_draft
from router.recovery import recover_target
from router.request_state import MODEL, NGRAM, KPolicy, Proposal, RequestState, Round, clamp_k, logprobs_asked
from router.request_stats import record, record_start
from router.round_plan import choose_k, lookup_first, ngram_round_k, plan_round, predraft_k, prefill_alone, \
    run_plan
from router.round_timing import round_parts, split_handed, split_time
from router.worker_client import DraftClient, TargetClient


async def speculative_round(state: RequestState, draft: DraftClient | None, target: TargetClient, k: int,
                            ready: Proposal | None = None, next_k: int = 0,
                            source: int = MODEL, branches: tuple = (), stage: bool = False, hand: bool = False,
                            chain: bool = False) -> tuple[Round, Proposal | None]:
    """Draft K from `source` (or take the `ready` drafts a pre-draft made; model drafts `hand`ed straight to the
    target), verify them in one target pass and, with `next_k` > 0 after model drafts, pre-draft the next round
    meanwhile (with the rejection `branches` planned, (j, 0: runner-up | 1: third choice); `chain`ed to the draft
    call, if there is one; `stage`d on the target if back before the verdict). Returns the round and the next
    round's drafts if the pre-draft matched the verdict (with the staged call verifying them already, if any)."""
    before, started = len(state.tokens), time.perf_counter()
    catch_up = (0 if ready is not None else before - state.draft_synced, before - state.target_synced)
    proposal, points, ahead = await drafts_and_predraft(state, draft, target if hand else None, k, ready, next_k,
                                                        source, branches, chain)
    staging = StagedCall(state, target, ahead, len(proposal.tokens)) if ahead and stage else None
    try:
        verdict, verify_worker, timings, staged = await verify(state, target, proposal)
    except BaseException:
        if staging is not None:
            staging.cancel()
        await cancel(ahead)
        raise
    if staging is not None:
        staging.close()
    drafts, accepted = proposal.tokens, verdict.num_accepted
    timings.predraft_beside = ahead is not None
    timings.draft_catch_up, timings.target_catch_up = catch_up
    round_ = Round(drafts, accepted, drafts[:accepted] + [verdict.next_token_id], timings, ready is not None,
                   ahead is not None, source=proposal.source if drafts else source,
                   logprobs=list(verdict.logprobs))
    round_.from_branch, round_.staged = ready is not None and not ready.cached, staged
    if proposal.handed:
        round_.handed = "router" if verdict.handoff_from_router else "draft"
    if ready is not None:
        timings.draft_tokens = len(drafts) + 1           # the pre-draft also drafted the guess
    timings.branch_hit, timings.third_hit = correction_guessed(proposal, round_)
    settling = time.perf_counter()
    next_ready = await settle(ahead, round_, points)
    if next_ready is not None and staging is not None:
        next_ready.staged = staging.task
    round_.parts = round_parts(time.perf_counter() - started, proposal, ready is not None, timings, verify_worker,
                               time.perf_counter() - settling)
    state.target_synced = before + accepted
    sync_draft(state, draft, round_, proposal, before, next_ready)
    record(state.stats, round_)
    return round_, next_ready


async def drafts_and_predraft(state: RequestState, draft: DraftClient | None, hand_to: TargetClient | None, k: int,
                              ready: Proposal | None, next_k: int, source: int, branches, chain: bool
                              ) -> tuple[Proposal, list[tuple[int, int]], asyncio.Task | None]:
    """The round's drafts (speculative_round's), the rejection branches its pre-draft carries (guesses) and that
    pre-draft's task: chained to the draft call where the round drafts with the model now and pre-drafts
    (`chain`), else sent once the drafts are known."""
    if chain and ready is None and next_k and k and source == MODEL and draft is not None and draft.healthy:
        proposal, ahead = await propose_chained(state, draft, k, clamp_k(state, next_k, k + 1), branches, hand_to)
        return proposal, guesses(proposal, branches), ahead
    proposal = ready if ready is not None else await propose(state, draft, k, source, hand_to)
    points = guesses(proposal, branches)
    if proposal.tokens and proposal.source != MODEL:
        return proposal, points, None
    return proposal, points, predraft(state, draft, proposal, clamp_k(state, next_k, len(proposal.tokens) + 1), points)


async def verify(state: RequestState, target: TargetClient, proposal: Proposal) -> tuple:
    """One target pass over the new tokens + the drafts, or the answer of the staged or handed-off call that
    asked for it already: (verdict, the target's queue + thread hop seconds, the round's RoundTimings, whether it
    was a staged call)."""
    started = time.perf_counter()
    answer = await staged_answer(proposal)
    if answer is None:
        answer = await target.verify(state.session_id, state.tokens, state.target_synced, proposal.tokens,
                                     proposal.hidden, state.target_start, state.timeout(target.timeout),
                                     **logprobs_asked(state))
    verdict, wire = answer
    state.stats.wire_bytes += wire
    record_start(state, verdict, "target")
    state.stats.target_calls += 1
    state.stats.target_answers += 1
    verify_s, rtt_s, worker_s = split_handed(proposal, verdict) if proposal.handed else \
        split_time(started, verdict, staged=proposal.staged is not None)
    return verdict, worker_s, RoundTimings(
        draft_seconds=proposal.seconds, draft_rtt_seconds=proposal.rtt_seconds, verify_seconds=verify_s,
        rtt_seconds=rtt_s, batch_size=verdict.batch_size, batch_tokens=verdict.batch_tokens,
        queue_depth=verdict.queue_depth), proposal.staged is not None and not proposal.handed


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


def conclude(state: RequestState, policy: KPolicy, round_: Round, between: float | None) -> list[int]:
    """The router's side of a finished round: the policy learns from it, its tokens are committed (up to a stop)
    with their logprobs; returns the committed tokens."""
    round_.timings.between_seconds = between
    if round_.source == NGRAM and round_.k and state.ngram is not None:   # the tokens are the round's context
        found = state.ngram.match(state.tokens)
        round_.match_size, round_.predicted = (found.size, found.predicted) if found else (0, False)
    policy.observe(state, round_)
    committed = commit(state, round_.committed)
    state.logprobs.extend(round_.logprobs[:len(committed)])
    return committed


def conclude_all(state: RequestState, policy: KPolicy, rounds: list[Round], between: float | None) -> list[int]:
    """conclude() for rounds that arrived together (one message of a decode run), up to the one that finishes
    the request; returns all they committed."""
    committed: list[int] = []
    for round_ in rounds:
        committed += conclude(state, policy, round_, between)
        if state.finish_reason:
            break
        between = None
    return committed


async def resilient_round(state: RequestState, draft: DraftClient | None, target: TargetClient, k: int,
                          recovery_s: float, ready: Proposal | None = None, next_k: int = 0,
                          source: int = MODEL, branches: tuple = (), stage: bool = False, hand: bool = False,
                          chain: bool = False) -> tuple[Round, Proposal | None]:
    """A round that survives a target failure: wait for the target group to be restarted, then run the
    round again; the restarted target has no cache, so it is re-prefilled. The round gives up (re-raising
    the failure) `recovery_s` after its first failure, or at the client's deadline if that comes sooner."""
    give_up = None
    while True:
        try:
            return await speculative_round(state, draft, target, k, ready, next_k, source, branches, stage, hand,
                                           chain)
        except grpc.aio.AioRpcError as exc:
            give_up = await recover_target(state, target, exc, give_up, recovery_s)


async def generate(state: RequestState, draft: DraftClient | None, target: TargetClient,
                   policy: KPolicy, recovery_s: float = 60.0) -> AsyncIterator[list[int]]:
    """Run rounds until the request finishes, yielding each round's committed tokens. With overlap on,
    each model round pre-drafts the next one (its K chosen now) while the target verifies; a round at K = 0
    or of a request that drafts only by prompt lookup is a decode run of several tokens (run_plan), whose rounds
    that arrive together are yielded together. A model round that drafts now and pre-drafts the next can have the
    draft worker start that pre-draft right after its drafts (speculation.chain_predrafts). A model round hands
    its drafts straight to the target (speculation.hand_off) where it pre-drafts nothing beside its verify, or
    chains its pre-draft: one that sent its pre-draft itself would start its verify sooner but its pre-draft no
    sooner, leaving the pre-draft less time. A round that a pre-draft hit made a model round pre-drafts nothing
    where prompt lookup would have been planned (lookup_first). A decode run ends where the request drops its prediction
    (router/prediction.py), so that the next one tells the target. However the request ends, the workers' caches
    for this session (the draft's if a draft call was sent) are released, in the background (release_later)."""
    ready, planned, ended = None, None, None
    try:
        while not state.finish_reason:
            between = None if ended is None else time.perf_counter() - ended
            source, k = (MODEL, len(ready.tokens)) if ready else plan_round(state, draft, policy, planned)
            state.target_sessions = target.outstanding
            steps, lookup = (1, None) if ready else run_plan(state, draft, policy, source, k)
            if steps > 1:
                run = resilient_run(state, target, steps, recovery_s, source, policy.answer_delay_s(state), lookup)
                predicting = state.predicting
                async with contextlib.aclosing(run) as messages:
                    async for rounds in messages:
                        committed, between = conclude_all(state, policy, rounds, between), None
                        ended = time.perf_counter()
                        yield committed
                        if state.finish_reason or state.predicting != predicting:   # a dropped prediction: the
                            break                                   # next run's lookup tells the target
                planned = None
                continue
            if source == NGRAM:            # drafts the router looks up itself (decode runs off)
                k = ngram_round_k(state, policy, k)
            overlap = policy.overlap and source == MODEL and not (ready and lookup_first(state, draft, policy))
            planned = choose_k(state, policy) if overlap else None
            if overlap and prefill_alone(state, policy, ready, k):
                planned, k = k, 0
            next_k = predraft_k(policy, planned)
            chain = bool(next_k) and policy.chain_predrafts
            round_, ready = await resilient_round(state, draft, target, k, recovery_s, ready, next_k, source,
                                                  policy.predraft_branches(state, k) if next_k else (),
                                                  overlap and policy.stage_predrafts,
                                                  policy.hand_off and (not next_k or chain), chain)
            committed, ended = conclude(state, policy, round_, between), time.perf_counter()
            yield committed
    finally:
        release_later(state.session_id, [target] + ([draft] if draft is not None and state.draft_called else []))


_RELEASING: set = set()     # releases in flight, each held here until done (the event loop keeps weak references)


def release_later(session_id: int, workers: list) -> None:
    """Free the workers' caches for the session in the background, so that the request's last message and
    status go out at once: awaiting the release held up a demo-pair request's end by 1.3-1.8 ms. A request that
    ends has withdrawn its calls and cancelled its pre-draft already, so none re-creates the session after."""
    task = asyncio.ensure_future(release(session_id, workers))
    _RELEASING.add(task)
    task.add_done_callback(_RELEASING.discard)


async def releases_done() -> None:
    """Wait for this event loop's releases in flight (the router's shutdown; tests)."""
    loop = asyncio.get_running_loop()
    await asyncio.gather(*(task for task in list(_RELEASING) if task.get_loop() is loop), return_exceptions=True)


async def release(session_id: int, workers: list) -> None:
    """Best-effort: a worker that is down has lost the cache anyway; LRU eviction is the backstop."""
    # Shielded: a request cancelled again while releasing (its deadline, the client) still frees both caches.
    await asyncio.shield(asyncio.gather(*(w.release(session_id) for w in workers), return_exceptions=True))
