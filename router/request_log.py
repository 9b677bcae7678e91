"""The request log (router.log_requests, hot-reloadable): one line per client request on the operator's log once it
is over, whatever its end, so that an on-call engineer can match a client's complaint to what the router did:

    2026-11-26 08:12:04.518 [specpool] request 9f3c… GenerateStream from ipv4:127.0.0.1:51234: OK in 0.412 s,
        7 prompt + 64 new tokens (length), 155.3 tokens/s; 21 target passes, K 3.0 on average, 45 of 63 drafts
        accepted (0.71)

(one line in the log; wrapped here). A refused request says why, in the words its client got:

    ... request - /v1/completions from 127.0.0.1:40112: INVALID_ARGUMENT in 0.001 s: max_tokens: must be >= 1
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from protos.specpool.v1 import generation_pb2


@dataclass
class ClientRequest:
    """One client request as specpool_requests_total and the request log see it: where it came in, from whom, when,
    its id once it has one, and the router's state of each of its choices once admitted (HTTP's n makes several)."""
    route: str                       # "Generate", "GenerateStream", or the HTTP path ("/v1/chat/completions")
    peer: str = ""
    started: float = field(default_factory=time.perf_counter)
    request_id: str = ""
    states: list = field(default_factory=list)
    per_prompt: int | None = None    # choices per prompt, where a batch's prompts' choices follow each other in
                                     # `states` (None: one prompt)


FINISHED = {generation_pb2.FINISH_REASON_LENGTH: "length", generation_pb2.FINISH_REASON_STOP: "stop",
            generation_pb2.FINISH_REASON_EOS: "eos"}


def request_line(request: ClientRequest, code: str, detail: str = "", now: float | None = None) -> str:
    """The request log's line for `request`, ended with gRPC status `code` (and, if it failed, the `detail` its
    client was given) at `now` (time.perf_counter())."""
    seconds = (time.perf_counter() if now is None else now) - request.started
    peer = f" from {request.peer}" if request.peer else ""
    head = f"request {request.request_id or '-'} {request.route}{peer}: {code} in {seconds:.3f} s"
    parts = [tokens_part(request.states, seconds, code == "OK", request.per_prompt)] if request.states else []
    if request.states and any(state.stats.target_passes for state in request.states):
        parts.append(rounds_part(request.states))
    return one_line(head + (f", {'; '.join(parts)}" if parts else "") + (f": {detail}" if detail else ""))


_BREAKS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def one_line(text: str) -> str:
    """`text` with its control characters and line breaks escaped (`\\n`): a client's id or a message quoting its
    input never starts a line of its own that would read as serve's."""
    return _BREAKS.sub(lambda match: repr(match.group())[1:-1], text)


def tokens_part(states: list, seconds: float, finished: bool, per_prompt: int | None = None) -> str:
    """Prompt tokens (each prompt's once) and new tokens (the choices' sum), why each choice ended, and the rate."""
    prompts = states[::per_prompt or len(states)]
    choices = f"{len(states)} choices, " if len(states) > 1 else ""
    batch = f"{len(prompts)} prompts, " if len(prompts) > 1 else ""
    new = sum(len(state.tokens) - state.prompt_len for state in states)
    reasons = ", ".join(FINISHED.get(state.finish_reason, "unfinished") for state in states)
    rate = f", {new / seconds:.1f} tokens/s" if finished and seconds > 0 else ""
    return f"{choices}{batch}{sum(s.prompt_len for s in prompts)} prompt + {new} new tokens ({reasons}){rate}"


def rounds_part(states: list) -> str:
    """The target passes, the mean K of the rounds, and the drafts accepted."""
    stats = [state.stats for state in states]
    passes = sum(s.target_passes for s in stats)
    ks = [k for s in stats for k in s.k_per_round]
    drafted, accepted = sum(s.draft_tokens for s in stats), sum(s.accepted_tokens for s in stats)
    line = f"{passes} target pass{'es' if passes != 1 else ''}"
    if ks:
        line += f", K {sum(ks) / len(ks):.1f} on average"
    if drafted:
        line += f", {accepted} of {drafted} drafts accepted ({accepted / drafted:.2f})"
    return line
