"""gRPC servicer of a target worker (specpool.v1.TargetWorker), served by TP rank 0.

Verify calls go through a Batcher: those that arrive together run as one batched forward (on every
TP rank), each row rejection-sampled on its own.

A decode run (VerifyRequest.decode_steps > 1, no drafts) is plain decoding of several tokens in one call, each
answered as soon as it is sampled. While it is all the worker has to do, its steps run back to back on the engine
thread (no event-loop or thread hop between them); while other calls or runs wait, each step goes through the
Batcher, so it batches with them. Plain runs (no lookup) that the Batcher batches only with each other step
together on the engine thread in the same way until one ends or another call waits (EngineSteps.together, target_worker/engine_steps.py).

A staged call (VerifyRequest.staged, target_worker/staging.py) waits for the verdict of the round it follows and
then verifies the candidate drafts that guessed it, as the router would have asked on seeing the verdict. A
handed-off call (VerifyRequest.handoff_id, engine/handoff.py) waits for its drafts from the draft worker.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable

import grpc

from protos.specpool.v1 import worker_pb2, worker_pb2_grpc
from engine.batching import Batcher, prefills
from engine.handoff import WaitingRoom
from engine.ngram import LookupMissed
from engine.prefill_chunks import Prefilled, whole
from engine.sessions import SessionLost
from engine.worker_server import answer, serve_stream
from target_worker.engine_steps import EngineThread, Signals
from target_worker.staging import Verdicts, deliver, follow_up, round_key


def committed(response: worker_pb2.VerifyResponse) -> list[int]:
    """What a call commits: the accepted drafts (of those it looked up itself), then the next token."""
    return list(response.draft_token_ids[:response.num_accepted]) + [response.next_token_id]


def next_step(request: worker_pb2.VerifyRequest, response: worker_pb2.VerifyResponse,
              lookup: worker_pb2.PromptLookup | None, tokens_left: int) -> worker_pb2.VerifyRequest:
    """A decode run's next step: the session now holds what `request` appended and the accepted drafts; append
    the next token (and, with the run's `lookup`, look up at most tokens_left - 1 drafts after it)."""
    step = worker_pb2.VerifyRequest(session_id=request.session_id, new_token_ids=[response.next_token_id],
                                    position=request.position + len(request.new_token_ids) + response.num_accepted)
    if request.HasField("top_logprobs"):
        step.top_logprobs = request.top_logprobs
    if lookup is not None:
        step.lookup.CopyFrom(lookup)
        step.lookup.max_tokens = min(lookup.max_tokens, tokens_left - 1)
    return step


def stream_only(request: worker_pb2.VerifyRequest) -> str:
    """Why unary Verify cannot take this call (the field, then the reason), or "" if it can."""
    if request.decode_steps > 1:
        return "decode_steps: a decode run answers more than once"
    if request.HasField("staged"):
        return "staged: a staged round follows a call on the same stream"
    if request.handoff_id:
        return "handoff_id: a handed-off round waits for its drafts"
    return ""


class DecodeRun:
    """One decode run's progress. Each step samples exactly as a K = 0 round would (same session, positions and
    seeded draws), or with `lookup` as a round with those n-gram drafts would, so a run commits what those
    rounds would. It ends after decode_steps committed tokens, a stop token or (lookup.end_on_miss) at a step
    after the first whose lookup finds no match (answering `missed`, see _decode_run); every answer but the last
    goes to `emit` with `more` set, held back up to answer_delay_us to travel with later ones (see hold)."""

    def __init__(self, request: worker_pb2.VerifyRequest, emit: Callable[[worker_pb2.VerifyResponse], None],
                 clock: Callable[[], float] = time.perf_counter):
        self.request, self.emit, self.clock = request, emit, clock
        self.tokens_left, self.stops = max(request.decode_steps, 1), set(request.stop_token_ids)
        self.delay_s = request.answer_delay_us / 1e6
        self.lookup = None                                  # the run's lookup, for every step after the first
        if request.HasField("lookup"):
            self.lookup = worker_pb2.PromptLookup()
            self.lookup.CopyFrom(request.lookup)
            request.lookup.max_tokens = min(request.lookup.max_tokens, self.tokens_left - 1)
            request.lookup.end_on_miss = False              # the first step always runs
        self.held: list[worker_pb2.VerifyResponse] = []     # answers not sent yet, oldest first
        self.held_since = 0.0                               # when the oldest of them was ready
        self.sent = request.position != 0                   # a session's start answers its first token at once
        self.last: worker_pb2.VerifyResponse | None = None
        self.start = None                                   # a chunked start's prefix-cache lookup, for its answer

    def state(self) -> dict:
        """What an engine process needs to step this run, and hands back after (all but `emit` and `clock`)."""
        return {key: value for key, value in vars(self).items() if key not in ("emit", "clock")}

    @classmethod
    def resumed(cls, state: dict, emit: Callable, clock: Callable[[], float] = time.perf_counter) -> "DecodeRun":
        """A run with `state` (from state()) answering to `emit`."""
        run = cls.__new__(cls)
        vars(run).update(state, emit=emit, clock=clock)
        return run

    def advance(self, response: worker_pb2.VerifyResponse | Prefilled, started: float) -> None:
        """Take one step's answer (its handler time counted from `started`); set `last` when the run ends. A long
        prompt's chunk (Prefilled) commits nothing: the run goes on with the rest of its prompt."""
        if isinstance(response, Prefilled):
            self.request, self.start = response.rest, self.start or response.prefix_cache
            return
        if self.start is not None:
            response.prefix_cache.CopyFrom(self.start)
            self.start = None
        now = self.clock()
        response.handler_us = int((now - started) * 1e6)
        tokens = committed(response)
        self.tokens_left -= len(tokens)
        if self.tokens_left <= 0 or not self.stops.isdisjoint(tokens):
            self.end(response)
            return
        response.more = True
        self.hold(response, now, now - started)
        self.request = next_step(self.request, response, self.lookup, self.tokens_left)

    def hold(self, response: worker_pb2.VerifyResponse, now: float, step_s: float) -> None:
        """Hold `response` back, then send what is held unless waiting for one more step (assumed to take as
        long as this one) would keep the oldest held answer waiting longer than answer_delay_us. A run that starts
        its session sends its first answer at once (the request's first token: its time to first token)."""
        if not self.held:
            self.held_since = now
        self.held.append(response)
        if now - self.held_since + step_s > self.delay_s or not self.sent:
            self.sent = True
            self.emit(self.with_held(self.held.pop()))

    def with_held(self, response: worker_pb2.VerifyResponse) -> worker_pb2.VerifyResponse:
        """`response` carrying the answers held before it (VerifyResponse.earlier); nothing is held after."""
        response.earlier.extend(self.held)
        self.held = []
        return response

    def end(self, response: worker_pb2.VerifyResponse) -> None:
        """The run's last answer, with whatever is still held."""
        self.last = self.with_held(response)


class TargetServicer(worker_pb2_grpc.TargetWorkerServicer):
    """`engine`: the engine itself (run on a thread of this process, EngineThread) or an EngineProcess."""

    def __init__(self, engine, world_size: int, max_batch: int = 1, max_wait_s: float = 0.0,
                 inline_max_s: float = 0.0):
        if getattr(engine, "is_engine_side", False):
            self._side, self._signals = engine, engine.signals
        else:
            self._signals = Signals()
            self._side = EngineThread(engine, world_size, self._signals, inline_max_s)
        self._batcher = Batcher(self._verify_batch, max_batch, max_wait_s, self._signals)
        self._plain: dict[int, DecodeRun] = {}   # id() of a plain run's step waiting in the Batcher -> its run
        self._verdicts = Verdicts()       # recent verify calls' verdicts, for the staged calls that follow them
        self._handoffs = WaitingRoom()    # drafts handed straight here, for the calls that wait for them

    async def _verify_batch(self, requests: list, gone=None) -> list:
        runs = [self._plain.get(id(request)) for request in requests]
        if len(runs) > 1 and all(runs):
            return await self._side.together(runs)
        # A staged round never runs inline: the verdict it follows must go out while it runs; nor does a prefill
        # (a session start or a long prompt's chunk), which the calls arriving meanwhile should not wait behind.
        inline = all(not prefills(request) and not request.HasField("staged") for request in requests)
        return await self._side.verify_batch(worker_pb2.VerifyBatch(requests=requests), inline=inline)

    async def _verified(self, request: worker_pb2.VerifyRequest) -> worker_pb2.VerifyResponse:
        """A verify call, its verdict kept for the staged call that may follow it."""
        verdict, future = None, self._verdicts.expect(round_key(request))
        try:
            verdict = await whole(self._batcher.submit, request)
            return verdict
        finally:
            deliver(future, verdict)

    async def _staged(self, request: worker_pb2.VerifyRequest) -> worker_pb2.VerifyResponse:
        """A staged call: once the round it follows has its verdict, verify the candidate that guessed it (its
        verdict kept in turn, for the next staged call), or answer `missed`."""
        follow = follow_up(request, await self._verdicts.take(round_key(request)))
        return worker_pb2.VerifyResponse(missed=True) if follow is None else await self._verified(follow)

    async def _handed(self, request: worker_pb2.VerifyRequest) -> worker_pb2.VerifyResponse:
        """A handed-off call: verify the drafts of its handoff once they are in, as if it had carried them."""
        if request.draft_token_ids or request.draft_hidden_states:
            raise ValueError("handoff_id: a handed-off call carries no drafts (they come by HandDrafts)")
        key, lost, started = (request.session_id, request.handoff_id), False, time.perf_counter()
        try:
            handoff = await self._handoffs.take(key)
            waited_us = int((time.perf_counter() - started) * 1e6)
            request.draft_token_ids.extend(handoff.draft_token_ids)
            request.draft_hidden_states, request.handoff_id = handoff.draft_hidden_states, 0
            verdict = await self._verified(request)
            verdict.handoff_wait_us, verdict.handoff_from_router = waited_us, handoff.from_router
            return verdict
        except SessionLost:
            lost = True                   # the router repeats the call from position 0: it takes them again
            raise
        finally:
            if not lost:
                self._handoffs.done(key)

    async def _decode_run(self, request: worker_pb2.VerifyRequest, emit: Callable) -> worker_pb2.VerifyResponse:
        """A decode run: its steps alone on the engine while no other call waits, else one at a time through the
        Batcher. A withdrawn call stops it at its next step."""
        loop = asyncio.get_running_loop()
        run = DecodeRun(request, lambda response: loop.call_soon_threadsafe(emit, response))
        self._signals.runs += 1
        try:
            while run.last is None:
                if self._signals.alone:
                    await self._side.alone(run)
                else:
                    await self._step(run)
        except LookupMissed:
            run.end(worker_pb2.VerifyResponse(missed=True))
        except asyncio.CancelledError:
            self._signals.withdrawn += 1
            raise
        finally:
            self._signals.runs -= 1
        return run.last

    async def _step(self, run: DecodeRun) -> None:
        """A run's next step through the Batcher, batched with whatever else waits; a plain run's, batched only with
        other plain runs, may take several there (EngineSteps.together), which advanced the run already."""
        started, request = time.perf_counter(), run.request
        if run.lookup is None:                # a plain run (a lookup run's first request sets run.lookup)
            self._plain[id(request)] = run
        try:
            response = await self._batcher.submit(request)
        finally:
            self._plain.pop(id(request), None)
        if response is not None:
            run.advance(response, started)

    def _submit(self, request: worker_pb2.VerifyRequest, emit: Callable):
        if request.HasField("staged"):
            return self._staged(request)
        if request.handoff_id:
            return self._handed(request)
        if request.decode_steps > 1 and not request.draft_token_ids:
            return self._decode_run(request, emit)
        return self._verified(request)

    async def Verify(self, request, context):
        refused = stream_only(request)
        if refused:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{refused}; send it on VerifyStream")
        return await answer(context, whole(self._batcher.submit, request))

    async def VerifyStream(self, requests, context):
        async for response in serve_stream(requests, self._submit, worker_pb2.VerifyResponse):
            yield response

    async def HandDrafts(self, handoffs, context):
        async for handoff in handoffs:
            self._handoffs.put(handoff)
        return worker_pb2.HandoffAck()

    async def Release(self, request, context):
        self._signals.releasing += 1          # runs stepping together let it in at their next step
        try:
            await answer(context, self._side.release(request))
        finally:
            self._signals.releasing -= 1
        return worker_pb2.ReleaseResponse()
