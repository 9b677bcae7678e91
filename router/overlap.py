"""Overlap (draft-ahead): what the router does with a pre-draft once the round beside it has its verdict.

While the target verifies round r, the draft keeps going past r's drafts: it guesses the target's next token and
drafts round r+1 after it. Beside that main branch, in the same batched steps, it drafts up to `predraft_branches`
rejection branches: for draft position j, the verdict "the first j drafts accepted, then the draft's runner-up at
j" (the draft's next best token is the target's correction about half the time on the demo pair), or "... then
its third choice at j" (a second guess, right in about a fifth of the rest), the likeliest ones first (guesses).
If the verdict is one of the branches, round r+1's drafts are ready and its verify goes out at once (settle); any
other verdict cancels the pre-draft and r+1 drafts as usual. Drafts are only proposals, so this changes which
tokens are proposed, never the distribution of what is committed. A pre-draft that is back before the verdict is
staged on the target (`speculation.stage_predrafts`, StagedCall): the target holds its candidates and, the moment
its verdict matches one, starts verifying round r+1 itself, so a hit costs no round trip through the router
either. Sending the pre-draft is router/drafting.py's (predraft, chained_call).
"""
from __future__ import annotations

import asyncio

import grpc

from protos.specpool.v1 import worker_pb2
from router.request_state import MODEL, Proposal, RequestState, Round, logprobs_asked
from router.worker_client import DraftClient, TargetClient


def guesses(proposal: Proposal, branches) -> list[tuple[int, int]]:
    """The rejection branches a pre-draft of these drafts carries, (drafts accepted, the correction guessed), from
    the planned `branches` (j, 0: the draft's runner-up at j | 1: its third choice)."""
    choices = (proposal.runner_ups, proposal.thirds)
    return [(j, choices[rank][j]) for j, rank in branches
            if j < len(proposal.tokens) and j < len(choices[rank])]


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


def correction_guessed(proposal: Proposal, round_: Round) -> tuple[bool | None, bool | None]:
    """In a round that rejected draft j: was the draft's runner-up at j the target's correction, and if not, was
    its third choice (None: no rejection, no such guess known, or the runner-up was right)? The controller learns
    both rates from every rejection, branched or not (RoundTimings.branch_hit, third_hit)."""
    j, token = round_.accepted, round_.committed[-1]
    if j >= round_.k or j >= len(proposal.runner_ups):
        return None, None
    runner_up = proposal.runner_ups[j] == token
    return runner_up, None if runner_up or j >= len(proposal.thirds) else proposal.thirds[j] == token


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


async def cancel(ahead: asyncio.Task | None) -> None:
    if ahead is not None:
        ahead.cancel()
        await asyncio.gather(ahead, return_exceptions=True)


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
