"""Properties of the rejection sampler (engine.sampling), in the paper's vocabulary."""
import pytest
import torch

from engine.sampling import (STREAM_TARGET, Sampling, generator, greedy_match, logits_to_probs, match_sample,
                                    one_hot_draft_probs, rejection_sample, sample)
from tests.distribution import chi_square_p_value

VOCAB = 6


def random_rows(seed: int, rows: int, sharpness: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(rows, VOCAB, generator=g) * sharpness, -1)


def speculative_sequence(p: torch.Tensor, q: torch.Tensor, k: int, seed: int, length: int, sampler=rejection_sample):
    """Generate `length` tokens by speculative rounds where position j has target probs p[j] and draft
    probs q[j] (context-free, so the exact joint distribution is the product of the p rows)."""
    out, rounds = [], []
    while len(out) < length:
        start = len(out)
        kk = min(k, length - start - 1) if length - start > 1 else 0
        drafts = torch.tensor([sample(q[start + j], generator(seed, start + j, 7)) for j in range(kk)],
                              dtype=torch.long)
        n, nxt = sampler(drafts, q[start:start + kk], p[start:start + kk + 1], seed, start)
        new = drafts[:n].tolist() + [nxt]
        rounds.append(len(new))
        out.extend(new)
    return out[:length], rounds


@pytest.mark.parametrize("k", [1, 3])
def test_rejection_sampling_approximates_target_distribution(k):
    length, samples = 3, 12000
    p, q = random_rows(1, length), random_rows(2, length)
    counts = torch.zeros(length, VOCAB)
    for seed in range(samples):
        tokens, _ = speculative_sequence(p, q, k, seed, length)
        for pos, token in enumerate(tokens):
            counts[pos, token] += 1
    for pos in range(length):
        assert chi_square_p_value(counts[pos], p[pos]) > 1e-4, (pos, counts[pos] / samples, p[pos])


def test_tokens_per_round_match_acceptance_theory():
    """First round with K=2 yields 1 + b0 + b0*b1 tokens on average, b_j = sum_x min(p_j, q_j).
    A sampler that forgets the bonus token after K acceptances yields b0*b1 fewer."""
    k, samples = 2, 8000
    p, q = random_rows(3, k + 1), random_rows(4, k + 1)
    beta = torch.minimum(p, q).sum(-1)
    expected = 1 + beta[0] + beta[0] * beta[1]
    first = [speculative_sequence(p, q, k, seed, k + 1)[1][0] for seed in range(samples)]
    mean = sum(first) / samples
    assert abs(mean - float(expected)) < 0.03, (mean, float(expected))


def test_wrong_residual_is_detected():
    """Guard on the test itself: sampling the recovered token from p instead of norm(max(0, p - q))
    must fail the distribution check."""
    def wrong(drafts, q_rows, p_rows, seed, start):
        n, _ = rejection_sample(drafts, q_rows, p_rows, seed, start)
        return n, sample(p_rows[n], generator(seed, start + n, 99))
    p, q = random_rows(1, 2), random_rows(2, 2)
    counts = torch.zeros(VOCAB)
    for seed in range(6000):
        counts[speculative_sequence(p, q, 1, seed, 2, sampler=wrong)[0][0]] += 1
    assert chi_square_p_value(counts, p[0]) < 1e-4


def test_deterministic_when_seeded():
    p, q = random_rows(5, 4), random_rows(6, 4)
    runs = [speculative_sequence(p, q, 3, seed=1234, length=4)[0] for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    others = {tuple(speculative_sequence(p, q, 3, seed=s, length=4)[0]) for s in range(20)}
    assert len(others) > 1


def greedy_rows(argmaxes: list[int]) -> torch.Tensor:
    return one_hot_draft_probs(torch.tensor(argmaxes), VOCAB)


def test_greedy_perfect_match_accepts_all_plus_bonus():
    target = greedy_rows([1, 2, 3, 4])
    drafts = torch.tensor([1, 2, 3])
    assert rejection_sample(drafts, one_hot_draft_probs(drafts, VOCAB), target, 0, 10) == (3, 4)


def test_greedy_early_mismatch_returns_target_token():
    target = greedy_rows([1, 2, 3, 4])
    drafts = torch.tensor([1, 5, 3])
    assert rejection_sample(drafts, one_hot_draft_probs(drafts, VOCAB), target, 0, 10) == (1, 2)
    drafts = torch.tensor([0, 2, 3])
    assert rejection_sample(drafts, one_hot_draft_probs(drafts, VOCAB), target, 0, 10) == (0, 1)


def coupled(drafts, q_rows, p_rows, seed, start):
    """match_sample behind rejection_sample's signature (it needs no q: the draft is deterministic)."""
    return match_sample(drafts, p_rows, seed, start)


@pytest.mark.parametrize("sampler", [rejection_sample, coupled], ids=["rejection", "match"])
def test_greedy_draft_with_sampled_target_removes_the_rejected_token(sampler):
    """q one-hot on x: accept with probability p(x), else sample from p with x removed."""
    p = random_rows(7, 2)
    x = int(p[0].argmax())
    drafts = torch.tensor([x])
    q = one_hot_draft_probs(drafts, VOCAB)
    accepted, recovered = 0, torch.zeros(VOCAB)
    for seed in range(6000):
        n, token = sampler(drafts, q, p, seed, 0)
        accepted += n
        if n == 0:
            recovered[token] += 1
    assert abs(accepted / 6000 - float(p[0, x])) < 0.025
    assert recovered[x] == 0
    residual = p[0].clone()
    residual[x] = 0
    assert chi_square_p_value(recovered, residual / residual.sum()) > 1e-4


def test_logits_to_probs_top_k_top_p_and_greedy():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0, -2.0]])
    greedy = logits_to_probs(logits, Sampling(temperature=0.0))
    assert greedy.tolist() == [[1.0, 0, 0, 0, 0, 0]]
    top2 = logits_to_probs(logits, Sampling(temperature=1.0, top_k=2))
    assert (top2[0, 2:] == 0).all() and torch.allclose(top2.sum(), torch.tensor(1.0))
    full = torch.softmax(logits, -1)[0]
    nucleus = logits_to_probs(logits, Sampling(temperature=1.0, top_p=float(full[0]) + 1e-3))
    assert (nucleus[0] > 0).tolist() == [True, True, False, False, False, False]
    hot = logits_to_probs(logits, Sampling(temperature=0.5))
    assert torch.allclose(hot[0], torch.softmax(logits[0] / 0.5, -1))


@pytest.mark.parametrize("k", [0, 1, 3, 5])
def test_match_sampling_output_equals_plain_decoding_draws(k):
    """With a deterministic draft, every token is the draw plain decoding makes at its position, whatever
    the drafts and K: so a seeded request's output is independent of K, the draft and batching."""
    length = 8
    p = random_rows(8, length)
    q = one_hot_draft_probs(torch.tensor([int(row.argmax()) for row in random_rows(9, length)]), VOCAB)
    for seed in range(200):
        plain = [sample(p[pos], generator(seed, pos, STREAM_TARGET)) for pos in range(length)]
        tokens, _ = speculative_sequence(p, q, k, seed, length, sampler=coupled)
        assert tokens == plain, (seed, k)


def test_match_sampling_approximates_target_distribution():
    length, samples = 3, 8000
    p = random_rows(1, length)
    q = one_hot_draft_probs(p.argmax(-1), VOCAB)          # a good greedy draft: accepts often
    counts = torch.zeros(length, VOCAB)
    for seed in range(samples):
        tokens, _ = speculative_sequence(p, q, 2, seed, length, sampler=coupled)
        for pos, token in enumerate(tokens):
            counts[pos, token] += 1
    for pos in range(length):
        assert chi_square_p_value(counts[pos], p[pos]) > 1e-4, (pos, counts[pos] / samples, p[pos])


def test_greedy_match_equals_match_sampling_of_a_greedy_target():
    g = torch.Generator().manual_seed(3)
    for _ in range(300):
        k = int(torch.randint(0, 6, (), generator=g))
        argmax = torch.randint(0, VOCAB, (k + 1,), generator=g)
        drafts = torch.where(torch.rand(k, generator=g) < 0.7, argmax[:k], torch.randint(0, VOCAB, (k,), generator=g))
        expected = match_sample(drafts, greedy_rows(argmax.tolist()), seed=1, start_position=0)
        assert greedy_match(drafts.tolist(), argmax.tolist()) == expected
