"""min_p (vLLM's and transformers'): after the temperature, tokens less likely than min_p times the likeliest are
left out, before top-k and top-p. It is part of the one function that turns logits into p and q
(engine/sampling.logits_to_probs), so speculation stays exact with it in both draft modes."""
from __future__ import annotations

import pytest
import torch

from engine.sampling import Sampling, logits_to_probs
from protos.specpool.v1 import generation_pb2, worker_pb2
from tests import penalized_reference
from tests.distribution import chi_square_p_value
from tests.engine_rounds import runs_of_rounds


def test_min_p_keeps_the_tokens_at_least_min_p_times_as_likely_as_the_likeliest():
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(4)) * 3
    for min_p in (0.0, 0.05, 0.3, 1.0):
        got = logits_to_probs(logits, Sampling(temperature=0.7, min_p=min_p))
        expected = torch.stack([penalized_reference.min_p_filtered(torch.softmax(row / 0.7, -1), min_p)
                                for row in logits])
        torch.testing.assert_close(got, expected)
    assert (logits_to_probs(logits, Sampling(temperature=0.7, min_p=1.0)) > 0).sum(-1).tolist() == [1] * 6


def test_min_p_comes_before_top_p_as_in_vllm():
    """p = (0.5, 0.3, 0.2) with min_p 0.5 keeps (0.625, 0.375); top-p 0.6 of that keeps the first alone, where top-p
    first (0.5 < 0.6: both of the first two) then min-p would keep two."""
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    got = logits_to_probs(logits, Sampling(temperature=1.0, min_p=0.5, top_p=0.6))
    torch.testing.assert_close(got, torch.tensor([[1.0, 0.0, 0.0]]))


def test_greedy_ignores_min_p():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(1))
    assert torch.equal(logits_to_probs(logits, Sampling(min_p=0.9)), logits_to_probs(logits, Sampling()))


PROMPT, SAMPLES, MIN_P = [0, 1, 2, 3], 2000, 0.2


@pytest.mark.parametrize("mode", [worker_pb2.DRAFT_MODE_SAMPLED, worker_pb2.DRAFT_MODE_GREEDY],
                         ids=["sampled-draft", "greedy-draft"])
def test_sampled_tokens_follow_the_target_alones_min_p_distribution(tiny_engines, mode):
    """K = 2 decides the first two tokens in one round; over SAMPLES seeds (t0, t1) follows the target alone's joint
    with min_p, which differs from the plain one by more than the test can miss."""
    draft, target, model = tiny_engines
    exact = penalized_reference.first_two_joint(model, PROMPT, min_p=MIN_P)
    plain = penalized_reference.first_two_joint(model, PROMPT)
    assert sum(abs(exact[cell] - plain[cell]) for cell in exact) > 0.4
    eos = model.generation_config.eos_token_id
    runs = runs_of_rounds(draft, target, PROMPT, 2, 2, [generation_pb2.SamplingParams(
        temperature=1.0, top_p=1.0, seed=seed, min_p=MIN_P) for seed in range(SAMPLES)], mode)
    outcomes = [(tokens[0], None if tokens[0] == eos else tokens[1]) for tokens in runs]
    cells = sorted(exact, key=lambda c: (c[0], -1 if c[1] is None else c[1]))
    counts = [outcomes.count(cell) for cell in cells]
    assert sum(counts) == SAMPLES
    assert chi_square_p_value(counts, [exact[c] for c in cells]) > 1e-4
