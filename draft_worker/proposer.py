"""The draft engine: keep a KV cache per session and propose K tokens per call.

Greedy mode proposes the draft's argmax (q is one-hot, only token IDs travel). Sampled mode
samples each draft from q = logits_to_probs(lm_head(h)) with the request's sampling transform and
returns the final hidden states h, from which the target recomputes exactly the same q.
"""
from __future__ import annotations

import torch

from protos.specpool.v1 import worker_pb2
from target_worker.modeling import extend_hidden, load_model
from target_worker.sampling import STREAM_DRAFT, generator, logits_to_probs, sample
from target_worker.sessions import SessionStore, open_session


class DraftEngine:
    """Model + sessions of one draft worker. Not thread-safe: the server calls it from one thread."""

    def __init__(self, model_path: str, dtype: str = "float32", device: str = "cpu", max_sessions: int = 256):
        self.model = load_model(model_path, dtype, device)
        self.head = self.model.get_output_embeddings()
        self.sessions = SessionStore(max_sessions)

    @torch.inference_mode()
    def propose(self, request: worker_pb2.ProposeRequest) -> worker_pb2.ProposeResponse:
        session = open_session(self.sessions, request)
        sampled = request.mode == worker_pb2.DRAFT_MODE_SAMPLED and not session.sampling.greedy
        start = session.length + len(request.new_token_ids)     # absolute position of the first draft
        tokens, hiddens, inputs = [], [], list(request.new_token_ids)
        for j in range(request.k):
            hidden = extend_hidden(self.model, session, inputs)   # [hidden]
            logits = self.head(hidden[None])                       # [1, vocab]
            if sampled:
                probs = logits_to_probs(logits, session.sampling)[0]
                token = sample(probs, generator(session.sampling.seed, start + j, STREAM_DRAFT))
                hiddens.append(hidden)
            else:
                token = int(logits[0].argmax())
            tokens.append(token)
            inputs = [token]
        hidden_bytes = torch.stack(hiddens).contiguous().view(torch.uint8).numpy().tobytes() if hiddens else b""
        return worker_pb2.ProposeResponse(draft_token_ids=tokens, draft_hidden_states=hidden_bytes)

    def release(self, session_id: int) -> bool:
        return self.sessions.release(session_id)
