"""Stop strings: matched on the decoded output, across token boundaries, as the tokens arrive.

A stop token or EOS that ends the output is one of its tokens, but not of its text (as vLLM has it, also where the
text keeps special tokens; with include_stop_str_in_output it is).

The text is cut before the first stop string, which is not returned (after it, with vLLM's
include_stop_str_in_output); the tokens end with the one that completed it. While streaming, only text that could
still be the start of a stop string is held back. A stop string completed by one of the output's first
min_new_tokens tokens does not count (vLLM's min_tokens).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator

from protos.specpool.v1 import generation_pb2
from router.prediction import count_prediction
from router.text import IncrementalDetokenizer


@dataclass
class Piece:
    """What a batch of committed tokens adds to the output: how many of them count (all, unless a stop
    string ended the output inside the batch), the text to send, and whether a stop string matched."""
    kept: int
    text: str
    stopped: bool = False


@dataclass
class StopStrings:
    """The output text of one request, decoded incrementally and checked against its stop strings."""
    detokenizer: IncrementalDetokenizer
    stops: tuple = ()
    min_tokens: int = 0                 # tokens that must come before a match counts (min_new_tokens)
    include_stop: bool = False          # the text ends with the stop string (include_stop_str_in_output)
    held: str = ""                      # decoded text not sent yet (it could begin a stop string)
    pushed: int = 0                     # tokens decoded so far
    _longest: int = field(init=False, default=0)

    def __post_init__(self):
        self._longest = max((len(s) for s in self.stops), default=0)

    def push(self, tokens: list[int], final: bool) -> Piece:
        """Decode `tokens` one at a time (so a match knows which token completed it); `final`: the
        output ends after them, so nothing more is held back."""
        for i, token in enumerate(tokens):
            last, before = final and i == len(tokens) - 1, len(self.held)
            self.held += self.detokenizer.push([token], final=last)
            self.pushed += 1
            cut = self._first_match(before) if self.pushed >= self.min_tokens else None
            if cut is not None:
                text, self.held = self.held[:cut], ""
                return Piece(i + 1, text, stopped=True)
        if final:                       # a character the last tokens left incomplete: as it is
            self.held += self.detokenizer.push([], final=True)
        keep = 0 if final else self._prefix_len()
        text, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return Piece(len(tokens), text)

    def _first_match(self, before: int) -> int | None:
        """Where the text is cut at the first stop string that ends past held[:before] (in the text just decoded):
        where it begins (or, include_stop, ends)."""
        found = [(at, at + len(stop) if self.include_stop else at)
                 for stop in self.stops for at in [self.held.find(stop, max(before - len(stop) + 1, 0))] if at >= 0]
        return min(found)[1] if found else None

    def _prefix_len(self) -> int:
        """Length of the longest end of the held text that begins some stop string."""
        for size in range(min(self._longest - 1, len(self.held)), 0, -1):
            tail = self.held[-size:]
            if any(stop.startswith(tail) for stop in self.stops):
                return size
        return 0


@dataclass
class Chunk:
    """Output sent to the client: tokens committed since the last chunk, their text, their logprobs."""
    token_ids: list[int]
    text: str
    logprobs: list           # generation_pb2.TokenLogprob per token (empty unless the request asked)
    finish_reason: int = 0   # set on the request's last chunk


def ended_by_token(state, tokens: list[int]) -> bool:
    """Whether `tokens` end the output with a stop token or EOS, whose text is then left out (as vLLM leaves it
    out, special or not; with include_stop_str_in_output it stays)."""
    ends = {generation_pb2.FINISH_REASON_STOP: state.stop_ids, generation_pb2.FINISH_REASON_EOS: state.eos_ids}
    return bool(tokens) and not state.include_stop and tokens[-1] in ends.get(state.finish_reason, ())


async def output_chunks(rounds: AsyncIterator[list[int]], state, tokenizer) -> AsyncIterator[Chunk]:
    """A request's committed tokens (`rounds`: Router.run) as chunks of output with its stop strings
    applied. A stop string ends the request: state.finish_reason becomes STOP and the tokens after the one
    that completed it are dropped, so the loop stops at its next round and frees the workers' caches."""
    output = StopStrings(IncrementalDetokenizer(tokenizer, not state.keep_special), tuple(state.stop_strings),
                         state.min_new_tokens, state.include_stop)
    async for tokens in rounds:
        start, silent = state.generated - len(tokens), ended_by_token(state, tokens)
        piece = output.push(tokens[:len(tokens) - silent], final=bool(state.finish_reason))
        piece.kept += silent and not piece.stopped
        if piece.stopped:
            end = state.prompt_len + start + piece.kept
            del state.tokens[end:], state.logprobs[start + piece.kept:]
            state.finish_reason = generation_pb2.FINISH_REASON_STOP
        if state.finish_reason:
            await count_prediction(state)       # the last chunk's stats carry it
        yield Chunk(tokens[:piece.kept], piece.text, state.logprobs[start:start + piece.kept], state.finish_reason)
