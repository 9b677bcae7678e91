"""Sampling and exact rejection sampling, as free functions over tensors.

Shared by the draft worker (to sample drafts from q) and the target worker (to verify them), so
that temperature, top-k and top-p reach p and q through the very same code.

Randomness is counter-based: every random draw is made by a generator seeded from
(request seed, absolute token position, stream). A request's output therefore depends only on its
seed and its committed tokens, not on how many rounds, retries or re-prefills produced them.

Vocabulary follows Leviathan et al. 2023 / Chen et al. 2023: draft probs q, target probs p,
accepted drafts, the recovered token sampled from norm(max(0, p - q)) at the first rejection,
and the bonus token sampled from p after K acceptances.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

STREAM_DRAFT = 1      # the draft's own sample of the token at a position
STREAM_ACCEPT = 2     # the uniform of the accept test at a position
STREAM_TARGET = 3     # the target's sample at a position (recovered, bonus, or plain decoding)

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class Sampling:
    """Per-request sampling transform. temperature 0 is greedy. The allowed tokens, the logit bias, the penalties,
    min_tokens and the bad words apply to the target's and the draft's logits before this transform
    (engine/penalties.py), and so does a structured-output request's grammar (engine/constraints.py); prompt_length
    is where the output they count begins."""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple = ()                 # (token, bias) pairs, added before the penalties
    prompt_length: int = 0
    min_p: float = 0.0
    min_tokens: int = 0                    # the output's first min_tokens tokens are none of end_tokens
    end_tokens: tuple = ()                 # EOS (unless ignored) and the stop token IDs
    allowed_tokens: tuple = ()             # set: the only tokens ever sampled (vLLM's allowed_token_ids)
    bad_words: tuple = ()                  # token sequences the output never completes (vLLM's bad_words)
    grammar: str = ""                      # structured output: the llguidance grammar p follows (constraints.py)
    grammar_eos: tuple = ()                # ... and the EOS tokens it allows once complete

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether engine/penalties.py changes the logits: allowed tokens, a logit bias, a penalty, min_tokens or bad
        words."""
        return (self.counts_tokens or bool(self.logit_bias or self.allowed_tokens or self.bad_words)
                or bool(self.min_tokens and self.end_tokens))

    @property
    def counts_tokens(self) -> bool:
        """Whether a penalty is on: the logits depend on the tokens before them."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0)


def seed_for(seed: int, position: int, stream: int) -> int:
    """splitmix64 of (seed, position, stream): a well-mixed 63-bit seed for one draw."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + stream * 0x94D049BB133111EB) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


def generator(seed: int, position: int, stream: int, device: torch.device | str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed_for(seed, position, stream))


def logits_to_probs(logits: torch.Tensor,  # [n, vocab]
                    sampling: Sampling) -> torch.Tensor:  # [n, vocab], float32
    """Temperature, then min-p, then top-k, then top-p, then softmax (vLLM's order). Greedy gives one-hot rows on
    the argmax."""
    logits = logits.float()
    if sampling.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / sampling.temperature
    if sampling.min_p > 0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < sampling.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= sampling.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor,  # [vocab]
           gen: torch.Generator) -> int:
    """One token from a probability row; a one-hot row returns its token without a draw. The draw runs
    on the generator's device (callers make it on the row's device, so a GPU row is never copied)."""
    probs = probs.float().to(gen.device)
    top = int(probs.argmax())
    if probs[top] >= 1.0 and int((probs > 0).sum()) == 1:
        return top
    return int(torch.multinomial(probs, 1, generator=gen))


def one_hot_draft_probs(draft_token_ids: torch.Tensor,  # [K]
                        vocab_size: int) -> torch.Tensor:  # [K, vocab]
    """q of a deterministic (greedy) draft: all mass on the proposed token."""
    return torch.nn.functional.one_hot(draft_token_ids.long(), vocab_size).float()


def accept_uniforms(seed: int, start_position: int, k: int) -> torch.Tensor:  # [K]
    return torch.stack([torch.rand((), generator=generator(seed, start_position + j, STREAM_ACCEPT))
                        for j in range(k)]) if k else torch.zeros(0)


def rejection_sample(draft_token_ids: torch.Tensor,  # [K] int
                     draft_probs: torch.Tensor,      # [K, vocab] q, the distributions the drafts came from
                     target_probs: torch.Tensor,     # [K + 1, vocab] p, last row for the bonus token
                     seed: int,
                     start_position: int) -> tuple[int, int]:
    """Accept draft j with probability min(1, p_j(x_j) / q_j(x_j)), stop at the first rejection.

    Returns (num_accepted, next_token): next_token is recovered from norm(max(0, p - q)) at the
    first rejection, or the bonus token from p_K when every draft was accepted. Draft j is the token
    at absolute position start_position + j.
    """
    k = draft_token_ids.shape[0]
    rows = torch.arange(k)
    p_x = target_probs[rows, draft_token_ids.long()]                      # [K]
    q_x = draft_probs[rows, draft_token_ids.long()]                       # [K]
    accepted = accept_uniforms(seed, start_position, k).to(p_x.device) * q_x < p_x   # [K] bool
    rejected = (~accepted).nonzero()
    num_accepted = int(rejected[0]) if rejected.numel() else k
    position = start_position + num_accepted
    gen = generator(seed, position, STREAM_TARGET, target_probs.device)
    if num_accepted == k:
        return k, sample(target_probs[k], gen)
    residual = (target_probs[num_accepted] - draft_probs[num_accepted]).clamp_min(0.0)
    total = residual.sum()
    recovered_probs = residual / total if total > 0 else target_probs[num_accepted]
    return num_accepted, sample(recovered_probs, gen)


def greedy_match(draft_token_ids: list[int], target_argmax: list[int]) -> tuple[int, int]:
    """match_sample for a greedy target (p one-hot on its argmax, no draw): accept the drafts while they
    equal the target's argmax; next_token is the argmax after the accepted ones. target_argmax has K + 1."""
    num_accepted = 0
    while num_accepted < len(draft_token_ids) and draft_token_ids[num_accepted] == target_argmax[num_accepted]:
        num_accepted += 1
    return num_accepted, target_argmax[num_accepted]


def match_sample(draft_token_ids: torch.Tensor,  # [K] int, proposed by a deterministic draft (q one-hot)
                 target_probs: torch.Tensor,     # [K + 1, vocab] p, last row for the bonus token
                 seed: int,
                 start_position: int) -> tuple[int, int]:
    """Verification of a deterministic draft, coupled to plain decoding: at each position draw the
    target's token y_j ~ p_j with the very draw plain decoding would make there, and accept draft x_j
    iff y_j == x_j. So x_j is accepted with probability p_j(x_j) and a rejection leaves y_j distributed as
    p_j with x_j removed, renormalised: exactly min(1, p/q) and norm(max(0, p - q)) for a one-hot q.
    Returns (num_accepted, next_token) like rejection_sample. Every token is the draw plain decoding makes
    at its position, so a seeded request's output does not depend on K, on the draft or on batching.
    """
    k = draft_token_ids.shape[0]
    for j in range(k + 1):
        token = sample(target_probs[j], generator(seed, start_position + j, STREAM_TARGET, target_probs.device))
        if j == k or token != int(draft_token_ids[j]):
            return j, token
    raise AssertionError("unreachable")


def token_logprobs(logits: torch.Tensor,   # [n, vocab], the target's logits at n emitted tokens
                   tokens: list[int],      # the n tokens emitted there
                   sampling: Sampling,
                   top_n: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """Per emitted token: its logprob and the top_n most likely (token, logprob), most likely first.

    The distribution is the one the token was sampled from (logits_to_probs: temperature, top-k, top-p;
    -inf outside them). A greedy request's is one-hot, so it gets the model's raw log_softmax instead."""
    logits = logits.float()
    logprobs = torch.log_softmax(logits, -1) if sampling.greedy else logits_to_probs(logits, sampling).log()
    return picked(logprobs, tokens, top_n)


def picked(logprobs: torch.Tensor,   # [n, vocab]
           tokens: list[int], top_n: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """Per row: the logprob of its token and the top_n most likely (token, logprob), most likely first."""
    chosen = logprobs.gather(-1, torch.tensor(tokens, device=logprobs.device).view(-1, 1)).squeeze(-1).tolist()
    top = logprobs.topk(top_n, dim=-1) if top_n else None
    return [(chosen[i], list(zip(top.indices[i].tolist(), top.values[i].tolist())) if top_n else [])
            for i in range(len(tokens))]
