"""The draft engine: keep a KV cache per session and propose K tokens per call.

Greedy mode proposes the draft's argmax (q is one-hot, only token IDs travel). Sampled mode
samples each draft from q = logits_to_probs(lm_head(h)) with the request's sampling transform and
returns the final hidden states h, from which the target recomputes exactly the same q.

Calls that arrive together are batched: step j of every request's K steps runs as one forward
(a request with a smaller K leaves the batch after its last step).
"""
from __future__ import annotations

import torch

from protos.specpool.v1 import worker_pb2
from engine.batching import BatchStats, forward_groups, only_answer, run_isolated
from engine.modeling import RaggedBatch, batchable, load_model
from engine.sampling import STREAM_DRAFT, generator, logits_to_probs, sample
from engine.sessions import SessionStore, open_sessions


class DraftEngine:
    """Model + sessions of one draft worker. Not thread-safe: the server calls it from one thread."""

    def __init__(self, model_path: str, dtype: str = "float32", device: str = "cpu", max_sessions: int = 256):
        self.model = load_model(model_path, dtype, device)
        self.head = self.model.get_output_embeddings()
        self.sessions = SessionStore(max_sessions)
        self.batched = batchable(self.model)
        self.stats = BatchStats()

    def propose(self, request: worker_pb2.ProposeRequest) -> worker_pb2.ProposeResponse:
        """One request alone (a batch of one)."""
        return only_answer(self.propose_batch([request]))

    @torch.inference_mode()
    def propose_batch(self, requests: list, gone=None) -> list:
        """Propose drafts for several requests (distinct sessions); per request its ProposeResponse or the
        error it raised (that row only: see run_isolated). Rows are grouped into forwards by forward_groups.
        `gone(i)` says that request i's caller went away (a cancelled pre-draft): its row stops drafting at the
        next step."""
        results: list = [None] * len(requests)
        rows = [(i, s) for i, s in open_sessions(self.sessions, requests, results) if requests[i].k > 0]
        run_isolated(forward_groups(rows, requests, self.batched),
                     lambda group: self._propose_rows(group, requests, results, gone or (lambda i: False)),
                     results, lambda i: self.sessions.release(requests[i].session_id))
        for i, request in enumerate(requests):
            if results[i] is None:                 # k = 0: nothing to propose
                results[i] = worker_pb2.ProposeResponse()
        return results

    def _propose_rows(self, rows: list, requests: list, results: list, gone) -> None:
        """K steps over rows [(index, session)]: step j is one forward over the rows with K > j (a row whose
        caller went away stops early; its cache then holds fewer drafts, which the router never counts on)."""
        batch = RaggedBatch(self.model, [session for _, session in rows])
        ks = [requests[i].k for i, _ in rows]
        inputs = [list(requests[i].new_token_ids) for i, _ in rows]
        starts = [session.length + len(tokens) for (_, session), tokens in zip(rows, inputs)]
        tokens, hiddens = [[] for _ in rows], [[] for _ in rows]
        j = 0
        while any(k > j for k in ks):
            hidden = batch.forward(inputs, decoder_only=True)          # [B, n_new, hidden]
            last = torch.stack([hidden[r, len(t) - 1] if t else hidden[r, 0] for r, t in enumerate(inputs)])
            logits = self.head(last)                                    # [B, vocab]
            argmax = logits.argmax(-1).tolist()
            for r, (_, session) in enumerate(rows):
                if j < ks[r]:
                    tokens[r].append(self._draft_token(requests[rows[r][0]], session, logits[r], starts[r] + j,
                                                       hiddens[r], last[r], argmax[r]))
            ks = [len(tokens[r]) if gone(i) else ks[r] for r, (i, _) in enumerate(rows)]
            inputs = [[tokens[r][-1]] if j + 1 < ks[r] else [] for r in range(len(rows))]
            self.stats.record(sum(1 for k in ks if k > j))
            j += 1
        batch.unpack()
        for r, (i, _) in enumerate(rows):
            hidden_bytes = torch.stack(hiddens[r]).contiguous().view(torch.uint8).numpy().tobytes() if hiddens[r] else b""
            results[i] = worker_pb2.ProposeResponse(draft_token_ids=tokens[r], draft_hidden_states=hidden_bytes,
                                                    batch_size=len(rows))

    @staticmethod
    def _draft_token(request, session, logits: torch.Tensor, position: int, hiddens: list, hidden: torch.Tensor,
                     argmax: int) -> int:
        """The draft token at `position`: argmax (greedy mode), or a sample from q keeping its hidden state."""
        if request.mode != worker_pb2.DRAFT_MODE_SAMPLED or session.sampling.greedy:
            return argmax
        probs = logits_to_probs(logits[None], session.sampling)[0]
        hiddens.append(hidden)
        return sample(probs, generator(session.sampling.seed, position, STREAM_DRAFT, probs.device))

    def release(self, session_id: int) -> bool:
        return self.sessions.release(session_id)
