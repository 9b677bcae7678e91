"""Gathering a worker's calls into batches: the target verifies many requests' drafts in one forward,
the draft runs its K sequential steps for many requests at once.

A Batcher takes calls from the gRPC handlers. When the engine thread is free it waits up to `max_wait_s`
after the first waiting call for more to arrive (or until `max_batch` are waiting), then runs them as one
engine call; calls that arrive while a batch runs queue for the next one, so a busy worker batches
without waiting at all. Before taking the next batch it lets the callers just answered run once: a decode
run submits its next step at once, and taken before it could, the calls that queued during the batch would
run alone, then it alone, and so on (measured: 16 decode runs settled into two alternating halves, 7.4 rows
per forward instead of 13.5). A session appears at most once per batch (its rounds are sequential anyway); a call
cancelled while it waits never runs. `max_batch` 1 turns batching off. No torch here.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Awaitable, Callable

from engine.device_memory import exhausted, release_cached
from engine.prefix_cache import BLOCK


@dataclass
class BatchStats:
    """Cumulative counts of one worker's forward passes, for benchmarks and tests."""
    forward_passes: int = 0
    rows: int = 0
    max_batch: int = 0

    def record(self, rows: int) -> None:
        self.forward_passes += 1
        self.rows += rows
        self.max_batch = max(self.max_batch, rows)

    def as_dict(self) -> dict:
        return {"forward_passes": self.forward_passes, "rows": self.rows, "max_batch": self.max_batch}


START_SLACK, START_SHARE = 32, 0.25   # padding a forward of session starts may carry: tokens, plus a share of it
START_TOKENS = 4096                   # the most tokens (padding included) a forward of several session starts takes
SHARED_LEAD = 4 * BLOCK               # a start waits for a later forward to find its lead cached only when the lead it
                                      # shares with another start of the forward is this long: a forward's own cost
                                      # (about 2 ms on the demo pair here, 15 tokens' compute) exceeds computing a
                                      # shorter lead twice. Replayed, a 16-stream sample's starts (20-32 tokens, 3
                                      # prompts) took 0.88x the time computing it twice (2 forwards a call, not 2-6).
PREFILL_TOKENS = 32                   # a call appending more tokens than this (a long prompt's later chunks, a draft
                                      # far behind) runs with the session starts, not beside the decode rows


def prefills(request) -> bool:
    """Whether a call runs with the session starts: it starts its session, or appends more than PREFILL_TOKENS."""
    return request.position == 0 or len(request.new_token_ids) > PREFILL_TOKENS


def forward_groups(rows: list, requests: list, batched: bool, prefix_cached: bool = False) -> list[list]:
    """How an engine runs a batch's opened rows [(index, session, ...)]: session starts and other long appends
    (prefills) in forwards of their own (start_groups; `prefix_cached`: the engine has a prefix cache), so a long
    prompt never pads the decode rows, then the decode rows together; every row alone for a model whose cache
    cannot be padded."""
    starts = [row for row in rows if prefills(requests[row[0]])]
    decode = [row for row in rows if not prefills(requests[row[0]])]
    if not batched:
        return [[row] for row in starts + decode]
    return start_groups(starts, requests, prefix_cached) + ([decode] if decode else [])


def start_groups(starts: list, requests: list, prefix_cached: bool = True) -> list[list]:
    """Session starts in as few forwards as padding allows: shortest first, each start joining the forward being
    formed while its padding (each row right-padded to the longest) stays within START_SLACK tokens plus START_SHARE
    of the forward, and START_TOKENS in all. Each row keeps only its own logits (extend_batch). With a prefix cache,
    a start whose first SHARED_LEAD tokens another start of that forward begins with goes in a later one, so that it
    finds them cached (engine/prefix_cache.py) instead of computing them again: the n choices of a long prompt run in
    two forwards, the first choice's and then the others'. A shorter shared lead is computed twice, in one forward."""
    groups, pending, cached = [], sorted(starts, key=lambda row: len(requests[row[0]].new_token_ids)), {None}
    while pending:
        group, lengths, leads, later = [], [], set(), []
        for row in pending:
            tokens = requests[row[0]].new_token_ids
            lead = tuple(tokens[:SHARED_LEAD]) if prefix_cached and len(tokens) > SHARED_LEAD else None
            if group and ((lead in leads and lead not in cached) or not _padding_fits(lengths + [len(tokens)])):
                later.append(row)
                continue
            group.append(row)
            lengths.append(len(tokens))
            leads.add(lead)
        groups.append(group)
        cached |= leads            # an earlier forward's leads are cached by the time a later one runs
        pending = later
    return groups


def _padding_fits(lengths: list[int]) -> bool:
    """Whether session starts of these lengths may share a forward (each right-padded to the longest)."""
    padded = max(lengths) * len(lengths)
    return padded <= START_TOKENS and padded - sum(lengths) <= START_SLACK + START_SHARE * padded


def run_isolated(groups: list[list], run_group: Callable[[list], None], results: list, drop: Callable[[int], None],
                 isolate: bool = True) -> None:
    """Run each group of rows [(index, session, ...)] as one forward (run_group fills results). A group that raises
    runs again row by row, each row back at the length it held, so that only the row that fails gets the error,
    in results[index]; its session is dropped (drop(index)), since its cache may be half-updated: the router
    re-prefills it. isolate=False (the ranks of a TP group, which must stay in step): the error propagates. A group
    that ran out of memory hands the allocator's cached blocks back first (engine.device_memory)."""
    for group in groups:
        lengths = [row[1].length for row in group]
        try:
            run_group(group)
        except Exception as exc:                  # noqa: BLE001 - any error of a forward stays in its row
            if exhausted(exc):
                release_cached()
            if not isolate:
                raise
            if len(group) == 1:
                results[group[0][0]] = exc
                drop(group[0][0])
                continue
            for row, length in zip(group, lengths):
                row[1].crop(length)
            run_isolated([[row] for row in group], run_group, results, drop)


def only_answer(results: list):
    """The answer of a batch of one, raising the error its row got."""
    if isinstance(results[0], Exception):
        raise results[0]
    return results[0]


class Batcher:
    """Runs `run_batch(requests, gone) -> [response or exception per request]` over the calls submitted to it.
    `gone(i)` tells the engine, between its steps, that the caller of row i went away (cancelled), so a
    multi-step engine (the draft) can stop working for it. `counts`, if given, is kept told how many calls wait
    (its `waiting` attribute: the target's Signals, which its engine reads between steps)."""

    def __init__(self, run_batch: Callable[[list, Callable[[int], bool]], Awaitable[list]], max_batch: int = 1,
                 max_wait_s: float = 0.0, counts=None):
        if max_batch < 1 or max_wait_s < 0:
            raise ValueError(f"need max_batch >= 1 and max_wait_s >= 0 (got {max_batch}, {max_wait_s})")
        self._run_batch, self._max_batch, self._max_wait_s = run_batch, max_batch, max_wait_s
        self._pending: list[tuple[object, asyncio.Future]] = []
        self._counts = counts
        self._waiting = 0                 # calls submitted and not yet answered
        self._arrived: asyncio.Event | None = None
        self._full: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    @property
    def waiting(self) -> int:
        return self._waiting

    @waiting.setter
    def waiting(self, n: int) -> None:
        self._waiting = n
        if self._counts is not None:
            self._counts.waiting = n

    async def submit(self, request):
        """The response to `request` once its batch has run (or the exception its row raised)."""
        loop = asyncio.get_running_loop()
        if self._task is None:
            self._arrived, self._full = asyncio.Event(), asyncio.Event()
            self._task = loop.create_task(self._serve())
        future = loop.create_future()
        self._pending.append((request, future))
        self._arrived.set()
        if len(self._pending) >= self._max_batch:
            self._full.set()
        self.waiting += 1
        try:
            return await future
        finally:
            self.waiting -= 1

    async def _serve(self) -> None:
        while True:
            await self._arrived.wait()
            if self._max_wait_s > 0 and len(self._pending) < self._max_batch:
                try:
                    await asyncio.wait_for(self._full.wait(), self._max_wait_s)
                except asyncio.TimeoutError:
                    pass
            batch = self._take()
            if batch:
                await self._run(batch)
                await asyncio.sleep(0)            # the callers just answered resubmit first (module doc)

    def _take(self) -> list[tuple[object, asyncio.Future]]:
        """Up to max_batch waiting calls, oldest first, one per session; the rest wait for the next batch."""
        batch, rest, sessions = [], [], set()
        for request, future in self._pending:
            if future.done():                     # cancelled while waiting: never runs
                continue
            if len(batch) < self._max_batch and request.session_id not in sessions:
                batch.append((request, future))
                sessions.add(request.session_id)
            else:
                rest.append((request, future))
        self._pending = rest
        if not rest:
            self._arrived.clear()
        if len(rest) < self._max_batch:
            self._full.clear()
        return batch

    async def _run(self, batch: list[tuple[object, asyncio.Future]]) -> None:
        queue_depth = len(self._pending)
        futures = [future for _, future in batch]
        try:
            results = await self._run_batch([request for request, _ in batch], lambda i: futures[i].done())
        except Exception as exc:                  # noqa: BLE001 - the whole batch failed: every caller hears it
            results = [exc] * len(batch)
        for (_, future), result in zip(batch, results):
            if future.done():                     # its caller went away mid-batch
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                if hasattr(result, "queue_depth"):
                    result.queue_depth = queue_depth
                future.set_result(result)
