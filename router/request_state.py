"""What the router's speculative loop works on: a request's state (RequestState), a round's drafts (Proposal) and
what a round did (Round), the policy a round asks (KPolicy), and the proposal sources. No calls here."""
from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from protos.specpool.v1 import generation_pb2, worker_pb2
from router.controller import RoundTimings
from engine.ngram import NgramIndex


NONE, MODEL, NGRAM = (generation_pb2.PROPOSAL_SOURCE_NONE, generation_pb2.PROPOSAL_SOURCE_MODEL,
                      generation_pb2.PROPOSAL_SOURCE_NGRAM)


SOURCE_NAMES = {MODEL: "model", NGRAM: "ngram"}


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
    lookup_alone: bool = False             # model+ngram: this request drafts by prompt lookup alone (KSelector.attach)
    fell_back: bool = False                # a round was planned while its draft worker was unreachable
    ngram: NgramIndex | None = None        # the request's prompt-lookup index (None: no n-gram proposals, not
                                           # even as the fallback while the draft worker is down)
    stop_strings: tuple = ()               # matched on the decoded output by router.stopping
    include_stop: bool = False             # ... the text keeping the one that ended it
    keep_special: bool = False             # the text keeps special tokens (vLLM's skip_special_tokens false)
    top_logprobs: int | None = None        # set: the target answers each committed token's logprobs
    streamed: bool = True                  # the client reads the output as it comes (False: whole, at the end)
    target_sessions: int = 1               # sessions open on its target replica when its last round was planned
    logprobs: list = field(default_factory=list)   # ... generation_pb2.TokenLogprob per output token
    out_of_memory: dict = field(default_factory=dict)   # pool -> its calls for this request that ran out of memory
    min_new_tokens: int = 0                # no EOS or stop token before this many output tokens
    grammar: worker_pb2.Grammar | None = None   # structured output: the grammar the output follows
    reservation: object = None             # its place in admission, taken when it was sent (Router.reserve)
    bad_words: list = field(default_factory=list)   # token sequences the output never completes
    prompt_top_logprobs: int | None = None  # set: the target's prefill answers the prompt's logprobs, with this
    prompt_logprobs: list | None = None     # ... many alternatives: generation_pb2.TokenLogprob per prompt token 1..
    prediction: tuple = ()                  # the output predicted (GenerateRequest.prediction): prompt lookup copies
                                            # from it too, on the router (ngram) and on the target (target_start)
    prediction_trial: object = None         # ... whether it is worth it (router.prediction.PredictionTrial; None:
                                            # not judged, as for a request with its own K)
    prediction_dropped: bool = False        # ... it was not: no more drafts are copied from it

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def predicting(self) -> bool:
        """Whether lookup copies drafts from a prediction of the request's (it has one, not dropped)."""
        return bool(self.prediction) and not self.prediction_dropped

    @functools.cached_property
    def session_start(self) -> dict:
        """The fields of a worker call that opens the request's session (position 0): its sampling, the prompt's
        length, min_new_tokens with the tokens it keeps out of the output until then, its grammar and its bad
        words."""
        start = {"sampling": self.sampling, "prompt_length": self.prompt_len, "grammar": self.grammar,
                 "bad_words": [worker_pb2.TokenSequence(token_ids=word) for word in self.bad_words]}
        if self.min_new_tokens:
            start["min_tokens"] = worker_pb2.MinTokens(count=self.min_new_tokens,
                                                       token_ids=sorted(self.stop_ids | self.eos_ids))
        return start

    @property
    def target_start(self) -> dict:
        """session_start for the target: the prediction with it, and the prompt's logprobs asked for too, until they
        have come."""
        start = {**self.session_start, "prediction_token_ids": self.prediction} if self.predicting else \
            self.session_start
        if self.prompt_top_logprobs is None or self.prompt_logprobs is not None:
            return start
        return {**start, "prompt_logprobs": self.prompt_top_logprobs}

    def count_out_of_memory(self, pool: str) -> None:
        self.out_of_memory[pool] = self.out_of_memory.get(pool, 0) + 1

    def timeout(self, limit: float) -> float:
        """A worker call's timeout: `limit`, or less if the client's deadline comes sooner."""
        return limit if self.deadline is None else max(0.0, min(limit, self.deadline - time.monotonic()))


@dataclass
class Proposal:
    """What a draft call produced: its tokens (and their hidden states in sampled mode) and what it cost."""
    tokens: list[int] = field(default_factory=list)
    hidden: bytes = b""
    seconds: float = 0.0             # the draft worker's compute
    rtt_seconds: float = 0.0         # the rest of the call (handed off: its wait on the target less `seconds`)
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
    predicted: bool = False          # ... copied from the request's prediction

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


def logprobs_asked(state: RequestState) -> dict:
    """The top_logprobs argument of a target call: only when the request asked for logprobs."""
    return {} if state.top_logprobs is None else {"top_logprobs": state.top_logprobs}


WORKER_DOWN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL)


DRAFT_MODES = {"greedy": worker_pb2.DRAFT_MODE_GREEDY, "sampled": worker_pb2.DRAFT_MODE_SAMPLED}
