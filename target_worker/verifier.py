"""The target engine: one forward over new tokens + K drafts, then exact rejection sampling.

In sampled-draft mode the target recomputes q from the draft's hidden states with its own copy of
the draft's LM head and the same logits_to_probs transform the draft used. In greedy-draft mode q
is one-hot on the proposed tokens.
"""
from __future__ import annotations

import torch

from protos.specpool.v1 import worker_pb2
from target_worker.modeling import check_same_vocabulary, extend, load_lm_head, load_model
from target_worker.sampling import Sampling, logits_to_probs, one_hot_draft_probs, rejection_sample
from target_worker.sessions import SessionStore, open_session


def draft_probs_from_hidden(head: torch.nn.Module, hidden_bytes: bytes, k: int, sampling: Sampling) -> torch.Tensor:
    """q [K, vocab] recomputed from the draft's final hidden states (K x hidden, the head's dtype)."""
    weight = head.weight
    raw = torch.frombuffer(bytearray(hidden_bytes), dtype=torch.uint8)
    hidden = raw.view(weight.dtype).view(k, -1).to(weight.device)
    with torch.inference_mode():
        return logits_to_probs(head(hidden), sampling)


class TargetEngine:
    """Model, draft LM head and sessions of one target rank. Every rank of a TP group runs the same
    calls in the same order, so their caches stay identical; only rank 0 answers the router."""

    def __init__(self, model_path: str, draft_model_path: str, dtype: str = "float32", device: str = "cpu",
                 draft_dtype: str = "float32", tp_plan: str | None = None, max_sessions: int = 256):
        self.model = load_model(model_path, dtype, device, tp_plan)
        self.draft_head = load_lm_head(draft_model_path, draft_dtype, device if not tp_plan else self.model.device)
        self.sessions = SessionStore(max_sessions)
        check_same_vocabulary(draft_model_path, model_path, self.draft_head.weight.shape[0],
                              self.model.config.vocab_size)

    @torch.inference_mode()
    def verify(self, request: worker_pb2.VerifyRequest) -> worker_pb2.VerifyResponse:
        session = open_session(self.sessions, request)
        drafts = list(request.draft_token_ids)
        k = len(drafts)
        start = session.length + len(request.new_token_ids)     # absolute position of the first draft
        logits = extend(self.model, session, list(request.new_token_ids) + drafts, keep=k + 1)
        target_probs = logits_to_probs(logits, session.sampling)                  # [K + 1, vocab]
        draft_ids = torch.tensor(drafts, dtype=torch.long, device=target_probs.device)
        if request.draft_hidden_states:
            draft_probs = draft_probs_from_hidden(self.draft_head, request.draft_hidden_states, k, session.sampling)
        else:
            draft_probs = one_hot_draft_probs(draft_ids, target_probs.shape[-1])
        num_accepted, next_token = rejection_sample(draft_ids, draft_probs.to(target_probs.device), target_probs,
                                                    session.sampling.seed, start)
        return worker_pb2.VerifyResponse(num_accepted=num_accepted, next_token_id=next_token)

    def release(self, session_id: int) -> bool:
        return self.sessions.release(session_id)
