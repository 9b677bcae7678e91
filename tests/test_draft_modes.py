"""Sampled-draft mode: q recomputed on the target from the draft's hidden states equals the q the
draft sampled from. Greedy-draft mode sends token IDs only. (Engines in-process, no Ray.)"""
import pytest
import torch

from draft_worker.proposer import DraftEngine
from protos.specpool.v1 import generation_pb2, worker_pb2
from engine.sampling import Sampling, logits_to_probs
from target_worker.verifier import TargetEngine, draft_probs_from_hidden

PROMPT = [0, 1, 2, 3, 4]


@pytest.fixture(scope="module")
def engines(tiny_pair):
    return DraftEngine(tiny_pair[0]), TargetEngine(tiny_pair[1], tiny_pair[0])


def propose(draft, mode, k=4, **sampling):
    params = generation_pb2.SamplingParams(seed=11, **sampling)
    request = worker_pb2.ProposeRequest(session_id=1, position=0, new_token_ids=PROMPT, k=k, sampling=params, mode=mode)
    return draft.propose(request)


def test_target_recomputes_the_draft_q(engines):
    draft, target = engines
    sampling = Sampling(temperature=0.8, top_p=0.95, top_k=6, seed=11)
    response = propose(draft, worker_pb2.DRAFT_MODE_SAMPLED, temperature=0.8, top_p=0.95, top_k=6)
    drafts = list(response.draft_token_ids)
    q_target = draft_probs_from_hidden(target.draft_head, response.draft_hidden_states, len(drafts), sampling)
    with torch.no_grad():   # the draft model alone, re-run from scratch on each prefix
        q_draft = torch.stack([logits_to_probs(draft.model(torch.tensor([PROMPT + drafts[:j]])).logits[:, -1],
                                               sampling)[0] for j in range(len(drafts))])
    assert torch.allclose(q_target, q_draft, atol=1e-5), (q_target - q_draft).abs().max()
    hidden = draft.model.config.hidden_size
    assert len(response.draft_hidden_states) == len(drafts) * hidden * 4      # K x hidden float32, no vocab


def test_greedy_draft_mode_sends_token_ids_only(engines):
    draft, _ = engines
    response = propose(draft, worker_pb2.DRAFT_MODE_GREEDY, temperature=1.0)
    assert response.draft_hidden_states == b""
    with torch.no_grad():
        tokens = list(PROMPT)
        for _ in range(4):
            tokens.append(int(draft.model(torch.tensor([tokens])).logits[0, -1].argmax()))
    assert list(response.draft_token_ids) == tokens[len(PROMPT):]
    assert response.ByteSize() <= 4 * 5 + 2


def test_mismatched_vocabularies_are_refused(tiny_pair, byte_pair):
    with pytest.raises(ValueError, match="do not share a vocabulary") as info:
        TargetEngine(byte_pair[1], tiny_pair[0])
    assert tiny_pair[0] in str(info.value) and byte_pair[1] in str(info.value)
