"""Beam search over HTTP (`use_beam_search`, openai_api/beam_search.py). The search itself, on a synthetic model:
as wide as the whole tree it returns exactly the best-scoring sequences an exhaustive search finds, for any length
penalty. Served (the demo pair, completions and chat): its beams are those the same search finds over the target's
own log-probabilities computed by transformers, best first, a beam ending on EOS with finish_reason stop; a beam
wider than admission's slots still completes; parameters it does not take are 400s naming them."""
import asyncio
import itertools
import math

import httpx
import pytest
import torch

from openai_api.beam_search import Beam, score, search
from tests.test_openai_http import demo_target, served_over_http

EOS = 2


def table_logprob(prefix: tuple, token: int) -> float:
    """A fixed synthetic model over tokens 0..2 (2 is EOS): log-softmax of scores drawn from the prefix's hash."""
    scores = [math.sin(7.1 * hash(prefix + (t,)) % 1000) * 2.0 for t in range(3)]
    return scores[token] - math.log(sum(math.exp(s) for s in scores))


async def table_step(tokens: tuple) -> list[tuple[int, float]]:
    return sorted(((t, table_logprob(tokens, t)) for t in range(3)), key=lambda pair: -pair[1])


def exhaustive(max_tokens: int) -> list[Beam]:
    """Every sequence the model can emit in max_tokens: ended on EOS, or max_tokens long without one."""
    found = []
    for length in range(1, max_tokens + 1):
        for tokens in itertools.product(range(3), repeat=length):
            if EOS in tokens[:-1] or (length < max_tokens and tokens[-1] != EOS):
                continue
            logprob = sum(table_logprob(tokens[:i], t) for i, t in enumerate(tokens))
            found.append(Beam(tokens, logprob, tokens[-1] == EOS))
    return found


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.5])
def test_a_beam_as_wide_as_the_tree_finds_the_exhaustive_searchs_best(length_penalty):
    """With 4 tokens to go, at most 2^3 beams live at once: width 8 prunes nothing, so the 8 best beams are the 8
    best-scoring sequences of all 40."""
    beams = asyncio.run(search(table_step, width=8, max_tokens=4, prompt_len=5, eos_ids={EOS},
                               length_penalty=length_penalty))
    best = sorted(exhaustive(4), key=lambda beam: score(beam, 5, length_penalty), reverse=True)[:8]
    assert [beam.tokens for beam in beams] == [beam.tokens for beam in best]
    assert all(math.isclose(a.cum_logprob, b.cum_logprob) for a, b in zip(beams, best))


def test_a_narrow_beam_keeps_only_the_best_and_ranks_by_the_length_penalised_score():
    beams = asyncio.run(search(table_step, width=2, max_tokens=5, prompt_len=3, eos_ids={EOS}))
    keys = [score(beam, 3, 1.0) for beam in beams]
    assert len(beams) == 2 and keys == sorted(keys, reverse=True)
    assert all(beam.ended == (beam.tokens[-1] == EOS) for beam in beams)


# Served.

@pytest.fixture(scope="module")
def served(start_service):
    return served_over_http(start_service, http={"store_responses": 0},
                            router={"max_active_requests": 2, "max_queued_requests": 0})


@pytest.fixture(scope="module")
def reference():
    """The same search over the target's own log-probabilities (transformers, a full forward per step)."""
    model, tokenizer = demo_target()

    def beams(prompt_ids: list[int], width: int, max_tokens: int, length_penalty: float = 1.0) -> list[Beam]:
        async def step(tokens: tuple) -> list[tuple[int, float]]:
            with torch.no_grad():
                logits = model(torch.tensor([prompt_ids + list(tokens)])).logits[0, -1]
            top = torch.log_softmax(logits.float(), -1).topk(2 * width)
            return list(zip(top.indices.tolist(), top.values.tolist()))
        return asyncio.run(search(step, width, max_tokens, len(prompt_ids), {tokenizer.eos_token_id},
                                  length_penalty))
    return beams, tokenizer


def post(served, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{served.base_url}{path}", json={"model": served.model, **body}, timeout=120)


@pytest.mark.parametrize("width, length_penalty", [(1, 1.0), (3, 1.0), (4, 0.0)])
def test_completion_beams_are_the_targets_own_best_first(served, reference, width, length_penalty):
    """Width 4 against 2 admission slots (no queue): the steps take turns, none refused."""
    beams, tokenizer = reference
    prompt = "def __init__(self"
    answer = post(served, "/completions", {"prompt": prompt, "max_tokens": 8, "n": width, "use_beam_search": True,
                                           "length_penalty": length_penalty})
    assert answer.status_code == 200, answer.text
    expected = beams(tokenizer(prompt).input_ids, width, 8, length_penalty)
    choices = answer.json()["choices"]
    assert [c["index"] for c in choices] == list(range(width))
    assert [c["text"] for c in choices] == [tokenizer.decode(b.tokens, skip_special_tokens=True) for b in expected]
    assert [c["finish_reason"] for c in choices] == ["stop" if b.ended else "length" for b in expected]
    assert answer.json()["usage"]["completion_tokens"] == sum(len(b.tokens) - b.ended for b in expected)


def test_chat_beams_are_the_targets_own_over_the_chat_prompt(served, reference):
    beams, tokenizer = reference
    messages = [{"role": "user", "content": "class Stack:"}]
    answer = post(served, "/chat/completions", {"messages": messages, "max_tokens": 6, "n": 2,
                                                "use_beam_search": True})
    assert answer.status_code == 200, answer.text
    prompt = httpx.post(f"{served.base_url.removesuffix('/v1')}/tokenize",       # the chat prompt's token IDs
                        json={"model": served.model, "messages": messages}).json()["tokens"]
    expected = beams(prompt, 2, 6)
    assert [c["message"]["content"] for c in answer.json()["choices"]] == \
        [tokenizer.decode(b.tokens, skip_special_tokens=True) for b in expected]


@pytest.mark.parametrize("body, param", [
    ({"stream": True}, "stream"), ({"logprobs": 2}, "logprobs"), ({"stop": ["\n"]}, "stop"),
    ({"top_p": 0.5}, "top_p"), ({"n": 11}, "n"), ({"min_tokens": 2}, "min_tokens"),
])
def test_what_beam_search_does_not_take_is_a_400_naming_it(served, body, param):
    answer = post(served, "/completions", {"prompt": "x = ", "max_tokens": 4, "use_beam_search": True, **body})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
    assert post(served, "/completions", {"prompt": "x = ", "max_tokens": 2}).status_code == 200
