"""Background responses (`background: true`): a Response that goes on running after its POST is answered. GET
/v1/responses/{id} polls it (queued, in_progress, then its end), `?stream=true&starting_after=N` streams its events
again from any one and follows the rest, POST /v1/responses/{id}/cancel stops it. Its events are recorded as they
are made, so every stream of it is the same stream, and its Response is stored whatever its end (completed,
incomplete, failed or cancelled), with its events.

    curl localhost:8000/v1/responses -d '{"model": "target", "input": "def fib(n):", "background": true}'
    curl localhost:8000/v1/responses/resp_...                      # poll
    curl 'localhost:8000/v1/responses/resp_...?stream=true&starting_after=3'
    curl -X POST localhost:8000/v1/responses/resp_.../cancel
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

from openai_api.response_store import without_logprobs
from openai_api.responses_api import ResponseEvents
from router.oplog import say


class BackgroundRun:
    """One background response: its events so far (`log[i]` the one numbered i), its task while it runs."""

    def __init__(self):
        self.events: ResponseEvents | None = None
        self.log: list[str] = []
        self.task: asyncio.Task | None = None
        self.final: dict | None = None      # the Response, once over
        self._more = asyncio.Event()        # set when an event is recorded or the run is over (then replaced)

    def start(self, events: ResponseEvents, texts: AsyncIterator[str]) -> None:
        """Run on: record `texts`, the stream `events` writes (app.sse: it ends the request, counted and logged)."""
        self.events = events
        self.task = asyncio.create_task(self._record(texts))

    async def _record(self, texts: AsyncIterator[str]) -> None:
        kind = self.events.kind
        try:
            async with contextlib.aclosing(texts):
                async for text in texts:
                    self.log.append(text)
                    self._woken()
            self.final = self.events.response
        except asyncio.CancelledError:      # cancelled (POST .../cancel, DELETE): the output as far as it got
            self.final = self._ended("cancelled")
        except Exception as exc:  # noqa: BLE001 - no handler is left to answer a 500: the response failed
            say(f"background response {kind.id} failed: {exc!r}")
            self.final = self._ended("failed", {"code": "server_error", "message": f"internal error: {exc!r}"})
        finally:
            self._woken()

    def _ended(self, status: str, error: dict | None = None) -> dict:
        """The Response of a run that ended other than by its stream's end: its output as far as it got (stored)."""
        kind = self.events.kind
        return kind.done(kind.response(self.events.model, self.events.so_far("incomplete"), status, error))

    def _woken(self) -> None:
        self._more.set()
        self._more = asyncio.Event()

    @property
    def over(self) -> bool:
        return self.final is not None

    @property
    def size(self) -> int:
        """Characters its recorded events hold (what the store counts beside its conversation's text)."""
        return sum(map(len, self.log))

    def current(self) -> dict:
        """The Response as it stands (GET): queued until its output starts, in_progress with the output so far,
        then as it ended. Without logprobs, as a stored response keeps none."""
        if self.final is not None:
            return without_logprobs(self.final)
        status = "in_progress" if self.events.started else "queued"
        return without_logprobs(self.events.kind.response(self.events.model, self.events.so_far("in_progress"),
                                                          status))

    async def follow(self, after: int = -1) -> AsyncIterator[str]:
        """Its events numbered after `after`, those recorded at once, then the rest as they come, until it is over.
        A follower that leaves stops nothing."""
        at = after + 1
        while True:
            more = self._more
            while at < len(self.log):
                yield self.log[at]
                at += 1
            if self.over:
                return
            await more.wait()

    async def cancel(self) -> dict:
        """Stop it, if it still runs (its workers' sessions freed, its request counted CANCELLED): the Response as
        it ended (cancelling again, or once over, changes nothing)."""
        if not self.task.done():
            self.task.cancel()
            await asyncio.wait({self.task})
        return self.current()
