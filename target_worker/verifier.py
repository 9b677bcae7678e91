"""The target engine: one forward over new tokens + K drafts, then exact rejection sampling.

In sampled-draft mode the target recomputes q from the draft's hidden states with its own copy of
the draft's LM head and the same logits_to_probs transform the draft used. In greedy-draft mode q
is one-hot on the proposed tokens, and verification is coupled to plain decoding (match_sample).
"""
from __future__ import annotations

import torch

from protos.specpool.v1 import worker_pb2
from engine.batching import BatchStats, forward_groups, only_answer, prefills, run_isolated
from engine.constraints import session_constraint, warm_grammar_tokenizer
from engine.ngram import LookupMissed, NgramIndex
from engine.modeling import (batchable, check_same_vocabulary, extend_batch, load_lm_head, load_model,
                             replayer)
from engine.penalties import penalize
from engine.prefill_chunks import chunk_ends, prefilled
from engine.prefix_cache import PrefixCache, lookup_stats
from engine.sampling import Sampling, greedy_match, logits_to_probs, match_sample, rejection_sample, token_logprobs
from engine.sessions import SessionStore, open_sessions
from target_worker.prompt_logprobs import GATHERED_CHUNK, PromptLogprobs, as_entries


def draft_probs_from_hidden(head: torch.nn.Module, hidden_bytes: bytes, k: int, sampling: Sampling,
                            tokens: list[int] | tuple = (), start: int = 0, constraint=None) -> torch.Tensor:
    """q [K, vocab] recomputed from the draft's final hidden states (K x hidden, the head's dtype), the penalties
    and a structured-output request's grammar applied as the draft applied them: row j for `tokens` up to draft j
    (the K drafts from `start` on)."""
    weight = head.weight
    raw = torch.frombuffer(bytearray(hidden_bytes), dtype=torch.uint8)
    hidden = raw.view(weight.dtype).view(k, -1).to(weight.device)
    with torch.inference_mode():
        return logits_to_probs(restricted(head(hidden), tokens, start, sampling, constraint), sampling)


def restricted(logits: torch.Tensor, tokens: list[int], start: int, sampling: Sampling,
               constraint=None) -> torch.Tensor:  # [rows, vocab]
    """Rows of logits predicting positions start, start + 1, ... after the request's penalties and (`constraint`)
    its grammar, each for its own prefix in `tokens`."""
    logits = penalize(logits, tokens, start, sampling)
    return logits if constraint is None else constraint.mask(logits, tokens, start, sampling.prompt_length)


def own_drafts(request: worker_pb2.VerifyRequest, session, constraint_of=lambda session: None) -> list[int]:
    """The drafts a call verifies: those it carries or, with `lookup` set, the prompt-lookup drafts after the
    session's committed tokens (session.tokens, the call's new tokens included; from its prediction too, until a
    lookup drops it), up to the first one its grammar (`constraint_of(session)`) forbids there, which the target
    could only reject (it commits the same tokens)."""
    if request.draft_token_ids or not request.HasField("lookup"):
        return list(request.draft_token_ids)
    if session.ngram is None:
        session.ngram = NgramIndex(request.lookup.min_n, request.lookup.max_n, session.prediction,
                                   session.sampling.prompt_length)
    lookup = request.lookup
    if lookup.drop_prediction:
        session.ngram.drop_prediction()
    drafts = session.ngram.propose(session.tokens, lookup.max_tokens, lookup.min_match, lookup.max_tokens_by_match)
    constraint = constraint_of(session) if drafts else None
    if constraint is not None:
        drafts = drafts[:constraint.allowed_prefix(session.tokens[session.sampling.prompt_length:], drafts)]
    if not drafts and lookup.end_on_miss and lookup.max_tokens:
        raise LookupMissed(f"session {request.session_id}: no n-gram match")
    return drafts


def add_logprobs(response: worker_pb2.VerifyResponse, request: worker_pb2.VerifyRequest, drafts: list[int],
                 logits: torch.Tensor, sampling: Sampling) -> None:
    """If the call asks for them, the logprobs of the tokens it commits (the accepted drafts and the next
    token), from the very logits that verified them."""
    if not request.HasField("top_logprobs"):
        return
    committed = drafts[:response.num_accepted] + [response.next_token_id]
    response.logprobs.extend(as_entries(committed, token_logprobs(logits[:len(committed)], committed, sampling,
                                                                  request.top_logprobs)))


class TargetEngine:
    """Model, draft LM head and sessions of one target rank. Every rank of a TP group runs the same
    calls in the same order, so their caches stay identical; only rank 0 answers the router."""

    def __init__(self, model_path: str, draft_model_path: str, dtype: str = "float32", device: str = "cpu",
                 draft_dtype: str = "float32", tp_plan: str | None = None, max_sessions: int = 256,
                 prefix_cache_tokens: int = 0, prefill_chunk_tokens: int = 0):
        self.model = load_model(model_path, dtype, device, tp_plan)
        self.model_path = model_path
        self.draft_head = load_lm_head(draft_model_path, draft_dtype, device if not tp_plan else self.model.device)
        self.sessions = SessionStore(max_sessions, replay=replayer(self.model))   # replay: a recurrent model's
        self.batched = batchable(self.model)
        self.prefixes = PrefixCache(prefix_cache_tokens if self.batched else 0)   # only caches that crop and concat
        self.prefill_chunk = prefill_chunk_tokens   # 0: a call's new tokens in one forward, however many
        self.isolate = not tp_plan        # a TP group's ranks must stay in step: a failed forward is the group's
        self.stats = BatchStats()
        self._batch = None                # the last forward's RaggedBatch: the next one may run on it (holds())
        check_same_vocabulary(draft_model_path, model_path, self.draft_head.weight.shape[0],
                              self.model.config.vocab_size)
        warm_grammar_tokenizer(model_path, self.model)

    def verify(self, request: worker_pb2.VerifyRequest) -> worker_pb2.VerifyResponse:
        """One request alone (a batch of one)."""
        return only_answer(self.verify_batch([request]))

    @torch.inference_mode()
    def verify_batch(self, requests: list) -> list:
        """Verify several requests' drafts in one target forward, rejection-sampling each row on its own.

        Returns, per request, its VerifyResponse or the error it raised (that row only: see run_isolated).
        Rows are grouped into forwards by forward_groups.
        """
        results: list = [None] * len(requests)
        rows = open_sessions(self.sessions, requests, results)
        groups = forward_groups(rows, requests, self.batched, self.prefixes.max_blocks > 0)
        run_isolated(groups, lambda group: self._verify_rows(group, requests, results), results,
                     lambda i: self.sessions.release(requests[i].session_id), self.isolate)
        return results

    def _verify_rows(self, rows: list, requests: list, results: list) -> None:
        """One forward over rows [(index, session)], then the rejection sampler per row. A session start takes the
        beginning of its context from the prefix cache where it is there; a row with more new tokens left than
        prefill_chunk computes only the next chunk of them, and answers Prefilled."""
        found = {i: self._attach(session, requests[i]) for i, session in rows}
        ends = self._chunk_ends(rows, requests, found)                # where a chunked row's forward ends
        rows, drafts = self._drafts(rows, requests, results, ends)
        if not rows:
            return
        starts = [session.length - found[i] + len(requests[i].new_token_ids) for i, session in rows]
        logits, batch_tokens = self._forward(rows, requests, drafts, found, ends)
        self.stats.record(len(rows))
        for (i, session), row_drafts, row_logits, start in zip(rows, drafts, logits, starts):
            if session.prompt_logprobs is not None:                 # row_logits: every new position's
                session.prompt_logprobs.take(row_logits, requests[i].position, requests[i].new_token_ids)
                row_logits = row_logits[row_logits.shape[0] - len(row_drafts) - 1:]
            if i in ends:
                results[i] = prefilled(self.sessions, requests[i], session, found[i])
                continue
            try:
                row_logits = restricted(row_logits, session.tokens, start, session.sampling,
                                        self._constraint(session))                  # [K + 1, vocab]
                results[i] = self._sample_row(requests[i], row_drafts, session, row_logits, start)
                add_logprobs(results[i], requests[i], row_drafts, row_logits, session.sampling)
            except Exception as exc:  # noqa: BLE001 - a bad row fails alone
                results[i] = exc
                continue
            if session.prompt_logprobs is not None:                 # the prefill is complete
                results[i].prompt_logprobs.extend(session.prompt_logprobs.entries)
                session.prompt_logprobs = None
            results[i].batch_size, results[i].batch_tokens = len(rows), batch_tokens
            session.settled = start + results[i].num_accepted
            if requests[i].position == 0:
                results[i].prefix_cache.CopyFrom(lookup_stats(requests[i], found[i]))
            if requests[i].HasField("lookup"):
                results[i].draft_token_ids.extend(row_drafts)

    def _forward(self, rows: list, requests: list, drafts: list, found: dict, ends: dict) -> tuple[list, int]:
        """One forward over each row's new tokens (past the `found` ones the prefix cache gave it; a chunked row's
        up to its end) and drafts; a session start or chunk puts its full blocks in the prefix cache after: (logits
        per row [K + 1, vocab], the tokens the forward computed)."""
        tokens = [list(requests[i].new_token_ids)[found[i]:ends.get(i)] + row_drafts
                  for (i, _), row_drafts in zip(rows, drafts)]
        for (_, session), row_drafts in zip(rows, drafts):
            session.tokens.extend(row_drafts)
        last, self._batch = self._batch, None       # a forward that raises leaves no batch to run on again
        keeps = [len(row_tokens) if session.prompt_logprobs is not None else len(row_drafts) + 1
                 for row_tokens, row_drafts, (_, session) in zip(tokens, drafts, rows)]
        logits, batch = extend_batch(self.model, [session for _, session in rows], tokens, keeps, last)
        # A forward of one row or of prefills alone leaves the decode rows' batch to run on again.
        self._batch = batch if not all(prefills(requests[i]) for i, _ in rows) and len(rows) > 1 else last
        for (i, session), row_drafts in zip(rows, drafts):
            if i in ends or session.chunked:      # a long prompt's chunk or its last: all the session holds so far
                self.prefixes.remember(session, session.tokens[:len(session.tokens) - len(row_drafts)])
                session.chunked = i in ends
            elif requests[i].position == 0:
                self.prefixes.remember(session, requests[i].new_token_ids)
        return logits, sum(len(t) for t in tokens)

    def _drafts(self, rows: list, requests: list, results: list, ends: dict) -> tuple[list, list]:
        """The rows that run and their drafts (own_drafts, after the call's new tokens; none for a chunked row,
        whose tokens end at its chunk's end); a row whose lookup missed (end_on_miss) leaves the forward untouched,
        with LookupMissed as its result."""
        kept, drafts = [], []
        for i, session in rows:
            session.tokens.extend(requests[i].new_token_ids[:ends.get(i)])
            try:
                drafts.append([] if i in ends else own_drafts(requests[i], session, self._constraint))
                kept.append((i, session))
            except LookupMissed as exc:
                del session.tokens[session.length:]
                results[i] = exc
        return kept, drafts

    def _chunk_ends(self, rows: list, requests: list, found: dict) -> dict:
        """chunk_ends, a start gathering prompt logprobs chunked even where prefill_chunk is 0: its forward keeps
        every position's logits, at most GATHERED_CHUNK of them."""
        gathering = [(i, session) for i, session in rows if session.prompt_logprobs is not None]
        return {**chunk_ends(rows, requests, found, self.prefill_chunk),
                **chunk_ends(gathering, requests, found, min(self.prefill_chunk or GATHERED_CHUNK, GATHERED_CHUNK))}

    def _attach(self, session, request) -> int:
        """A session start's cached prompt blocks (PrefixCache.attach); one that asks for prompt logprobs computes
        its whole prompt, gathering them."""
        if request.position == 0 and request.HasField("prompt_logprobs"):
            length = session.sampling.prompt_length or len(request.new_token_ids)
            session.prompt_logprobs = PromptLogprobs(request.prompt_logprobs, length)
            return 0
        return self.prefixes.attach(self.model, session, request.new_token_ids)

    def _constraint(self, session):
        return session_constraint(session, self.model_path, self.model.config.vocab_size)

    def _sample_row(self, request, drafts: list[int], session, logits: torch.Tensor,
                    start: int) -> worker_pb2.VerifyResponse:
        """Rejection-sample one row: logits [K + 1, vocab] of the target at the K drafts and after them."""
        if session.sampling.greedy:             # p one-hot: compare the drafts with the argmax, no draw
            num_accepted, next_token = greedy_match(drafts, logits.argmax(-1).tolist())
            return worker_pb2.VerifyResponse(num_accepted=num_accepted, next_token_id=next_token)
        target_probs = logits_to_probs(logits, session.sampling)                  # [K + 1, vocab]
        draft_ids = torch.tensor(drafts, dtype=torch.long, device=target_probs.device)
        if not request.draft_hidden_states:     # a deterministic draft: q is one-hot on each draft
            num_accepted, next_token = match_sample(draft_ids, target_probs, session.sampling.seed, start)
            return worker_pb2.VerifyResponse(num_accepted=num_accepted, next_token_id=next_token)
        draft_probs = draft_probs_from_hidden(self.draft_head, request.draft_hidden_states, len(drafts),
                                              session.sampling, session.tokens, start, self._constraint(session))
        num_accepted, next_token = rejection_sample(draft_ids, draft_probs.to(target_probs.device), target_probs,
                                                    session.sampling.seed, start)
        return worker_pb2.VerifyResponse(num_accepted=num_accepted, next_token_id=next_token)

    def release(self, session_id: int) -> bool:
        """Drop a session that ended, leaving what it committed in the prefix cache."""
        return self.prefixes.release(self.sessions, session_id)
