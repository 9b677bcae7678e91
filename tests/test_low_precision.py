"""Greedy speculation in bfloat16 and float16: the target's output, up to ties at the dtype's precision.

In float32 the output is the target's, token for token (tests/test_e2e_greedy.py). In a 16-bit dtype a verify pass
over K + 1 tokens rounds differently from plain decoding's one-token passes. So where the target's two best logits
lie within one unit in the last place (ulp) of each other, the two can pick different tokens of that tie, and their
continuations part there. transformers' assisted generation does the same, at the same positions (session 32: 7 of
18 runs of 40 tokens on the demo pair in bfloat16, for both; 5 of this test's 14 runs in bfloat16, none in float16).
This checks, on the demo pair (trained, so that drafts are accepted), that every difference is such a tie: the
tokens are equal up to the first difference, and there the token speculation chose scores within one ulp of the
best in plain decoding.

    python -m pytest -q tests/test_low_precision.py
"""
import math
from pathlib import Path

import pytest
import torch

from benchmarks.plan import PREDICTABLE
from protos.specpool.v1 import generation_pb2, worker_pb2
from tests.engine_rounds import run_rounds

DEMO_PAIR = Path(__file__).resolve().parent.parent / "deploy" / "models" / "demo-pair"
PROMPTS = PREDICTABLE + [[5, 6, 7, 8, 9], [72, 101, 108, 108, 111], [33], [100, 101, 102, 103]]   # text or token IDs
MAX_NEW = 40


@pytest.fixture(scope="module", params=["bfloat16", "float16"])
def low_precision(request):
    """(dtype name, tokenizer, the target for plain decoding, draft engine, target engine), all in that dtype."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draft_worker.proposer import DraftEngine
    from target_worker.verifier import TargetEngine
    dtype, draft, target = request.param, str(DEMO_PAIR / "draft"), str(DEMO_PAIR / "target")
    model = AutoModelForCausalLM.from_pretrained(target, dtype=getattr(torch, dtype)).eval()
    return (dtype, AutoTokenizer.from_pretrained(target), model, DraftEngine(draft, dtype=dtype),
            TargetEngine(target, draft, dtype=dtype, draft_dtype=dtype))


def ulp(value: float, dtype: str) -> float:
    """The spacing of `dtype`'s numbers at |value|."""
    exponent = math.floor(math.log2(abs(value))) if value else 0
    return torch.finfo(getattr(torch, dtype)).eps * 2.0 ** exponent


def plain_decoding(model, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    """The target's greedy tokens alone and the logits it chose each from (on the model's device, logits on the
    host)."""
    out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=MAX_NEW, do_sample=False,
                         output_scores=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [score[0].float().cpu() for score in out.scores]


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_differs_from_the_target_alone_only_at_a_tie_within_one_ulp(low_precision, k):
    assert_ties_only(*low_precision, k)


def assert_ties_only(dtype: str, tokenizer, model, draft, target, k: int) -> None:
    """Each prompt's greedy rounds at K = k equal plain decoding up to the first difference, and there the token
    chosen scores within one ulp of the best (tests/test_cuda_engines.py runs it on CUDA)."""
    for text in PROMPTS:
        prompt = tokenizer(text).input_ids if isinstance(text, str) else text
        expected, logits = plain_decoding(model, prompt)
        got = run_rounds(draft, target, prompt, k, MAX_NEW, generation_pb2.SamplingParams(top_p=1.0, seed=1),
                         worker_pb2.DRAFT_MODE_GREEDY)
        draft.release(1)
        target.release(1)
        first = next((j for j, (a, b) in enumerate(zip(got, expected)) if a != b), None)
        if first is None:
            assert got == expected
            continue
        best = float(logits[first].max())
        chosen = float(logits[first][got[first]])
        assert chosen >= best - ulp(best, dtype), (prompt, k, first, chosen, best)
