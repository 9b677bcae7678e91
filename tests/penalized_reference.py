"""The target alone with penalties, min_tokens and min_p, written independently of engine/penalties.py and
engine/sampling.py: one token at a time, each logit penalized by a plain count of the context, as vLLM's and
transformers' docs define them."""
from __future__ import annotations

import collections

import torch


def penalized_row(logits: torch.Tensor, context: list[int], prompt_length: int, frequency: float = 0.0,
                  presence: float = 0.0, repetition: float = 1.0, bias: dict | None = None, min_tokens: int = 0,
                  ends: tuple = (), allowed: tuple = (), bad_words: tuple = ()) -> torch.Tensor:
    """One position's logits [vocab] after allowed_token_ids (`allowed`), the logit bias, the penalties and min_tokens
    (no token of `ends` while the output is shorter than min_tokens), for the tokens before it (`context`, the
    prompt first), and vLLM's bad words (the last token of each whose other tokens end the output)."""
    row = logits.float().clone()
    output = context[prompt_length:]
    for word in bad_words:
        before = tuple(output[len(output) - len(word) + 1:]) if len(output) >= len(word) - 1 else None
        if len(word) == 1 or before == word[:-1]:
            row[word[-1]] = float("-inf")
    for token in range(row.shape[0]) if allowed else ():
        if token not in allowed:
            row[token] = float("-inf")
    if len(context) - prompt_length < min_tokens:
        for token in ends:
            row[token] = float("-inf")
    for token, value in (bias or {}).items():
        row[token] = row[token] + value
    output = collections.Counter(context[prompt_length:])
    for token in set(context):
        if repetition != 1.0:
            row[token] = row[token] / repetition if row[token] > 0 else row[token] * repetition
        if output[token]:
            row[token] = row[token] - frequency * output[token] - presence
    return row


def greedy(model, prompt: list[int], max_new: int, **penalties) -> list[int]:
    """Greedy decoding of `model` alone with the penalties, stopping after its EOS token."""
    from transformers import DynamicCache
    from engine.modeling import cache_keyword
    tokens, cache, fed = list(prompt), DynamicCache(config=model.config), 0
    keyword = cache_keyword(type(model))
    eos = model.generation_config.eos_token_id
    with torch.no_grad():
        while len(tokens) - len(prompt) < max_new and (len(tokens) == len(prompt) or tokens[-1] != eos):
            logits = model(torch.tensor([tokens[fed:]]), **{keyword: cache}, use_cache=True).logits[0, -1]
            fed = len(tokens)
            tokens.append(int(penalized_row(logits, tokens, len(prompt), **penalties).argmax()))
    return tokens[len(prompt):]


def min_p_filtered(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    """min_p as vLLM documents it: drop the tokens less likely than min_p times the most likely one, renormalise."""
    kept = torch.where(probs >= min_p * probs.max(), probs, torch.zeros_like(probs))
    return kept / kept.sum()


def first_two_joint(model, prompt: list[int], min_p: float = 0.0, **penalties) -> dict:
    """P(t0, t1) of `model` alone at temperature 1 with the penalties and min_p, as {(t0, t1): p}; (eos, None) when
    t0 is EOS."""
    eos = model.generation_config.eos_token_id

    def probs(context: list[int]) -> torch.Tensor:
        logits = model(torch.tensor([context])).logits[0, -1]
        return min_p_filtered(torch.softmax(penalized_row(logits, context, len(prompt), **penalties).double(), -1),
                              min_p)
    with torch.no_grad():
        p0, joint = probs(prompt), {}
        for t0 in range(p0.shape[0]):
            if t0 == eos:
                joint[(t0, None)] = float(p0[t0])
                continue
            p1 = probs(prompt + [t0])
            joint.update({(t0, t1): float(p0[t0] * p1[t1]) for t1 in range(p1.shape[0])})
    return joint
