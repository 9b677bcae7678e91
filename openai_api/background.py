"""Background responses (`background: true`): a Response that goes on running after its POST is answered. GET
/v1/responses/{id} polls it (queued, in_progress, then its end), `?stream=true&starting_after=N` streams its events
again from any one and follows the rest, POST /v1/responses/{id}/cancel stops it. Its events are recorded as they
are made, so every stream of it is the same stream, and once it is over its Response is stored, with its events,
whatever its end (completed, incomplete, failed or cancelled).

    curl localhost:8000/v1/responses -d '{"model": "target", "input": "def fib(n):", "background": true}'
    curl localhost:8000/v1/responses/resp_...                      # poll
    curl 'localhost:8000/v1/responses/resp_...?stream=true&starting_after=3'
    curl -X POST localhost:8000/v1/responses/resp_.../cancel
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

from openai_api.protocol import ApiError
from openai_api.responses_api import ResponseEvents, without_logprobs
from router.oplog import say


class BackgroundRun:
    """One background response: its events so far (`log[i]` the one numbered i), its task while it runs."""

    def __init__(self):
        self.events: ResponseEvents | None = None   # while it runs
        self.log: list[str] = []
        self.task: asyncio.Task | None = None
        self.final: dict | None = None      # the Response, once over (without logprobs, as stored)
        self._more = asyncio.Event()        # set when an event is recorded or the run is over (then replaced)
        self._texts: AsyncIterator[str] | None = None
        self._reservations: tuple = ()

    @classmethod
    def finished(cls, log: list[str], final: dict) -> "BackgroundRun":
        """A run over, as a store that outlives the router that ran it gives it back (FileStore): its events
        recorded, its Response as it ended. It streams again, and cancelling it changes nothing."""
        run = cls()
        run.log, run.final = log, final
        return run

    def start(self, events: ResponseEvents, texts: AsyncIterator[str], reservations: tuple = ()) -> None:
        """Run on: record `texts`, the stream `events` writes (app.sse: it ends the request, counted and logged);
        `reservations`: its places in admission (router.server.Reservation), released if it never runs."""
        self.events, self._texts, self._reservations = events, texts, reservations
        self.task = asyncio.create_task(self._record())

    async def _record(self) -> None:
        final = None
        try:
            async with contextlib.aclosing(self._texts):
                async for text in self._texts:
                    self.log.append(text)
                    self._woken()
            final = self.events.response
        except asyncio.CancelledError:      # cancelled (POST .../cancel, DELETE, shutdown): as far as it got
            final = self._ended("cancelled")
        except Exception as exc:  # noqa: BLE001 - no handler is left to answer a 500: the response failed
            say(f"background response {self.events.kind.id} failed: {exc!r}")
            self.log += self.events.failed(ApiError(500, "internal error (see the server's log)"))
            final = self.events.response
        finally:
            self._over(final)

    def _ended(self, status: str) -> dict:
        """The Response of a run that ended other than by its stream's end: its output as far as it got."""
        return self.events.kind.response(self.events.model, self.events.so_far("incomplete"), status)

    def _over(self, final: dict | None) -> None:
        """Its end: its places in admission released, the Response stored (its events all recorded, so counted
        whole), what only the run needed dropped, its followers woken."""
        for reservation in self._reservations:
            reservation.release()
        if self.final is None:
            final = final if final is not None else self._ended("cancelled")
            try:
                self.events.kind.done(final, over=True)
            finally:            # over whatever storing it did: its followers end, a cancel changes nothing
                self.final, self.events = without_logprobs(final), None
        self._woken()

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
            return self.final
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
        if self.task is not None and not self.task.done():
            self.task.cancel()
            await asyncio.wait({self.task})
        if self.final is None:      # cancelled before its first step: its stream never started (nor ended)
            await self._texts.aclose()
            self._over(None)
        return self.current()
