"""Prompt logprobs (GenerateRequest.prompt_logprobs): the target's raw log_softmax at each prompt position, from its
prefill's own logits, gathered chunk by chunk (each chunk of a long prompt answers Prefilled) and answered on the
call that completes the prefill. Such a session start computes its whole prompt: it does not read the prefix cache.

    session.prompt_logprobs = PromptLogprobs(request.prompt_logprobs, prompt_length)    # a start that asks
    gathering.take(row_logits, request.position, request.new_token_ids)    # each forward over the prompt
    response.prompt_logprobs.extend(gathering.entries)             # the prefill's last call
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.sampling import picked
from protos.specpool.v1 import generation_pb2

GATHERED_CHUNK = 512     # at most this many positions' logits per forward of a start gathering them (chunked prefill)


def as_entries(tokens: list[int], picks: list, ranks: list[int] | None = None) -> list[generation_pb2.TokenLogprob]:
    """Each token's (logprob, [(alternative, logprob)]) from engine.sampling.picked as the message both the output's
    and the prompt's logprobs travel in (with the prompt's, each token's rank)."""
    return [generation_pb2.TokenLogprob(token_id=token, logprob=logprob, rank=rank, top=[
        generation_pb2.TopLogprob(token_id=other, logprob=value) for other, value in top])
        for token, (logprob, top), rank in zip(tokens, picks, ranks or [0] * len(tokens))]


def vocabulary_ranks(logprobs: torch.Tensor,          # [rows, vocab]
          tokens: list[int]) -> list[int]:
    """Per row, the tokens at least as likely as its own (1: its token is the most likely), as vLLM counts rank."""
    chosen = logprobs.gather(-1, torch.tensor(tokens, device=logprobs.device).view(-1, 1))     # [rows, 1]
    return (logprobs >= chosen).sum(-1).tolist()


@dataclass
class PromptLogprobs:
    top: int                     # alternatives per position
    prompt_length: int
    entries: list = field(default_factory=list)    # generation_pb2.TokenLogprob per prompt token 1, 2, ... so far

    def take(self, logits: torch.Tensor,   # [n, vocab]: row j at position first + j, predicting the token after it
             first: int, tokens) -> None:
        """Record the rows that predict a prompt token; `tokens`: the call's new ones, from position `first` on
        (a chunk's last row predicts the next chunk's first token)."""
        rows = max(0, min(self.prompt_length - 1 - first, logits.shape[0]))
        targets = list(tokens[1:1 + rows])
        logprobs = torch.log_softmax(logits[:rows].float(), -1)                    # [rows, vocab]
        self.entries += as_entries(targets, picked(logprobs, targets, self.top),
                                   vocabulary_ranks(logprobs, targets))
