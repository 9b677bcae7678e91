"""min_new_tokens (vLLM's min_tokens): no EOS, stop token or stop string before the output's min_new_tokens-th
token. The end tokens' logits are -inf in the rows of a verify pass that predict one of those tokens (each row for
its own position, so a pass that straddles the boundary bans them in its first rows only), in the target's p and
the draft's q alike: greedy output is the target alone's with the same rule at every K, and sampled tokens follow
the target alone's distribution in both draft modes. Stop strings completed before then do not count."""
from __future__ import annotations

import pytest
import torch

from engine.penalties import penalize
from engine.sampling import Sampling
from protos.specpool.v1 import generation_pb2, worker_pb2
from router.stopping import StopStrings
from router.text import IncrementalDetokenizer
from tests import penalized_reference
from tests.distribution import chi_square_p_value
from tests.engine_rounds import accepted_drafts, run_rounds, runs_of_rounds


@pytest.mark.parametrize("output", [0, 3, 6], ids=["first-round", "straddling", "past-it"])
def test_each_row_bans_the_end_tokens_only_before_min_tokens(output):
    """Row j predicts output token output + j: the end tokens are -inf there while that is below min_tokens, and
    every other logit is untouched."""
    gen, vocab, prompt_length, k, ends, min_tokens = torch.Generator().manual_seed(2), 50, 5, 4, (7, 30), 5
    tokens = torch.randint(0, vocab, (prompt_length + output + k,), generator=gen).tolist()
    start, logits = len(tokens) - k, torch.randn(k + 1, vocab, generator=gen)
    got = penalize(logits, tokens, start, Sampling(prompt_length=prompt_length, min_tokens=min_tokens,
                                                   end_tokens=ends))
    for j in range(k + 1):
        expected = penalized_reference.penalized_row(logits[j], tokens[:start + j], prompt_length,
                                                     min_tokens=min_tokens, ends=ends)
        torch.testing.assert_close(got[j], expected, rtol=0, atol=0)
    banned = [j for j in range(k + 1) if output + j < min_tokens]
    assert banned == list(range(min(max(min_tokens - output, 0), k + 1)))
    assert all(torch.isinf(got[j, list(ends)]).all() for j in banned)


PROMPT_BYTES = list(b"def fib(n): return fib(n - 1) + fib(")


@pytest.mark.parametrize("k", [0, 1, 4])
def test_greedy_rounds_match_the_target_alone_with_min_tokens(byte_engines, k):
    """The tokens the target alone writes greedily at output positions 1 and 3 are end tokens (stop token IDs)
    until the 10th token: the output is the target alone's under that rule, which differs from its plain one."""
    draft, target, model = byte_engines
    plain = penalized_reference.greedy(model, PROMPT_BYTES, 24)
    ends, min_tokens = tuple(sorted({plain[1], plain[3]})), 10
    expected = penalized_reference.greedy(model, PROMPT_BYTES, 24, min_tokens=min_tokens, ends=ends)
    assert expected != plain and not set(expected[:min_tokens]) & set(ends)
    tokens = run_rounds(draft, target, PROMPT_BYTES, k, 24, generation_pb2.SamplingParams(top_p=1.0),
                        worker_pb2.DRAFT_MODE_GREEDY, min_tokens=worker_pb2.MinTokens(count=min_tokens, token_ids=ends))
    assert tokens[:len(expected)] == expected


def test_a_draft_that_is_the_target_has_every_draft_accepted_with_min_tokens(byte_pair):
    """The draft bans the end tokens in its own rows by the same rule: drafting with the target's own model, every
    greedy draft is accepted, across the boundary too."""
    from draft_worker.proposer import DraftEngine
    from target_worker.verifier import TargetEngine
    from transformers import AutoModelForCausalLM
    target_path = byte_pair[1]
    draft, target = DraftEngine(target_path), TargetEngine(target_path, target_path)
    plain = penalized_reference.greedy(AutoModelForCausalLM.from_pretrained(target_path).eval(), PROMPT_BYTES, 12)
    start = dict(sampling=generation_pb2.SamplingParams(top_p=1.0), prompt_length=len(PROMPT_BYTES),
                 min_tokens=worker_pb2.MinTokens(count=10, token_ids=sorted({plain[1], plain[3]})))
    assert accepted_drafts(draft, target, PROMPT_BYTES, start, 6, 4) == 6 * 4


PROMPT, SAMPLES = [0, 1, 2, 3], 2000


@pytest.mark.parametrize("mode", [worker_pb2.DRAFT_MODE_SAMPLED, worker_pb2.DRAFT_MODE_GREEDY],
                         ids=["sampled-draft", "greedy-draft"])
def test_sampled_tokens_follow_the_target_alones_distribution_with_min_tokens(tiny_engines, mode):
    """min_tokens 2 with EOS and the likeliest first token as end tokens, K = 2: both first tokens are decided in
    one round, the second on a row that must ban them too. Over SAMPLES seeds (t0, t1) follows the target alone's
    joint under the rule, which differs from the plain one by far more than the test can miss."""
    draft, target, model = tiny_engines
    eos = model.generation_config.eos_token_id
    plain = penalized_reference.first_two_joint(model, PROMPT)
    first = max((cell[0] for cell in plain if cell[0] != eos), key=lambda t: plain.get((t, 0), 0.0) + sum(
        p for (t0, _), p in plain.items() if t0 == t))
    ends = (first, eos)
    exact = penalized_reference.first_two_joint(model, PROMPT, min_tokens=2, ends=ends)
    assert sum(abs(exact.get(cell, 0.0) - p) for cell, p in plain.items()) > 0.5
    outcomes = [tuple(tokens) for tokens in runs_of_rounds(draft, target, PROMPT, 2, 2, [generation_pb2.SamplingParams(
        temperature=1.0, top_p=1.0, seed=seed) for seed in range(SAMPLES)], mode,
        min_tokens=worker_pb2.MinTokens(count=2, token_ids=ends))]
    cells = sorted(cell for cell in exact if cell[1] is not None)
    counts = [outcomes.count(cell) for cell in cells]
    assert sum(counts) == SAMPLES                      # never an end token in the first two
    assert chi_square_p_value(counts, [exact[c] for c in cells]) > 1e-4


class Chars:
    """A tokenizer whose token i is the character chr(97 + i)."""
    def decode(self, ids, **_):
        return "".join(chr(97 + i) for i in ids)


def pushed(tokens: list[int], stops: tuple, min_tokens: int, batch: int, include: bool = False) -> tuple[int, str]:
    """Push `tokens` `batch` at a time: (tokens kept, text) up to the first stop string that counts."""
    output, text, kept = StopStrings(IncrementalDetokenizer(Chars()), stops, min_tokens, include), "", 0
    for at in range(0, len(tokens), batch):
        piece = output.push(tokens[at:at + batch], final=at + batch >= len(tokens))
        text, kept = text + piece.text, kept + piece.kept
        if piece.stopped:
            break
    return kept, text


@pytest.mark.parametrize("batch", [1, 3, 8], ids=["one-by-one", "three-a-time", "all-at-once"])
def test_a_stop_string_completed_before_min_tokens_does_not_count(batch):
    """"bc" ends at token 3 and again at token 7 of "abcdabcd": min_tokens 4 skips the first, as vLLM does, however
    the tokens arrive; min_tokens 3 does not."""
    tokens = [0, 1, 2, 3, 0, 1, 2, 3]
    assert pushed(tokens, ("bc",), 0, batch) == (3, "a")
    assert pushed(tokens, ("bc",), 3, batch) == (3, "a")
    assert pushed(tokens, ("bc",), 4, batch) == (7, "abcda")
    assert pushed(tokens, ("bc",), 8, batch) == (8, "abcdabcd")


@pytest.mark.parametrize("batch", [1, 3, 8], ids=["one-by-one", "three-a-time", "all-at-once"])
def test_include_stop_str_in_output_cuts_after_the_first_stop_string(batch):
    """vLLM's include_stop_str_in_output: the text ends with the stop string that ended it, the first to begin
    ("cd" before "da" in "abcda"), past min_tokens as without it."""
    tokens = [0, 1, 2, 3, 0, 1, 2, 3]
    assert pushed(tokens, ("da", "cd"), 0, batch, include=True) == (4, "abcd")
    assert pushed(tokens, ("bc",), 4, batch, include=True) == (7, "abcdabc")
