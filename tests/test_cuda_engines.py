"""The CUDA path of the engines (run on a GPU machine; skipped where there is none).

    python -m pytest -q tests/test_cuda_engines.py
"""
import pytest
import torch

from protos.specpool.v1 import generation_pb2, worker_pb2

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def run_rounds(draft, target, prompt, k, max_new, sampling, mode):
    """The router's loop in miniature: sync positions, propose, verify, commit."""
    tokens, draft_synced, target_synced = list(prompt), 0, 0
    while len(tokens) - len(prompt) < max_new:
        before = len(tokens)
        proposal = draft.propose(worker_pb2.ProposeRequest(
            session_id=1, position=draft_synced, new_token_ids=tokens[draft_synced:], k=k,
            sampling=sampling if draft_synced == 0 else None, mode=mode))
        drafts = list(proposal.draft_token_ids)
        verdict = target.verify(worker_pb2.VerifyRequest(
            session_id=1, position=target_synced, new_token_ids=tokens[target_synced:], draft_token_ids=drafts,
            draft_hidden_states=proposal.draft_hidden_states, sampling=sampling if target_synced == 0 else None))
        n = verdict.num_accepted
        tokens += drafts[:n] + [verdict.next_token_id]
        draft_synced, target_synced = before + min(n, k - 1), before + n
    return tokens[len(prompt):len(prompt) + max_new]


@pytest.fixture(scope="module")
def cuda_engines(byte_pair):
    from draft_worker.proposer import DraftEngine
    from target_worker.verifier import TargetEngine
    return (DraftEngine(byte_pair[0], device="cuda"), TargetEngine(byte_pair[1], byte_pair[0], device="cuda"))


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_on_cuda_matches_target_generate(cuda_engines, byte_pair, k):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(byte_pair[1]).cuda().eval()
    prompt = [5, 6, 7, 8, 9]
    expected = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=20, do_sample=False)
    got = run_rounds(*cuda_engines, prompt, k, 20, generation_pb2.SamplingParams(top_p=1.0, seed=1),
                     worker_pb2.DRAFT_MODE_GREEDY)
    assert got == expected[0, len(prompt):].tolist()


def test_sampled_draft_on_cuda_is_seed_deterministic(cuda_engines):
    sampling = generation_pb2.SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=3)
    runs = [run_rounds(*cuda_engines, [1, 2, 3], 3, 16, sampling, worker_pb2.DRAFT_MODE_SAMPLED) for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 16
