"""vLLM's bad_words (GenerateRequest.bad_words, HTTP `bad_words`): the last token of each word's token sequence is
never sampled where the output's tokens before it would complete the word. Row j of a verify pass bans it for its
own prefix, drafts included, as the draft does in its own rows, so greedy output is the target alone's with the
same rule at every K."""
from __future__ import annotations

import pytest
import torch

from engine.penalties import penalize
from engine.sampling import Sampling
from protos.specpool.v1 import generation_pb2, worker_pb2
from tests import penalized_reference
from tests.engine_rounds import accepted_drafts, run_rounds

WORDS = ((33, 35), (31,), (34, 36, 38), (35, 35))      # the row test's tokens are 30..40


@pytest.mark.parametrize("output", [0, 1, 6], ids=["first-round", "one-token-out", "mid-output"])
def test_each_row_bans_the_last_token_of_the_words_its_prefix_would_complete(output):
    gen, vocab, prompt_length, k = torch.Generator().manual_seed(3), 60, 4, 6
    for trial in range(20):
        tokens = torch.randint(30, 40, (prompt_length + output + k,), generator=gen).tolist()
        start, logits = len(tokens) - k, torch.randn(k + 1, vocab, generator=gen)
        got = penalize(logits, tokens, start, Sampling(prompt_length=prompt_length, bad_words=WORDS))
        for j in range(k + 1):
            expected = penalized_reference.penalized_row(logits[j], tokens[:start + j], prompt_length, bad_words=WORDS)
            torch.testing.assert_close(got[j], expected, rtol=0, atol=0)
    assert torch.isinf(got[:, 31]).all()                 # a one-token word: every row


PROMPT = list(b"def fib(n): return fib(n - 1) + fib(")


def bad_words_for(plain: list[int]) -> tuple:
    """Two words the target alone writes: its 2nd and 3rd output tokens, and its 6th alone."""
    return (tuple(plain[1:3]), (plain[5],))


@pytest.mark.parametrize("k", [0, 1, 4])
def test_greedy_rounds_match_the_target_alone_with_the_same_bad_words(byte_engines, k):
    draft, target, model = byte_engines
    words = bad_words_for(penalized_reference.greedy(model, PROMPT, 24))
    expected = penalized_reference.greedy(model, PROMPT, 24, bad_words=words)
    assert expected != penalized_reference.greedy(model, PROMPT, 24)
    tokens = run_rounds(draft, target, PROMPT, k, 24, generation_pb2.SamplingParams(top_p=1.0),
                        worker_pb2.DRAFT_MODE_GREEDY,
                        bad_words=[worker_pb2.TokenSequence(token_ids=word) for word in words])
    assert tokens[:len(expected)] == expected


def test_a_draft_that_is_the_target_has_every_draft_accepted_with_bad_words(byte_pair):
    from draft_worker.proposer import DraftEngine
    from target_worker.verifier import TargetEngine
    from transformers import AutoModelForCausalLM
    target_path = byte_pair[1]
    draft, target = DraftEngine(target_path), TargetEngine(target_path, target_path)
    words = bad_words_for(penalized_reference.greedy(AutoModelForCausalLM.from_pretrained(target_path).eval(),
                                                     PROMPT, 12))
    start = dict(sampling=generation_pb2.SamplingParams(top_p=1.0), prompt_length=len(PROMPT),
                 bad_words=[worker_pb2.TokenSequence(token_ids=word) for word in words])
    assert accepted_drafts(draft, target, PROMPT, start, 6, 4) == 6 * 4


def test_the_router_tokenizes_each_word_alone_and_after_a_space():
    from pathlib import Path
    from router.text import load_tokenizer, word_sequences
    tokenizer = load_tokenizer(str(Path(__file__).resolve().parent.parent / "deploy" / "models" / "demo-pair"
                                   / "target"))
    sequences = word_sequences(tokenizer, ["return None"])
    assert sequences == sorted({tuple(tokenizer.encode(text).ids) for text in ("return None", " return None")})
    assert len(sequences) == 2 and word_sequences(tokenizer, []) == []
