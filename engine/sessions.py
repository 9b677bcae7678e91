"""Per-request KV caches held by a worker, keyed by the router's session id.

The router is the source of truth for committed tokens. Each call names the `position` the worker
should already hold; the store crops the cache back to it (dropping rejected drafts) or, if it
holds fewer tokens than that (never saw the session, evicted it, restarted), raises SessionLost so
the router re-sends the whole committed context with position 0.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from engine.recurrent_states import best, restore
from engine.sampling import Sampling

PREFILL_STALE_OPENS = 1024   # a session mid-prefill (Session.chunked) is passed over by eviction unless the worker
                             # opened this many sessions since its last chunk (counted, not timed: a TP group's
                             # ranks must evict alike)


class SessionLost(Exception):
    """The worker does not hold the tokens the router expects it to hold."""


@dataclass
class Session:
    sampling: Sampling
    length: int = 0                # tokens held in the cache
    last_used: float = field(default=0.0)
    tokens: list = field(default_factory=list)   # their IDs (on the target, its drafts after them)
    settled: int = 0               # of those, the ones the router has committed, as far as this worker knows: what
                                   # its release leaves in the prefix cache (engine.prefix_cache.PrefixCache.keep)
    ngram: object = None           # the target's prompt-lookup index of the committed tokens (engine.ngram)
    chunked: bool = False          # the worker holds part of its prompt, computed in chunks (prefill_chunks.py)
    constraint: object = None      # a structured-output request's grammar matcher (engine/constraints.py)
    prompt_logprobs: object = None  # the target's, while its prefill gathers them (target_worker/prompt_logprobs.py)
    opened: int = 0                # the store's open count when it was last opened (SessionStore._evict)
    checkpoints: list | None = None  # a recurrent model's: where a rollback goes back to (engine.recurrent_states)
    prediction: tuple = ()         # the target's: the request's predicted output (VerifyRequest.prediction_token_ids)
    _own: object = field(default=None, repr=False)     # its own DynamicCache, as last handed back
    _batch: object = field(default=None, repr=False)   # the RaggedBatch it was left in, not handed back yet
    _row: int = field(default=0, repr=False)           # its row there

    @property
    def cache(self):
        """transformers DynamicCache of the tokens held (None before the first forward). A session left in a
        batch (RaggedBatch.unpack) takes its view of its own columns there now, when first asked for it."""
        if self._batch is not None:
            batch, self._batch = self._batch, None
            self._own = batch.hand_back(self._row, self._own)
        return self._own

    @cache.setter
    def cache(self, cache) -> None:
        self._own, self._batch = cache, None

    def leave_in(self, batch, row: int) -> None:
        """Its columns are row `row` of `batch`: handed back lazily (see cache)."""
        self._batch, self._row = batch, row

    def held_in(self, batch, handed) -> bool:
        """Whether its cache is still exactly what `batch` left it: not handed back yet, or handed back as the
        layer-0 keys `handed` and untouched since (a crop or a forward elsewhere gives it new tensors)."""
        if self._batch is not None:
            return self._batch is batch
        return handed is not None and self._own.layers[0].keys is handed

    def crop(self, position: int) -> None:
        """Keep the first `position` tokens: rolled back in place in the batch it was left in, where that batch
        can (RaggedBatch.crop_row), else on its own cache."""
        if self.length > position:
            if self._batch is None or not self._batch.crop_row(self._row, position):
                self._crop_own(position)
            self.length = position
        del self.tokens[position:]

    def _crop_own(self, position: int) -> None:
        """Its own cache cropped to `position` tokens; SessionLost where transformers' layers cannot go back there
        (DeepSeek V4's windowed compressed layers, which roll back only while past states are recorded)."""
        try:
            self.cache.crop(position - self.length)   # negative: number of tokens to drop
        except RuntimeError as exc:
            raise SessionLost(f"the cache cannot roll back to {position} tokens: {exc}") from exc


class SessionStore:
    """LRU map of session id -> Session, bounded by max_sessions."""

    def __init__(self, max_sessions: int = 256, clock: Callable[[], float] = time.monotonic,
                 replay: Callable[[Session, list[int]], None] | None = None):
        self._sessions: OrderedDict[int, Session] = OrderedDict()
        self._max_sessions = max_sessions
        self._clock = clock
        self._replay = replay          # given (a recurrent model's store): computes tokens again on a session's cache
        self.started = 0               # sessions (re)started here, for load-balancing checks
        self._opens = 0                # sessions opened here (SessionStore._evict)

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, session_id: int, position: int, sampling: Sampling | None) -> Session:
        """The session, cropped to `position`; position 0 (re)starts it with `sampling`."""
        if position == 0:
            if sampling is None:
                raise ValueError("sampling params are required when a session starts (position 0)")
            session = Session(sampling=sampling, checkpoints=[] if self._replay else None)
            self._sessions[session_id] = session
            self.started += 1
        else:
            session = self._sessions.get(session_id)
            if session is None or session.length < position:
                held = 0 if session is None else session.length
                raise SessionLost(f"session {session_id}: router expects {position} tokens, worker holds {held}")
            try:
                if session.checkpoints is not None:
                    self._rewind(session, position)
                else:
                    session.crop(position)
            except SessionLost:            # a rollback past what the cache holds: the router starts it again
                del self._sessions[session_id]
                raise
        self._sessions.move_to_end(session_id)
        session.last_used = self._clock()
        self._opens += 1
        session.opened = self._opens
        while len(self._sessions) > self._max_sessions and self._evict(session_id):
            pass
        return session

    def _rewind(self, session: Session, position: int) -> None:
        """A recurrent model's rollback to `position` (engine.recurrent_states): back to the last checkpoint at or
        before it, then the tokens between computed again."""
        if session.length > position:
            point = best(session.checkpoints, position)
            if point is None:
                raise SessionLost(f"no checkpoint at or before {position} tokens to roll back to")
            session.checkpoints[:] = [c for c in session.checkpoints if c.length < point.length]   # later: the drafts'
            session.length = restore(session.cache, point)
        del session.tokens[position:]
        if position > session.length:
            self._replay(session, session.tokens[session.length:])

    def _evict(self, opened: int) -> bool:
        """Drop the least recently used session but the one just `opened`, passing over those mid-prefill: the rest
        of their prompt follows at once (Session.chunked), and dropped in between they would start again (unless
        stale, PREFILL_STALE_OPENS: their caller is gone). False: every other session is mid-prefill."""
        for session_id, session in self._sessions.items():
            if session_id != opened and (not session.chunked or self._opens - session.opened > PREFILL_STALE_OPENS):
                del self._sessions[session_id]
                return True
        return False

    def hold(self, session_id: int, session: Session) -> None:
        """Hold `session` again if the batch it runs in evicted it (it opened more sessions than max_sessions): a
        session mid-prefill (Session.chunked), whose next chunk follows at once."""
        if self._sessions.setdefault(session_id, session) is session:
            self._sessions.move_to_end(session_id)

    def release(self, session_id: int) -> bool:
        return self.take(session_id) is not None

    def take(self, session_id: int) -> Session | None:
        """Remove the session and return it (None: not held)."""
        return self._sessions.pop(session_id, None)


def sampling_from_proto(params, prompt_length: int = 0, min_tokens=None, grammar=None, bad_words=()) -> Sampling:
    """specpool.v1.SamplingParams (already normalised by the router), with a session start's prompt_length, worker
    MinTokens, Grammar and bad words' TokenSequences -> Sampling."""
    return Sampling(temperature=params.temperature, top_p=params.top_p if params.HasField("top_p") else 1.0,
                    top_k=params.top_k, seed=params.seed, frequency_penalty=params.frequency_penalty,
                    presence_penalty=params.presence_penalty,
                    repetition_penalty=params.repetition_penalty if params.HasField("repetition_penalty") else 1.0,
                    logit_bias=tuple(sorted(params.logit_bias.items())), prompt_length=prompt_length,
                    min_p=params.min_p, allowed_tokens=tuple(sorted(set(params.allowed_token_ids))),
                    min_tokens=min_tokens.count if min_tokens else 0,
                    end_tokens=tuple(sorted(min_tokens.token_ids)) if min_tokens else (),
                    grammar=grammar.llguidance if grammar else "",
                    grammar_eos=tuple(grammar.eos_token_ids) if grammar else (),
                    bad_words=tuple(tuple(word.token_ids) for word in bad_words))


def open_session(store: SessionStore, request) -> Session:
    """Open the session a Propose/Verify request names (sampling, prompt_length, min_tokens, grammar and a Verify
    request's prediction travel only with position 0)."""
    sampling = (sampling_from_proto(request.sampling, request.prompt_length,
                                    request.min_tokens if request.HasField("min_tokens") else None,
                                    request.grammar if request.HasField("grammar") else None, request.bad_words)
                if request.HasField("sampling") else None)
    session = store.open(request.session_id, request.position, sampling)
    if request.position == 0 and getattr(request, "prediction_token_ids", None):     # a VerifyRequest's start
        session.prediction = tuple(request.prediction_token_ids)
    return session


def open_sessions(store: SessionStore, requests: list, results: list) -> list[tuple[int, Session]]:
    """Open the sessions of a batch of requests (distinct session ids): [(index, session)] for those
    that opened; a request that cannot gets its error in results[index] (that row only). A session that fails
    to roll back to its position for any other reason than SessionLost / ValueError is dropped: the router
    re-prefills it."""
    rows = []
    for index, request in enumerate(requests):
        try:
            rows.append((index, open_session(store, request)))
        except Exception as exc:  # noqa: BLE001 - an error stays in its row
            results[index] = exc
            if not isinstance(exc, (SessionLost, ValueError)):
                store.release(request.session_id)
    return rows
