"""The draft engine: keep a KV cache per session and propose K tokens per call.

Greedy mode proposes the draft's argmax (q is one-hot, only token IDs travel). Sampled mode
samples each draft from q = logits_to_probs(lm_head(h)) with the request's sampling transform and
returns the final hidden states h, from which the target recomputes exactly the same q. Both apply the request's
penalties first (engine/penalties.py), for the row's own context, as the target does to p.

Calls that arrive together are batched: step j of every request's K steps runs as one forward
(a request with a smaller K leaves the batch after its last step). A pre-draft's rejection branches
(ProposeRequest.branches) are more rows of the same steps, each from a fork of its session's cache cut at the
branch point; they are dropped after the call, so the session holds its own row only. Each draft's runner-up
(its best other token) and third choice are answered when asked: the router's guesses of the target's correction
there.
"""
from __future__ import annotations

import torch

from protos.specpool.v1 import worker_pb2
from dataclasses import dataclass, field
from typing import NamedTuple

from engine.batching import BatchStats, forward_groups, only_answer, run_isolated
from engine.constraints import session_constraint, warm_grammar_tokenizer
from engine.modeling import RaggedBatch, batchable, fork_session, load_model, replayer
from engine.penalties import penalize
from engine.prefill_chunks import chunk_ends, prefilled
from engine.prefix_cache import PrefixCache, lookup_stats
from engine.sampling import STREAM_DRAFT, generator, logits_to_probs, sample
from engine.sessions import Session, SessionStore, open_sessions


class DraftRow(NamedTuple):
    """One row of a drafting batch: a request's own row, or one of its pre-draft branches (a fork of its cache)."""
    index: int                     # the request's index in the batch
    session: Session
    request: worker_pb2.ProposeRequest
    inputs: list                   # the tokens to append at the first step
    k: int                         # drafts to make
    start: int                     # context length at the first draft (its position, for the sampling stream)
    branch: bool = False
    context: list | None = None    # the tokens before its first draft, for the penalties and the grammar (None:
                                   # neither asked)
    constraint: object = None      # a structured-output request's grammar matcher (its own session's)


@dataclass
class Drafted:
    """What a row drafted: tokens, their hidden states (sampled mode) and each token's runner-up and third choice."""
    tokens: list = field(default_factory=list)
    hiddens: list = field(default_factory=list)
    runner_ups: list = field(default_factory=list)
    thirds: list = field(default_factory=list)

    def add(self, token: int, top3: list[int]) -> None:
        others = [t for t in top3 if t != token]       # the best tokens other than the draft, best first
        self.tokens.append(token)
        self.runner_ups.append(others[0])
        if len(others) > 1:                             # a vocabulary of 2 has no third choice
            self.thirds.append(others[1])

    def choices(self, asked: bool) -> dict:
        """The runner-up and third-choice fields of an answer: empty unless the request asked for them."""
        return {"runner_up_token_ids": self.runner_ups, "third_choice_token_ids": self.thirds} if asked else {}

    def hidden_bytes(self) -> bytes:
        return torch.stack(self.hiddens).cpu().contiguous().view(torch.uint8).numpy().tobytes() if self.hiddens else b""


def answer_rows(rows: list[DraftRow], drafted: list[Drafted], results: list) -> None:
    """Each request's ProposeResponse from its own row, with its branch rows' drafts in order (a branch of a row
    that failed is dropped with it)."""
    size = len({row.index for row in rows})
    for row, out in zip(rows, drafted):
        choices = out.choices(row.request.runner_ups)
        if not row.branch:
            results[row.index] = worker_pb2.ProposeResponse(
                draft_token_ids=out.tokens, draft_hidden_states=out.hidden_bytes(), batch_size=size, **choices)
        elif isinstance(results[row.index], worker_pb2.ProposeResponse):
            results[row.index].branch_drafts.add(token_ids=out.tokens, hidden_states=out.hidden_bytes(), **choices)


def penalized_row(row: DraftRow, out: Drafted, logits: torch.Tensor,   # [vocab]
                  top3: list[int]) -> tuple[torch.Tensor, list[int]]:
    """A row's logits at its next draft and their best three tokens, after the request's penalties and grammar for
    the row's context and the drafts it made so far (as they are, for a request with neither)."""
    if row.context is None:
        return logits, top3
    tokens, sampling = row.context + out.tokens, row.session.sampling
    logits = penalize(logits[None], tokens, len(tokens), sampling)
    if row.constraint is not None:
        logits = row.constraint.mask(logits, tokens, len(tokens), sampling.prompt_length, committed=False)
    return logits[0], logits[0].topk(min(3, logits.shape[-1])).indices.tolist()


class DraftEngine:
    """Model + sessions of one draft worker. Not thread-safe: the server calls it from one thread."""

    def __init__(self, model_path: str, dtype: str = "float32", device: str = "cpu", max_sessions: int = 256,
                 prefix_cache_tokens: int = 0, prefill_chunk_tokens: int = 0):
        self.model = load_model(model_path, dtype, device)
        self.model_path = model_path
        self.head = self.model.get_output_embeddings()
        self.sessions = SessionStore(max_sessions, replay=replayer(self.model))   # replay: a recurrent model's
        self.batched = batchable(self.model)
        self.prefixes = PrefixCache(prefix_cache_tokens if self.batched else 0)   # only caches that crop and concat
        self.prefill_chunk = prefill_chunk_tokens   # 0: a call's new tokens in one forward, however many
        self.stats = BatchStats()
        warm_grammar_tokenizer(model_path, self.model)      # the target's EOS tokens, if the draft's are the same

    def propose(self, request: worker_pb2.ProposeRequest) -> worker_pb2.ProposeResponse:
        """One request alone (a batch of one)."""
        return only_answer(self.propose_batch([request]))

    @torch.inference_mode()
    def propose_batch(self, requests: list, gone=None) -> list:
        """Propose drafts for several requests (distinct sessions); per request its ProposeResponse or the
        error it raised (that row only: see run_isolated). Rows are grouped into forwards by forward_groups.
        `gone(i)` says that request i's caller went away (a cancelled pre-draft): its rows stop drafting at the
        next step."""
        results: list = [None] * len(requests)
        opened = [(i, s) for i, s in open_sessions(self.sessions, requests, results) if requests[i].k > 0]
        run_isolated(forward_groups(opened, requests, self.batched, self.prefixes.max_blocks > 0),
                     lambda group: self._propose_group(group, requests, results, gone or (lambda i: False)),
                     results, lambda i: self.sessions.release(requests[i].session_id))
        for i, request in enumerate(requests):
            if results[i] is None:                 # k = 0: nothing to propose
                results[i] = worker_pb2.ProposeResponse()
        return results

    def _propose_group(self, group: list, requests: list, results: list, gone) -> None:
        """One forward group of opened sessions [(index, session)] (forward_groups: a session start alone), its
        pre-draft branches included. A session start takes what the prefix cache holds of its context first (so
        it finds what a start just before it in the same batch put there) and puts its full blocks there after. A
        row with more new tokens left than prefill_chunk computes the next chunk of them only (Prefilled)."""
        found = {i: self.prefixes.attach(self.model, session, requests[i].new_token_ids) for i, session in group}
        ends = chunk_ends(group, requests, found, self.prefill_chunk)
        for i, session in group:
            session.tokens.extend(requests[i].new_token_ids[:ends.get(i)])
            # what the router has committed (a pre-draft's own drafts not): its drafts follow in `tokens`
            session.settled = min(requests[i].committed or len(session.tokens), len(session.tokens))
        if ends:
            self._prefill([(i, session) for i, session in group if i in ends], requests, results, found, ends)
        rows = [row for i, session in group if i not in ends
                for row in self._rows_or_error(i, session, requests[i], results, found[i])]
        if rows:
            self._propose_rows(rows, results, gone)
        self._remember([(i, session) for i, session in group if i not in ends], found, requests, results)

    def _prefill(self, chunked: list, requests: list, results: list, found: dict, ends: dict) -> None:
        """One forward over the next chunk of each chunked row's new tokens: each answers Prefilled."""
        batch = RaggedBatch(self.model, [session for _, session in chunked])
        batch.forward([list(requests[i].new_token_ids)[found[i]:ends[i]] for i, _ in chunked], decoder_only=True)
        batch.unpack()
        self.stats.record(len(chunked))
        for i, session in chunked:
            self.prefixes.remember(session, session.tokens)
            results[i] = prefilled(self.sessions, requests[i], session, found[i])

    def _rows_or_error(self, index: int, session: Session, request, results: list, skip: int) -> list[DraftRow]:
        try:
            return self._rows(index, session, request, skip)
        except ValueError as exc:                  # a bad branch point: that request's error only
            results[index] = exc
            return []

    def _rows(self, index: int, session: Session, request, skip: int = 0) -> list[DraftRow]:
        """The request's own row, then one per pre-draft branch (a fork of the session's cache at the branch
        point; none for a model whose cache cannot be forked, which answers each branch with no drafts). The
        session holds the first `skip` new tokens already (from the prefix cache)."""
        new, constraint = list(request.new_token_ids)[skip:], self._constraint(session)
        penalized = session.sampling.penalized or constraint is not None
        rows = [DraftRow(index, session, request, new, request.k, session.length + len(new),
                         context=session.tokens if penalized else None, constraint=constraint)]
        for b in request.branches if self.batched else ():
            if not 0 < b.at <= session.length + len(new):
                raise ValueError(f"branches.at: {b.at} is past the context ({session.length + len(new)} tokens)")
            held = min(b.at, session.length)
            rows.append(DraftRow(index, fork_session(self.model, session, held), request,
                                 new[:b.at - held] + [b.token_id], request.k - 1, b.at + 1, branch=True,
                                 context=session.tokens[:b.at] + [b.token_id] if penalized else None,
                                 constraint=constraint))
        return rows

    def _constraint(self, session: Session):
        return session_constraint(session, self.model_path, self.model.config.vocab_size)

    def _remember(self, group: list, found: dict, requests: list, results: list) -> None:
        """Put the contexts of the sessions that started (or ended a prompt in chunks) and drafted into the prefix
        cache, and tell each start how much of its context it found there."""
        for i, session in group:
            if not isinstance(results[i], worker_pb2.ProposeResponse):
                continue
            if requests[i].position == 0 or session.chunked:
                self.prefixes.remember(session, session.tokens[:session.settled])   # the context, not the drafts
                session.chunked = False
            if requests[i].position == 0:
                results[i].prefix_cache.CopyFrom(lookup_stats(requests[i], found[i]))

    def _propose_rows(self, rows: list, results: list, gone) -> None:
        """Each row's K steps: step j is one forward over the rows with K > j (a row whose caller went away stops
        early; its cache then holds fewer drafts, which the router never counts on)."""
        batch = RaggedBatch(self.model, [row.session for row in rows])
        ks, inputs = [row.k for row in rows], [row.inputs for row in rows]
        drafted = [Drafted() for _ in rows]
        j = 0
        while any(k > j for k in ks):
            hidden = batch.forward(inputs, decoder_only=True)          # [B, n_new, hidden]
            last = torch.stack([hidden[r, len(t) - 1] if t else hidden[r, 0] for r, t in enumerate(inputs)])
            logits = self.head(last)                                    # [B, vocab]
            top3 = logits.topk(min(3, logits.shape[-1]), dim=-1).indices.tolist()   # [B, 3]: argmax, runner-up, third
            for r, (row, out) in enumerate(zip(rows, drafted)):
                if j < ks[r]:
                    row_logits, row_top3 = penalized_row(row, out, logits[r], top3[r])
                    out.add(self._draft_token(row.session, row.request.mode, row_logits, row.start + j, out.hiddens,
                                              last[r], row_top3[0]), row_top3)
            ks = [len(out.tokens) if gone(row.index) else k for row, out, k in zip(rows, drafted, ks)]
            inputs = [[out.tokens[-1]] if j + 1 < k else [] for out, k in zip(drafted, ks)]
            self.stats.record(sum(1 for k in ks if k > j))
            j += 1
        batch.unpack()
        for row, out in zip(rows, drafted):
            if not row.branch:              # what its cache now holds: each draft but the last was fed to it
                row.session.tokens.extend(out.tokens[:-1])
        answer_rows(rows, drafted, results)

    @staticmethod
    def _draft_token(session, mode: int, logits: torch.Tensor, position: int, hiddens: list, hidden: torch.Tensor,
                     argmax: int) -> int:
        """The draft token at `position`: argmax (greedy mode), or a sample from q keeping its hidden state."""
        if mode != worker_pb2.DRAFT_MODE_SAMPLED or session.sampling.greedy:
            return argmax
        probs = logits_to_probs(logits[None], session.sampling)[0]
        hiddens.append(hidden)
        return sample(probs, generator(session.sampling.seed, position, STREAM_DRAFT, probs.device))

    def release(self, session_id: int) -> bool:
        """Drop a session that ended, leaving the context it was last given in the prefix cache."""
        return self.prefixes.release(self.sessions, session_id)
