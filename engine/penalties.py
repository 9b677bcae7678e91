"""Repetition, frequency and presence penalties, the logit bias, allowed tokens and min_tokens on the target's and
the draft's logits, position by position.

A verify pass has the target's logits at K + 1 positions: row j predicts the token after the committed tokens and
drafts 0..j-1. Each row is penalized for its own prefix, so a draft accepted at j counts at every row after it,
exactly as plain decoding would have counted it once committed. p is then a function of the prefix alone, and
rejection sampling stays exact. The draft penalizes its own logits the same way, each draft for its context and
the drafts before it (draft_worker/proposer.py), so that it proposes what the penalized target would; in sampled
mode the target recomputes that q from the draft's hidden states with the same function.

    logits = penalize(logits, session.tokens, start, sampling)   # before greedy_match / logits_to_probs

Order and meaning as in vLLM: allowed_token_ids, OpenAI's logit bias, then the repetition penalty (transformers'
RepetitionPenaltyLogitsProcessor) on tokens of the prompt or the output, then OpenAI's frequency and presence
penalties on tokens of the output; then min_tokens keeps EOS and the stop token IDs out of the output's first
min_tokens tokens (vLLM's MinTokensLogitsProcessor); last, the bad words' last tokens where the output would
complete them.
"""
from __future__ import annotations

import torch

from engine.sampling import Sampling


def output_counts(tokens: list[int], start: int, k: int, prompt_length: int, vocab: int,
                  device) -> torch.Tensor:  # [K + 1, vocab]
    """Row j: how often each token occurs in the output before position start + j (tokens[prompt_length:start]
    and the drafts tokens[start:start + j])."""
    committed = torch.tensor(tokens[min(prompt_length, start):start], dtype=torch.long, device=device)
    counts = torch.bincount(committed, minlength=vocab).float().expand(k + 1, vocab).clone()   # [K + 1, vocab]
    if k:
        drafts = torch.tensor(tokens[start:start + k], dtype=torch.long, device=device)
        counts[1:] += torch.nn.functional.one_hot(drafts, vocab).float().cumsum(0)
    return counts


def penalize(logits: torch.Tensor,  # [K + 1, vocab], row j predicting position start + j
             tokens: list[int],     # the prompt, the committed output, then the K drafts
             start: int,            # the position row 0 predicts (the first draft's)
             sampling: Sampling) -> torch.Tensor:  # [K + 1, vocab], float32
    """The logits with the request's allowed tokens, logit bias, penalties, min_tokens and bad words applied, each
    row for its own prefix; a request with none of them gets them as they are."""
    if not sampling.penalized:
        return logits
    logits = logits.float()
    if sampling.allowed_tokens:
        logits = only(logits, sampling.allowed_tokens)
    if sampling.logit_bias:
        logits = biased(logits, sampling.logit_bias)
    if sampling.counts_tokens:
        logits = penalized_by_counts(logits, tokens, start, sampling)
    if sampling.min_tokens and sampling.end_tokens:
        logits = without_ends(logits, start, sampling)
    if sampling.bad_words:
        logits = without_bad_words(logits, tokens, start, sampling)
    return logits


def only(logits: torch.Tensor, allowed: tuple) -> torch.Tensor:  # [K + 1, vocab]
    """vLLM's allowed_token_ids: every other token's logit -inf, in every row."""
    keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
    keep[list(allowed)] = True
    return logits.masked_fill(~keep, float("-inf"))


def biased(logits: torch.Tensor, logit_bias: tuple) -> torch.Tensor:  # [K + 1, vocab]
    """OpenAI's logit bias: (token, bias) pairs added to every row."""
    tokens_biased, biases = zip(*logit_bias)
    bias = torch.zeros(logits.shape[-1], device=logits.device)
    bias[list(tokens_biased)] = torch.tensor(biases, device=logits.device)
    return logits + bias


def penalized_by_counts(logits: torch.Tensor, tokens: list[int], start: int,
                        sampling: Sampling) -> torch.Tensor:  # [K + 1, vocab]
    """The repetition penalty (prompt and output), then the frequency and presence penalties (output)."""
    rows, vocab = logits.shape
    counts = output_counts(tokens, start, rows - 1, sampling.prompt_length, vocab, logits.device)
    if sampling.repetition_penalty != 1.0:
        prompt = torch.tensor(tokens[:min(sampling.prompt_length, start)], dtype=torch.long, device=logits.device)
        seen = (counts > 0) | (torch.bincount(prompt, minlength=vocab) > 0)                       # [K + 1, vocab]
        scaled = torch.where(logits > 0, logits / sampling.repetition_penalty, logits * sampling.repetition_penalty)
        logits = torch.where(seen, scaled, logits)
    return logits - sampling.frequency_penalty * counts - sampling.presence_penalty * (counts > 0).float()


def without_bad_words(logits: torch.Tensor, tokens: list[int], start: int,
                      sampling: Sampling) -> torch.Tensor:  # [K + 1, vocab]
    """vLLM's bad_words: in row j, -inf at the last token of each bad word whose other tokens end the output before
    it (tokens[prompt_length:start + j]); a one-token word's, in every row."""
    banned = [(j, word[-1]) for j in range(logits.shape[0]) for word in sampling.bad_words
              if len(word) - 1 <= start + j - sampling.prompt_length
              and tuple(tokens[start + j - len(word) + 1:start + j]) == word[:-1]]
    if not banned:
        return logits
    rows, columns = zip(*banned)
    logits = logits.clone()
    logits[list(rows), list(columns)] = float("-inf")
    return logits


def without_ends(logits: torch.Tensor, start: int, sampling: Sampling) -> torch.Tensor:  # [K + 1, vocab]
    """min_tokens: -inf at the end tokens (EOS, stop token IDs) in the rows that predict one of the output's first
    min_tokens tokens (row j predicts output token start + j - prompt_length)."""
    early = min(max(sampling.prompt_length + sampling.min_tokens - start, 0), logits.shape[0])
    if not early:
        return logits
    logits = logits.clone()
    logits[:early, list(sampling.end_tokens)] = float("-inf")
    return logits
