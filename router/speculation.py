"""The speculative loop, run by the router for each request.

One round: the draft worker appends the newly committed tokens to its cache and proposes K tokens;
the target worker runs one forward over its new tokens plus the K drafts and rejection-samples
them, answering how many it accepted and the next token. The router commits those tokens and is
the source of truth for them: each worker's `synced` count says how many committed tokens its
cache holds, so a round sends only what is new, and a worker that lost its cache is re-prefilled.

Overlap (draft-ahead). While the target verifies round r, the draft keeps going past r's drafts: it
guesses the target's next token and drafts round r+1 after it. Beside that main branch, in the same batched
steps, it drafts up to `predraft_branches` rejection branches: for draft position j, the verdict "the first j
drafts accepted, then the draft's runner-up at j" (the draft's next best token is the target's correction about
half the time on the demo pair), or "... then its third choice at j" (a second guess, right in about a fifth of
the rest), the likeliest ones first. If the verdict is one of the branches, round r+1's drafts are ready and its
verify goes out at once; any other verdict cancels the pre-draft and r+1 drafts as usual. Drafts are only
proposals, so this changes which tokens are proposed, never the distribution of what is committed. A pre-draft
that is back before the verdict is staged on the target (`speculation.stage_predrafts`, StagedCall): the target
holds its candidates and, the moment its verdict matches one, starts verifying round r+1 itself, so a hit costs
no round trip through the router either. A request's first round (`speculation.prefill_first`; greedy-draft mode)
verifies no drafts: the target prefills and answers the first token while the pre-draft beside it prefills the
draft, guesses that token and drafts round 2, so the first token waits for no draft work.

Proposal sources (`draft.method`). A round's drafts come from the draft model (the draft worker) or from prompt
lookup (engine/ngram.py: the continuation of an earlier occurrence of the context's last n tokens, computed here
in the router with no call, or by the target itself in a decode run, below). An n-gram proposal is
deterministic, so it is verified exactly as a greedy draft (q one-hot: no hidden states travel, and the target
verifies any request whose drafts come without them that way, whatever the pool's draft mode). With
`model+ngram` the policy picks, each round that has a match, the source its statistics model faster; n-gram
rounds send no pre-draft. While the draft worker is unreachable, rounds use n-gram proposals where the context
has a match (instead of plain decoding).

Decode runs. A round at K = 0 is one target call that decodes up to `decode_steps` tokens, with no round trip
between the target's steps; so is every round of a request whose only proposer is prompt lookup, the target then
looking up its own drafts, and an n-gram round of model+ngram, until a lookup misses (run_plan). The target
answers each step as it is sampled, or holds it up to `answer_delay_ms` (`unstreamed_answer_delay_ms` for a request
read whole, KSelector.answer_delay_s) to send several in one message. Each step is a round here, as it would have
been one call at a time.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Protocol

import grpc

from protos.specpool.v1 import generation_pb2, worker_pb2
from router.controller import RoundTimings
from engine.ngram import Match, NgramIndex
from router.worker_client import DraftClient, GaveUp, TargetClient

NONE, MODEL, NGRAM = (generation_pb2.PROPOSAL_SOURCE_NONE, generation_pb2.PROPOSAL_SOURCE_MODEL,
                      generation_pb2.PROPOSAL_SOURCE_NGRAM)
SOURCE_NAMES = {MODEL: "model", NGRAM: "ngram"}
PLAIN_PROBE_STEPS = 4   # the tokens of a decode run that probes plain decoding while the draft model holds K > 0


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
    draft_called: bool = False             # a draft call was sent (the draft worker may hold the session)
    target_synced: int = 0                 # committed tokens held in the target worker's cache
    finish_reason: int = generation_pb2.FINISH_REASON_UNSPECIFIED
    controller: object = None              # the request's own KController (router.k_selection)
    deadline: float | None = None          # time.monotonic() by which the client wants its answer
    stats: generation_pb2.GenerationStats = field(default_factory=generation_pb2.GenerationStats)
    method: str = "model"                  # draft.method: model | ngram | model+ngram
    ngram: NgramIndex | None = None        # the request's prompt-lookup index (None: no n-gram proposals, not
                                           # even as the fallback while the draft worker is down)
    stop_strings: tuple = ()               # matched on the decoded output by router.stopping
    top_logprobs: int | None = None        # set: the target answers each committed token's logprobs
    streamed: bool = True                  # the client reads the output as it comes (False: whole, at the end)
    logprobs: list = field(default_factory=list)   # ... generation_pb2.TokenLogprob per output token

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    def timeout(self, limit: float) -> float:
        """A worker call's timeout: `limit`, or less if the client's deadline comes sooner."""
        return limit if self.deadline is None else max(0.0, min(limit, self.deadline - time.monotonic()))


@dataclass
class Proposal:
    """What a draft call produced: its tokens (and their hidden states in sampled mode) and what it cost."""
    tokens: list[int] = field(default_factory=list)
    hidden: bytes = b""
    seconds: float = 0.0             # the draft worker's compute
    rtt_seconds: float = 0.0         # the rest of the call
    worker_seconds: float = 0.0      # ... of which the worker spent queued or handing over to its engine thread
    source: int = MODEL              # where the tokens came from (MODEL or NGRAM)
    runner_ups: list[int] = field(default_factory=list)   # the draft's runner-up at each draft (model drafts)
    thirds: list[int] = field(default_factory=list)       # ... and its third choice
    branches: dict = field(default_factory=dict)          # a pre-draft's rejection branches: {(drafts accepted,
                                                          # correction guessed): the next round's drafts after it}
    cached: bool = True              # the draft worker holds the context + tokens[:-1] (not so after a branch)
    staged: asyncio.Task | None = None   # a staged call verifying these drafts already: its (answer, wire bytes)
    handed_at: float | None = None   # ... or the handed-off call waiting on the target for them (hand_off), sent
                                     # then (time.perf_counter())
    handoff_wait: float | None = None   # ... which, answered, had waited this long there for them (seconds)

    @property
    def handed(self) -> bool:
        """Whether its drafts were handed off and the call waiting for them has not failed."""
        return self.handed_at is not None and self.staged is not None

    def after_guess(self) -> "Proposal":
        """A pre-draft is [guess of the target's next token, next round's drafts...]: the drafts alone."""
        row = len(self.hidden) // len(self.tokens) if self.tokens else 0
        return Proposal(self.tokens[1:], self.hidden[row:], self.seconds, self.rtt_seconds, self.worker_seconds,
                        runner_ups=self.runner_ups[1:], thirds=self.thirds[1:])


NO_DRAFTS = Proposal()


@dataclass
class Round:
    """What one round did: the drafts it verified, how many of them the target accepted, the tokens it
    committed to (the accepted drafts and the target's next token), and its costs for the K controller."""
    drafts: list[int]
    accepted: int
    committed: list[int]
    timings: RoundTimings
    predrafted: bool = False         # the drafts came from the previous round's pre-draft
    predraft_sent: bool = False      # this round pre-drafted the next one while the target verified
    from_branch: bool = False        # ... the previous round's pre-draft's rejection branch (Proposal.branches)
    staged: bool = False             # ... and the target had started verifying them itself (a staged call)
    handed: str = ""                 # a handed-off round (hand_off): whose copy of the drafts the target verified,
                                     # "draft" (the draft worker's, straight to the target) or "router"
    parts: dict = field(default_factory=dict)   # where the round's wall time went (seconds), see PARTS
    source: int = MODEL              # the drafts' source (for a round with no drafts: the one it planned)
    logprobs: list = field(default_factory=list)  # of `committed`, when the request asked for them
    match_size: int = 0              # n-gram drafts: the length of the context suffix they were looked up after

    @property
    def k(self) -> int:
        return len(self.drafts)


class KPolicy(Protocol):
    overlap: bool                    # pre-draft the next round while the target verifies
    predraft_k: int                  # ... with at most this many drafts after the guess
    stage_predrafts: bool            # ... staged on the target when back before the verdict (StagedCall)
    hand_off: bool                   # a round's model drafts go from the draft worker straight to the target
    chain_predrafts: bool            # a pre-draft starts on the draft worker right after the drafts it follows
    prefill_first: bool              # a request's first round at K = 0, pre-drafting the next beside the prefill
    decode_steps: int                # a decode run commits up to this many tokens in one target call
    def plain_run_steps(self, state: "RequestState") -> int: ...   # ... a plain one (no lookup) this many
    def answer_delay_s(self, state: "RequestState") -> float: ...   # ... whose answers the target may hold
                                                                      # this long to send them together
    def choose_k(self, state: "RequestState", source: int = ...) -> int: ...
    def held_k(self, state: "RequestState", source: int) -> int: ...   # the K it holds (no probe drawn)
    def predraft_branches(self, state: "RequestState", k: int) -> list[tuple[int, int]]: ...
                                      # rejection branches beside a pre-draft of K drafts: (j, 0 runner-up | 1 third)
    def choose_source(self, state: "RequestState", candidates: list[int], match_size: int = ...) -> int: ...
    def lookup_limits(self, state: "RequestState", k: int, with_model: bool) -> tuple[int, list[int]]: ...
                                      # (shortest n-gram match worth drafting from, most drafts per match length)
    def match_k(self, state: "RequestState", size: int, k: int) -> int: ...   # ... for one match length
    def observe(self, state: "RequestState", round_: Round) -> None: ...


def clamp_k(state: RequestState, k: int, ahead: int = 0) -> int:
    """No drafts past max_new_tokens (a round commits up to K + 1) or past the context window, counting
    `ahead` tokens not committed yet (a pre-draft is sized before this round's verdict)."""
    remaining = state.max_new_tokens - state.generated - ahead
    room = state.max_context - len(state.tokens) - ahead - 1 if state.max_context else k
    return max(0, min(k, remaining - 1, room))


def split_time(started: float, response, staged: bool = False) -> tuple[float, float, float]:
    """split_wall of a call sent at `started` and answered now; a `staged` call was sent before that, and the
    target started it by itself: its compute is kept whole (it may outlast the round's wall time), the rest of
    the round is transport, and its handler's time (mostly the wait for the verdict it followed) is nobody's."""
    if staged:
        compute = response.compute_us / 1e6
        return compute, max(time.perf_counter() - started - compute, 0.0), 0.0
    return split_wall(time.perf_counter() - started, response)


def split_wall(wall: float, response) -> tuple[float, float, float]:
    """(worker compute, the rest of `wall`, the part of that rest spent inside the worker's handler: queue and
    thread hop) in seconds, from the worker's compute_us and handler_us stamps."""
    compute = min(response.compute_us / 1e6, wall)
    handler = min(max(response.handler_us / 1e6, compute), wall)
    return compute, wall - compute, handler - compute


PARTS = ("draft_compute", "draft_worker", "draft_transport", "verify_compute", "verify_worker", "verify_transport",
         "predraft_wait", "router")


def round_parts(wall: float, proposal: Proposal, ready: bool, timings: RoundTimings, verify_worker: float,
                predraft_wait: float) -> dict:
    """Where a round's wall time went: each call on the critical path split into compute, worker-side
    overhead (queue, thread hop) and transport (serialisation, network, both gRPC stacks); the wait for a
    matching pre-draft; and the router's own work (the rest)."""
    draft = draft_parts(proposal, ready)
    waited = max(wall - sum(draft) - timings.rtt_seconds - predraft_wait, 0.0)   # a staged verify began earlier
    verify = (min(timings.verify_seconds, waited), verify_worker, timings.rtt_seconds - verify_worker)
    known = dict(zip(PARTS, (*draft, *verify, predraft_wait)))
    return {**known, "router": max(wall - sum(known.values()), 0.0)}


async def draft_call(state: RequestState, draft: DraftClient, tokens: list[int], synced: int, k: int,
                     branches: list[tuple[int, int]] = (), hand_to: tuple[str, int] = ("", 0)) -> Proposal | None:
    """K draft tokens after `tokens`, of which the draft holds `synced`, each with its runner-up and third choice
    (and the drafts of each branch (j, token): Proposal.branches; with `hand_to`, also handed to that target). A
    draft worker that is unreachable costs the round its drafts, not the request (None: plain decoding)."""
    started, state.draft_called = time.perf_counter(), True
    try:
        response, wire = await draft.propose(state.session_id, tokens, synced, k, state.sampling, state.draft_mode,
                                             state.timeout(draft.timeout), runner_ups=True,
                                             branches=[(len(state.tokens) + j, t) for j, t in branches],
                                             hand_to=hand_to)
    except grpc.aio.AioRpcError as exc:
        return draft_lost(state, draft, exc)
    return drafted(state, response, wire, started, branches)


def draft_lost(state: RequestState, draft: DraftClient, exc: grpc.aio.AioRpcError) -> None:
    """A draft call's failure: an unreachable draft worker costs the round its drafts (None); past the client's
    deadline the request is over, not the draft worker, and any other failure is the request's (raised)."""
    if exc.code() not in WORKER_DOWN or state.timeout(1.0) <= 0:
        raise exc
    draft.mark_failed(exc)
    state.draft_synced = 0            # whatever comes back up has no cache for us


def drafted(state: RequestState, response: worker_pb2.ProposeResponse, wire: int, started: float,
            branches: list[tuple[int, int]]) -> Proposal:
    """A draft call's answer, sent at `started`, as a Proposal (its branches keyed by the points (j, token))."""
    state.stats.wire_bytes += wire
    record_prefix(state, response, "draft")
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
    answers = draft.propose_chained(state.session_id, state.tokens, state.draft_synced, k, state.sampling,
                                    state.draft_mode, state.timeout(draft.timeout), then, hand_to)
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
        state.session_id, state.tokens, state.target_synced, [], b"", state.sampling, state.timeout(target.timeout),
        handoff_id=handoff_id, **logprobs_asked(state)))
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


def split_handed(proposal: Proposal, verdict: worker_pb2.VerifyResponse) -> tuple[float, float, float]:
    """split_time of a handed-off call: its compute; the rest of its own round trip (transport, and its worker side
    less the wait for the handoff); that worker side. Also sets the proposal's handoff_wait, the drafts' part of the
    round (router -> draft, drafting, draft -> target, less router -> target), and its rtt_seconds, that wait beyond
    the draft's compute. Where the call reached the target after the draft began (this machine's contention), the
    drafting before it is hidden behind the call's way there: the parts still add up to the round's wall time
    (draft_parts), while the K controller's cost (draft compute + both rtts) counts that overlap twice."""
    compute = verdict.compute_us / 1e6
    handler = max(verdict.handler_us / 1e6, compute)
    wait = proposal.handoff_wait = min(verdict.handoff_wait_us / 1e6, handler - compute)
    worker = handler - wait - compute
    proposal.rtt_seconds = max(wait - proposal.seconds, 0.0)
    return compute, max(time.perf_counter() - proposal.handed_at - handler, 0.0) + worker, worker


def draft_parts(proposal: Proposal, ready: bool) -> tuple[float, float, float]:
    """(compute, worker side, transport) of the round's draft call on its critical path: none for drafts that were
    ready; of a handed-off call, what its wait on the target for the drafts covered (drafting while the call was on
    its way to the target was off the critical path)."""
    if ready:
        return 0.0, 0.0, 0.0
    if proposal.handoff_wait is not None:
        compute = min(proposal.seconds, proposal.handoff_wait)
        worker = min(proposal.worker_seconds, proposal.handoff_wait - compute)
        return compute, worker, proposal.handoff_wait - compute - worker
    return proposal.seconds, proposal.worker_seconds, proposal.rtt_seconds - proposal.worker_seconds


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


async def verify(state: RequestState, target: TargetClient, proposal: Proposal) -> tuple:
    """One target pass over the new tokens + the drafts, or the answer of the staged or handed-off call that
    asked for it already: (verdict, the target's queue + thread hop seconds, the round's RoundTimings, whether it
    was a staged call)."""
    started = time.perf_counter()
    answer = await staged_answer(proposal)
    if answer is None:
        answer = await target.verify(state.session_id, state.tokens, state.target_synced, proposal.tokens,
                                     proposal.hidden, state.sampling, state.timeout(target.timeout),
                                     **logprobs_asked(state))
    verdict, wire = answer
    state.stats.wire_bytes += wire
    record_prefix(state, verdict, "target")
    state.stats.target_calls += 1
    state.stats.target_answers += 1
    verify_s, rtt_s, worker_s = split_handed(proposal, verdict) if proposal.handed else \
        split_time(started, verdict, staged=proposal.staged is not None)
    return verdict, worker_s, RoundTimings(
        draft_seconds=proposal.seconds, draft_rtt_seconds=proposal.rtt_seconds, verify_seconds=verify_s,
        rtt_seconds=rtt_s, batch_size=verdict.batch_size, batch_tokens=verdict.batch_tokens,
        queue_depth=verdict.queue_depth), proposal.staged is not None and not proposal.handed


def logprobs_asked(state: RequestState) -> dict:
    """The top_logprobs argument of a target call: only when the request asked for logprobs."""
    return {} if state.top_logprobs is None else {"top_logprobs": state.top_logprobs}


async def staged_answer(proposal: Proposal) -> tuple | None:
    """(verdict, wire bytes) of the staged or handed-off call that verified the proposal's drafts already (both
    are Proposal.staged); None when there was none or it did not verify them (it failed: the round sends its
    verify as usual, re-prefilling if need be)."""
    if proposal.staged is None:
        return None
    try:
        answer = await proposal.staged
    except grpc.aio.AioRpcError:
        answer = None
    if answer is None or answer[0].missed:
        proposal.staged = None
        return None
    return answer


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
                                state.stop_ids | state.eos_ids, state.sampling, state.timeout(target.timeout),
                                answer_delay_us=int(answer_delay_s * 1e6), **extra)
    state.stats.target_calls += 1
    started = time.perf_counter()
    async with contextlib.aclosing(answers):
        async for verdict, wire in answers:
            state.stats.wire_bytes += wire
            state.stats.target_answers += 1
            for step in (*verdict.earlier, verdict):
                record_prefix(state, step, "target")
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


async def settle(ahead: asyncio.Task | None, round_: Round, guesses: list[tuple[int, int]]) -> Proposal | None:
    """The next round's drafts if the pre-draft guessed this verdict, else None: all drafts accepted and the next
    token guessed (the main branch), or a rejection at j whose correction is a guess (j, correction) (a rejection
    branch); a pre-draft that can no longer match is cancelled. Records on the round's timings whether the main
    branch's guess was tried and right (guess_hit)."""
    if ahead is None:
        return None
    round_.timings.predraft_done, round_.timings.branches = ahead.done(), len(guesses)
    token, rejected = round_.committed[-1], round_.accepted < round_.k
    if rejected and (round_.accepted, token) not in guesses:
        await cancel(ahead)
        return None
    proposal = await ahead
    if proposal is None or not proposal.tokens:
        return None
    if not rejected:
        round_.timings.guess_hit = proposal.tokens[0] == token
    return next_drafts(proposal, round_.k).get((round_.accepted, token))


def next_drafts(predraft: Proposal, k: int) -> dict[tuple[int, int], Proposal]:
    """The next round's drafts a pre-draft of K drafts' successors made, by the verdict each one guessed,
    (drafts accepted, next token): all K accepted, then its guess of the bonus token (the main branch); a rejection
    at j, then a correction guessed there (a rejection branch)."""
    if not predraft.tokens:
        return {}
    return {(k, predraft.tokens[0]): predraft.after_guess(), **predraft.branches}


class StagedCall:
    """The staged call of a pre-draft (speculation.stage_predrafts): sent the moment the pre-draft is back, unless
    the verdict of the round beside it is back first (close()); its candidates are next_drafts' (none that
    would end the request). `task`: the call, answering (VerifyResponse, wire bytes), `missed` when the verdict
    was none of them."""

    def __init__(self, state: RequestState, target: TargetClient, ahead: asyncio.Task, k: int):
        self.state, self.target, self.k = state, target, k
        self.before, self.task = len(state.tokens), None
        ahead.add_done_callback(self._send)

    def _send(self, ahead: asyncio.Task) -> None:
        if self.state is None or ahead.cancelled() or ahead.exception() is not None or ahead.result() is None:
            return
        ends = self.state.stop_ids | self.state.eos_ids
        candidates = [worker_pb2.StagedDrafts(num_accepted=j, next_token_id=token, draft_token_ids=drafts.tokens,
                                              draft_hidden_states=drafts.hidden)
                      for (j, token), drafts in next_drafts(ahead.result(), self.k).items()
                      if token not in ends]
        if candidates:
            state = self.state
            self.task = asyncio.ensure_future(self.target.stage(
                state.session_id, self.before, candidates, state.timeout(self.target.timeout),
                **logprobs_asked(state)))
            self.task.add_done_callback(lambda task: task.cancelled() or task.exception())   # no unretrieved error

    def close(self) -> None:
        """The verdict is back: a pre-draft done after it is not staged."""
        self.state = None

    def cancel(self) -> None:
        self.close()
        if self.task is not None:
            self.task.cancel()


async def cancel(ahead: asyncio.Task | None) -> None:
    if ahead is not None:
        ahead.cancel()
        await asyncio.gather(ahead, return_exceptions=True)


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


def guesses(proposal: Proposal, branches) -> list[tuple[int, int]]:
    """The rejection branches a pre-draft of these drafts carries, (drafts accepted, the correction guessed), from
    the planned `branches` (j, 0: the draft's runner-up at j | 1: its third choice)."""
    choices = (proposal.runner_ups, proposal.thirds)
    return [(j, choices[rank][j]) for j, rank in branches
            if j < len(proposal.tokens) and j < len(choices[rank])]


def correction_guessed(proposal: Proposal, round_: Round) -> tuple[bool | None, bool | None]:
    """In a round that rejected draft j: was the draft's runner-up at j the target's correction, and if not, was
    its third choice (None: no rejection, no such guess known, or the runner-up was right)? The controller learns
    both rates from every rejection, branched or not (RoundTimings.branch_hit, third_hit)."""
    j, token = round_.accepted, round_.committed[-1]
    if j >= round_.k or j >= len(proposal.runner_ups):
        return None, None
    runner_up = proposal.runner_ups[j] == token
    return runner_up, None if runner_up or j >= len(proposal.thirds) else proposal.thirds[j] == token


def sync_draft(state: RequestState, draft: DraftClient | None, round_: Round, proposal: Proposal, before: int,
               next_ready: Proposal | None) -> None:
    """How many committed tokens the draft worker holds after the round (it had `before` committed)."""
    if next_ready is not None and next_ready.cached:     # main branch: the committed tokens + next drafts[:-1]
        state.draft_synced = before + len(round_.committed)
    elif next_ready is not None:                         # a rejection branch: the accepted drafts (the pre-draft
        state.draft_synced = before + round_.accepted    # ran on the main branch's row)
    elif proposal.source == MODEL and proposal.tokens and proposal.cached and draft.healthy:
        state.draft_synced = before + min(round_.accepted, len(proposal.tokens) - 1)   # committed + drafts[:-1]
    if next_ready is not None:
        state.stats.predraft_hits += 1
        state.stats.predraft_branch_hits += not next_ready.cached


def record_prefix(state: RequestState, response, pool: str) -> None:
    """A session start's prefix-cache lookup, if the `pool` worker's answer has one, added to the request's stats.
    The target's first one says how much of the prompt it found cached."""
    if not response.HasField("prefix_cache"):
        return
    field = f"{pool}_prefix_cache"
    if pool == "target" and not state.stats.HasField(field):
        state.stats.cached_prompt_tokens = min(response.prefix_cache.found, state.prompt_len)
    lookups = getattr(state.stats, field)
    lookups.looked_up += response.prefix_cache.looked_up
    lookups.found += response.prefix_cache.found


def record(stats: generation_pb2.GenerationStats, round_: Round) -> None:
    stats.target_passes += 1
    stats.draft_tokens += round_.k
    stats.accepted_tokens += round_.accepted
    stats.staged_rounds += round_.staged
    stats.handed_off_rounds += round_.handed == "draft"
    stats.handoffs_from_router += round_.handed == "router"
    stats.k_per_round.append(round_.k)
    stats.source_per_round.append(round_.source if round_.k else NONE)
    if round_.k:
        record_source(stats, round_)


def record_source(stats: generation_pb2.GenerationStats, round_: Round) -> None:
    """Proposed, accepted and per-position counts of the round's source."""
    entry = next((s for s in stats.sources if s.source == round_.source), None)
    if entry is None:
        entry = stats.sources.add(source=round_.source)
    entry.rounds += 1
    entry.draft_tokens += round_.k
    entry.accepted_tokens += round_.accepted
    for counts, upto in ((entry.proposed_per_position, round_.k), (entry.accepted_per_position, round_.accepted)):
        counts.extend([0] * (upto - len(counts)))
        for j in range(upto):
            counts[j] += 1


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


async def recover_target(state: RequestState, target: TargetClient, exc: grpc.aio.AioRpcError,
                         give_up: float | None, recovery_s: float) -> float:
    """After a target call failed with `exc`: wait for the target to be back (its cache is gone: the next call
    re-prefills) and return the time to give up at; re-raise `exc` when the failure is not the worker being
    down or the client's deadline has passed already, and raise GaveUp once the time to give up (recovery_s after
    the first failure, or the client's deadline) has come while the target was down."""
    now = time.monotonic()
    give_up = give_up if give_up is not None else now + recovery_s
    left = min(state.timeout(recovery_s), give_up - now)
    if exc.code() not in WORKER_DOWN or state.timeout(1.0) <= 0:
        raise exc
    target.mark_failed(exc)
    state.target_synced = 0
    try:
        if left <= 0:
            raise asyncio.TimeoutError
        await target.wait_recovered(left)
    except asyncio.TimeoutError:
        raise gave_up(state, target, recovery_s) from None
    return give_up


def gave_up(state: RequestState, target: TargetClient, recovery_s: float) -> GaveUp:
    """The error of a request that stopped waiting for its target: DEADLINE_EXCEEDED if the client's deadline came
    first, else UNAVAILABLE naming the recovery bound (logged once per outage). Either says what the target failed
    with, not the stale transport error of the request's last call."""
    cause = f"it failed with: {target.last_error or 'unknown error'}"
    if state.timeout(1.0) <= 0:
        return GaveUp(grpc.StatusCode.DEADLINE_EXCEEDED, f"{target.name} was down and had not recovered ({cause})")
    target.give_up(recovery_s)
    return GaveUp(grpc.StatusCode.UNAVAILABLE,
                  f"{target.name} did not recover within router.target_recovery_s = {recovery_s:g} s ({cause})")


def choose_k(state: RequestState, policy: KPolicy, source: int = MODEL) -> int:
    return state.fixed_k if state.fixed_k is not None else policy.choose_k(state, source)


def plan_round(state: RequestState, draft: DraftClient | None, policy: KPolicy,
               planned: int | None = None) -> tuple[int, int]:
    """This round's proposal source and K. Candidates: the draft model (methods model and model+ngram, while the
    draft worker is reachable) and prompt lookup (methods ngram and model+ngram, or as the fallback while the
    draft worker is not), when the context's suffix occurred before. `planned`: a model K already chosen."""
    model, lookup = model_allowed(state, draft), lookup_allowed(state, draft)
    found = state.ngram.match(state.tokens) if lookup else None
    candidates = [s for s, ok in ((MODEL, model), (NGRAM, found is not None)) if ok]
    if not candidates:
        return (MODEL if state.method != "ngram" else NGRAM), 0
    # A request with its own K takes n-gram drafts whenever they match: a rule that depends only on the tokens,
    # so a seeded request in sampled-draft mode (whose K is pinned for that reason) still gives one output.
    pick = len(candidates) > 1 and state.fixed_k is None
    source = policy.choose_source(state, candidates, found.size) if pick else candidates[-1]
    k = planned if source == MODEL and planned is not None else choose_k(state, policy, source)
    return source, clamp_k(state, k)


def ngram_round_k(state: RequestState, policy: KPolicy, k: int) -> int:
    """K of an n-gram round the router drafts itself: at most the drafts the policy finds worth proposing after
    a match as long as the one at hand, as a decode run's lookup drafts (KPolicy.match_k; none on its probe). A
    request with its own K drafts up to it after any match."""
    found = state.ngram.match(state.tokens)
    if state.fixed_k is not None or found is None:
        return k
    return policy.match_k(state, found.size, k)


def model_allowed(state: RequestState, draft: DraftClient | None) -> bool:
    """Whether rounds may take the draft model's drafts: methods model and model+ngram, while it is reachable."""
    return state.method != "ngram" and draft is not None and draft.healthy


def lookup_allowed(state: RequestState, draft: DraftClient | None) -> bool:
    """Whether rounds may take prompt-lookup drafts: methods ngram and model+ngram, or as the fallback while the
    draft worker is down (and only for a request that has an n-gram index)."""
    return state.ngram is not None and (state.method != "model" or not model_allowed(state, draft))


def run_plan(state: RequestState, draft: DraftClient | None, policy: KPolicy, source: int,
             k: int) -> tuple[int, worker_pb2.PromptLookup | None]:
    """Whether the round planned (source, K) is a decode run instead: (the tokens the run may commit in one target
    call, the prompt lookup its steps do: None for plain decoding); (1, None): a round as usual. Runs are: a
    round at K = 0 (plain decoding or, where prompt lookup may propose, the target looking up its own drafts at
    every step); every round of a request whose only proposer is prompt lookup (draft.method ngram, or the
    fallback while the draft worker is down), likewise; and an n-gram round of model+ngram, whose run ends at the
    first step that finds no match while the draft model holds a K > 0 (the next round may use it; at K = 0 the
    next round would be a lookup run again, so the run goes on: one call fewer per miss). The target looks those
    drafts up itself, with no round trip per round. A run is at most decode_steps tokens long, so that the
    policy plans again (a plain run: policy.plain_run_steps, longer under load; the policy's probe of plain
    decoding, plain_probe: PLAIN_PROBE_STEPS), but a request pinned to K = 0 with no lookup has nothing to plan:
    its run goes on to its end. decode_steps 1 turns runs off."""
    if policy.decode_steps <= 1:
        return 1, None
    probe = k == 0 and plain_probe(state, draft, policy)
    tokens = clamp_k(state, (PLAIN_PROBE_STEPS if probe else policy.decode_steps) - 1) + 1
    lookup, model = lookup_allowed(state, draft), model_allowed(state, draft)
    if not lookup:
        if state.fixed_k == 0:             # nothing to plan again: the run goes on to the request's end
            return clamp_k(state, state.max_new_tokens) + 1, None
        if k:
            return 1, None
        return (tokens if probe else clamp_k(state, policy.plain_run_steps(state) - 1) + 1), None
    if not model or k == 0:
        k = clamp_k(state, choose_k(state, policy, NGRAM))
        return tokens, prompt_lookup(state, policy, k, with_model=model)
    if source != NGRAM:
        return 1, None
    model_k = state.fixed_k if state.fixed_k is not None else policy.held_k(state, MODEL)
    return tokens, prompt_lookup(state, policy, k, with_model=True, planned_on=state.ngram.match(state.tokens),
                                 end_on_miss=model_k > 0)


def plain_probe(state: RequestState, draft: DraftClient | None, policy: KPolicy) -> bool:
    """Whether a round planned at K = 0 is the policy's probe of plain decoding (KController._probe_k): the
    draft model is up and its controller holds K > 0. Its run lasts PLAIN_PROBE_STEPS tokens, enough to time
    plain decoding: a whole run (decode_steps) at the K the policy had just rejected cost a heavy-pair request
    a third of its speed (a 96-token request at 39 tokens/s, against 51-84 for the 17 others that drew none)."""
    return state.fixed_k is None and model_allowed(state, draft) and policy.held_k(state, MODEL) > 0


def prompt_lookup(state: RequestState, policy: KPolicy, k: int, with_model: bool,
                  planned_on: Match | None = None, end_on_miss: bool = False) -> worker_pb2.PromptLookup:
    """The target's prompt lookup for a decode run: the request's n-gram sizes, up to k drafts per step (fewer
    after a match whose length the policy finds worth fewer), after matches at least as long as the policy finds
    worth it against the alternative (the draft model `with_model`, else plain decoding); the run ends at a step
    that finds no match if `end_on_miss`. A run `planned_on` a match is an n-gram round of model+ngram: it also
    drafts after matches as short as that one (a probe may have picked it). A request with its own K drafts up to
    it after any match (a rule of its tokens alone, as plan_round's)."""
    least, by_match = (0, []) if state.fixed_k is not None else policy.lookup_limits(state, k, with_model)
    if planned_on is not None:
        least = min(least, planned_on.size)
    return worker_pb2.PromptLookup(min_n=state.ngram.min_n, max_n=state.ngram.max_n, max_tokens=k,
                                   end_on_miss=end_on_miss, min_match=least, max_tokens_by_match=by_match)


def conclude(state: RequestState, policy: KPolicy, round_: Round, between: float | None) -> list[int]:
    """The router's side of a finished round: the policy learns from it, its tokens are committed (up to a stop)
    with their logprobs; returns the committed tokens."""
    round_.timings.between_seconds = between
    if round_.source == NGRAM and round_.k and state.ngram is not None:   # the tokens are the round's context
        found = state.ngram.match(state.tokens)
        round_.match_size = found.size if found else 0
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


def prefill_alone(state: RequestState, policy: KPolicy, ready: Proposal | None, k: int) -> bool:
    """Whether this model round at K (> 0) is a request's first and runs at K = 0 instead, pre-drafting K beside
    the target's prefill (speculation.prefill_first): the draft's prefill and drafts then cost the first token
    nothing, and if the draft's guess of that token is right the next round's drafts are ready (or staged). Not in
    sampled-draft mode: a sampled draft's draws depend on the rounds' K, so a seeded request's tokens would then
    depend on whether overlap is on (in greedy-draft mode verification is coupled to plain decoding: any K gives
    the same tokens)."""
    return (policy.prefill_first and k > 0 and ready is None and state.generated == 0 and state.target_synced == 0
            and state.draft_mode != worker_pb2.DRAFT_MODE_SAMPLED)


def predraft_k(policy: KPolicy, planned: int | None) -> int:
    """K of the pre-draft for the next round, planned at K `planned` (None: no overlap): 0, no pre-draft, where
    that round drafts more than a pre-draft may carry (speculation.overlap_tokens): it runs in turn at its K."""
    return planned if planned is not None and planned <= policy.predraft_k else 0


async def generate(state: RequestState, draft: DraftClient | None, target: TargetClient,
                   policy: KPolicy, recovery_s: float = 60.0) -> AsyncIterator[list[int]]:
    """Run rounds until the request finishes, yielding each round's committed tokens. With overlap on,
    each model round pre-drafts the next one (its K chosen now) while the target verifies; a round at K = 0
    or of a request that drafts only by prompt lookup is a decode run of several tokens (run_plan), whose rounds
    that arrive together are yielded together. A model round that drafts now and pre-drafts the next can have the
    draft worker start that pre-draft right after its drafts (speculation.chain_predrafts). A model round hands
    its drafts straight to the target (speculation.hand_off) where it pre-drafts nothing beside its verify, or
    chains its pre-draft: one that sent its pre-draft itself would start its verify sooner but its pre-draft no
    sooner, leaving the pre-draft less time. However the request ends, the workers' caches for this
    session (the draft's if a draft call was sent) are released, in the background (release_later)."""
    ready, planned, ended = None, None, None
    try:
        while not state.finish_reason:
            between = None if ended is None else time.perf_counter() - ended
            source, k = (MODEL, len(ready.tokens)) if ready else plan_round(state, draft, policy, planned)
            steps, lookup = (1, None) if ready else run_plan(state, draft, policy, source, k)
            if steps > 1:
                run = resilient_run(state, target, steps, recovery_s, source, policy.answer_delay_s(state), lookup)
                async with contextlib.aclosing(run) as messages:
                    async for rounds in messages:
                        committed, between = conclude_all(state, policy, rounds, between), None
                        ended = time.perf_counter()
                        yield committed
                        if state.finish_reason:
                            break
                planned = None
                continue
            if source == NGRAM:            # drafts the router looks up itself (decode runs off)
                k = ngram_round_k(state, policy, k)
            overlap = policy.overlap and source == MODEL
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


WORKER_DOWN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL)
DRAFT_MODES = {"greedy": worker_pb2.DRAFT_MODE_GREEDY, "sampled": worker_pb2.DRAFT_MODE_SAMPLED}
