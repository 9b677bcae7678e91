"""Logit bias, allowed tokens and repetition, frequency and presence penalties (engine/penalties.py): each row of a verify pass is penalized for
its own prefix, drafts before it included, so speculation stays exact with them: greedy output is the target
alone's with the same penalties at every K, and sampled tokens follow the target alone's penalized distribution
in both draft modes. The reference (tests/penalized_reference.py) counts tokens one position at a time."""
from __future__ import annotations

import pytest
import torch

from engine.penalties import penalize
from engine.sampling import Sampling
from protos.specpool.v1 import generation_pb2, worker_pb2
from tests import penalized_reference
from tests.distribution import chi_square_p_value
from tests.engine_rounds import accepted_drafts, run_rounds, runs_of_rounds

# dyadic values, so that the reference's per-token arithmetic rounds exactly as the engine's vectorized one
BIAS = {ord("("): -100.0, ord(" "): 2.5, ord("n"): -1.5}
ALLOWED = tuple(sorted(set(b"def fib(n): return") | set(range(30, 38))))      # vLLM's allowed_token_ids
PENALTIES = {"repetition": dict(repetition=1.5), "frequency": dict(frequency=0.5), "presence": dict(presence=1.25),
             "logit bias": dict(bias=BIAS), "all three": dict(frequency=0.5, presence=0.25, repetition=1.25),
             "allowed tokens": dict(allowed=ALLOWED),
             "all": dict(frequency=0.5, presence=0.25, repetition=1.25, bias=BIAS, allowed=ALLOWED)}


def sampling(prompt_length: int = 0, frequency: float = 0.0, presence: float = 0.0, repetition: float = 1.0,
             bias: dict | None = None, allowed: tuple = (), **fields) -> Sampling:
    return Sampling(frequency_penalty=frequency, presence_penalty=presence, repetition_penalty=repetition,
                    logit_bias=tuple(sorted((bias or {}).items())), prompt_length=prompt_length,
                    allowed_tokens=allowed, **fields)


def sampling_params(temperature: float = 0.0, seed: int = 0, frequency: float = 0.0, presence: float = 0.0,
                    repetition: float = 1.0, bias: dict | None = None,
                    allowed: tuple = ()) -> generation_pb2.SamplingParams:
    return generation_pb2.SamplingParams(temperature=temperature, top_p=1.0, seed=seed, frequency_penalty=frequency,
                                         presence_penalty=presence, repetition_penalty=repetition,
                                         logit_bias=bias or {}, allowed_token_ids=allowed)


@pytest.mark.parametrize("output", [0, 6], ids=["first-round", "mid-output"])
@pytest.mark.parametrize("name", list(PENALTIES))
def test_each_row_is_penalized_for_its_own_prefix_drafts_included(name, output):
    """Row j predicts the token after the committed tokens and drafts 0..j-1: it counts those drafts as output,
    and the prompt's tokens only for the repetition penalty."""
    gen, vocab, prompt_length, k = torch.Generator().manual_seed(1), 130, 5, 4
    tokens = torch.randint(30, 41, (prompt_length + output + k,), generator=gen).tolist()   # repeats, BIAS's tokens
    start, logits = len(tokens) - k, 3 * torch.randn(k + 1, vocab, generator=gen)
    got = penalize(logits, tokens, start, sampling(prompt_length, **PENALTIES[name]))
    for j in range(k + 1):
        expected = penalized_reference.penalized_row(logits[j], tokens[:start + j], prompt_length, **PENALTIES[name])
        torch.testing.assert_close(got[j], expected, rtol=0, atol=0)
    assert not torch.equal(got, logits)


def test_a_request_without_penalties_gets_its_logits_untouched():
    logits = torch.randn(3, 7)
    assert penalize(logits, [1, 2, 3, 4], 2, sampling(prompt_length=1)) is logits


@pytest.mark.parametrize("k", [0, 1, 4])
@pytest.mark.parametrize("name", list(PENALTIES))
def test_greedy_rounds_match_the_target_alone_with_the_same_penalties(byte_engines, name, k):
    draft, target, model = byte_engines
    prompt, penalties = list(b"def fib(n): return fib(n - 1) + fib("), PENALTIES[name]
    expected = penalized_reference.greedy(model, prompt, 24, **penalties)
    assert expected != penalized_reference.greedy(model, prompt, 24)        # the penalties change this output
    tokens = run_rounds(draft, target, prompt, k, 24, sampling_params(**penalties), worker_pb2.DRAFT_MODE_GREEDY)
    assert tokens[:len(expected)] == expected


def test_a_draft_that_is_the_target_has_every_draft_accepted_with_penalties_too(byte_pair):
    """The draft penalizes its own logits for each draft's context as the target does: drafting with the target's
    own model, every greedy draft is the penalized target's choice and is accepted."""
    from draft_worker.proposer import DraftEngine
    from target_worker.verifier import TargetEngine
    target_path = byte_pair[1]
    draft, target = DraftEngine(target_path), TargetEngine(target_path, target_path)
    prompt, params = list(b"def fib(n): return fib(n - 1) + fib("), sampling_params(**PENALTIES["all three"])
    start = dict(sampling=params, prompt_length=len(prompt))
    assert accepted_drafts(draft, target, prompt, start, 6, 4) == 6 * 4


PROMPT, SAMPLES = [0, 1, 2, 3], 2000
STRONG = dict(frequency=1.0, presence=0.5, repetition=1.5)
RESTRICTED = dict(allowed=(1, 3, 4, 5, 8))     # the tiny pair's likeliest first token (0) left out, EOS (8) kept


@pytest.mark.parametrize("penalties", [STRONG, RESTRICTED], ids=["penalties", "allowed-tokens"])
@pytest.mark.parametrize("mode", [worker_pb2.DRAFT_MODE_SAMPLED, worker_pb2.DRAFT_MODE_GREEDY],
                         ids=["sampled-draft", "greedy-draft"])
def test_sampled_tokens_follow_the_target_alones_penalized_distribution(tiny_engines, mode, penalties):
    """K = 2 drafts the first two tokens in one round, so the second is decided on a row penalized for the first
    draft; over SAMPLES seeds (t0, t1) follows the target alone's penalized (or restricted) joint, which differs
    from the plain one by far more than the test can miss."""
    draft, target, model = tiny_engines
    exact = penalized_reference.first_two_joint(model, PROMPT, **penalties)
    plain = penalized_reference.first_two_joint(model, PROMPT)
    assert sum(abs(exact[cell] - plain[cell]) for cell in exact) > 0.2
    eos = model.generation_config.eos_token_id
    runs = runs_of_rounds(draft, target, PROMPT, 2, 2, [sampling_params(1.0, seed, **penalties)
                                                        for seed in range(SAMPLES)], mode)
    outcomes = [(tokens[0], None if tokens[0] == eos else tokens[1]) for tokens in runs]
    cells = sorted(exact, key=lambda c: (c[0], -1 if c[1] is None else c[1]))
    counts = [outcomes.count(cell) for cell in cells]
    assert sum(counts) == SAMPLES
    assert chi_square_p_value(counts, [exact[c] for c in cells]) > 1e-4
