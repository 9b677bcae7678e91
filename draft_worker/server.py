"""gRPC servicer of a draft worker (specpool.v1.DraftWorker). Propose calls that arrive together
run their drafting steps as one batch (see engine/batching.py). A call with `hand_to` set also hands its
drafts straight to that target worker (engine/handoff.py), before answering the router. A streamed call with
`then` set goes on to pre-draft the next round at once (chained), answering that as its second answer."""
from __future__ import annotations

import time
from typing import Callable

import grpc

from protos.specpool.v1 import worker_pb2, worker_pb2_grpc
from engine.batching import Batcher, prefills
from engine.handoff import HandoffSenders
from engine.prefill_chunks import whole
from engine.worker_server import EngineRunner, answer, serve_stream


def chained(request: worker_pb2.ProposeRequest, drafts: worker_pb2.ProposeResponse) -> worker_pb2.ProposeRequest:
    """The pre-draft `request.then` asks for after `drafts`, as the router would have sent it: the draft holds the
    context and drafts[:-1], appends the last draft, and drafts then.k past it, with a branch per point the drafts
    have (branch_at j, rank 0: the runner-up at j | 1: the third choice)."""
    tokens, context = list(drafts.draft_token_ids), request.position + len(request.new_token_ids)
    choices = (drafts.runner_up_token_ids, drafts.third_choice_token_ids)
    points = [worker_pb2.BranchPoint(at=context + j, token_id=choices[rank][j])
              for j, rank in zip(request.then.branch_at, request.then.branch_rank)
              if j < len(tokens) and rank < len(choices) and j < len(choices[rank])]
    return worker_pb2.ProposeRequest(session_id=request.session_id, position=context + len(tokens) - 1,
                                     new_token_ids=tokens[-1:], k=request.then.k, mode=request.mode,
                                     runner_ups=True, branches=points, committed=request.committed or context)


def stamped(response: worker_pb2.ProposeResponse, started: float) -> worker_pb2.ProposeResponse:
    """The answer with its handler time since `started` (one of a chained call's two answers)."""
    response.handler_us = int((time.perf_counter() - started) * 1e6)
    return response


class DraftServicer(worker_pb2_grpc.DraftWorkerServicer):
    def __init__(self, engine, max_batch: int = 1, max_wait_s: float = 0.0, inline_max_s: float = 0.0,
                 channel: Callable[[str], grpc.aio.Channel] = grpc.aio.insecure_channel):
        self._engine = engine
        self._runner = EngineRunner(inline_max_s)
        self._batcher = Batcher(self._propose_batch, max_batch, max_wait_s)
        self._handoffs = HandoffSenders(channel)   # channel(address): to the targets drafts are handed to
        self._chained: set[int] = set()            # id() of the chained pre-drafts waiting or drafting

    async def _propose_batch(self, requests: list, gone) -> list:
        """One engine call; inline (on the event loop) only for calls that are neither prefills (session starts, a long
        prompt's chunks) nor chained pre-drafts, whose caller's first answer must leave while they draft."""
        inline = all(not prefills(request) and id(request) not in self._chained for request in requests)
        return await self._runner.run(self._engine.propose_batch, requests, gone, inline=inline)

    async def _propose(self, request: worker_pb2.ProposeRequest, emit=None) -> worker_pb2.ProposeResponse:
        started = time.perf_counter()
        response = await whole(self._batcher.submit, request)
        if request.hand_to:
            self._handoffs.send(request.hand_to, worker_pb2.DraftHandoff(
                session_id=request.session_id, handoff_id=request.handoff_id,
                draft_token_ids=response.draft_token_ids, draft_hidden_states=response.draft_hidden_states))
        if not request.HasField("then"):
            return response
        response.more = True
        await emit(stamped(response, started))        # the drafts on their way first: then the pre-draft
        return await self._predraft(chained(request, response))

    async def _predraft(self, request: worker_pb2.ProposeRequest) -> worker_pb2.ProposeResponse:
        started = time.perf_counter()
        self._chained.add(id(request))
        try:
            return stamped(await whole(self._batcher.submit, request), started)
        finally:
            self._chained.discard(id(request))

    async def Propose(self, request, context):
        if request.HasField("then"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "then: a chained pre-draft answers twice, so only ProposeStream takes one")
        return await answer(context, self._propose(request))

    async def ProposeStream(self, requests, context):
        async for response in serve_stream(requests, self._propose, worker_pb2.ProposeResponse):
            yield response

    async def Release(self, request, context):
        await self._runner.call(context, self._engine.release, request.session_id)
        return worker_pb2.ReleaseResponse()
