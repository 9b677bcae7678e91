"""What a draft worker and a target rank answer alike when the router, tests or benchmarks ask a Ray
actor about its engine. Module import pulls in no torch."""
from __future__ import annotations

import os
import time


class EngineActor:
    """Base of the worker actors: `_engine` is set once the model has loaded (None before)."""

    _engine = None
    _gc_watch = None

    def _settle(self) -> None:
        """Once the engine has loaded and the server is up: what the process holds now is frozen out of the
        garbage collector's scans, and its pauses are counted from here on (engine.gc_pauses)."""
        from engine.gc_pauses import settle
        self._gc_watch = settle()

    def gc_pauses(self) -> dict:
        """The garbage collector's pauses since the worker started serving, by generation (engine.gc_pauses)."""
        return self._gc_watch.snapshot() if self._gc_watch else {}

    @staticmethod
    def cpu_seconds() -> float:
        """CPU seconds this worker process has used, all its threads (the concurrency sweep's `target busy`)."""
        return time.process_time()

    def pid(self) -> int:
        return os.getpid()

    @staticmethod
    def cpus() -> list[int]:
        """The CPUs this worker process may run on (its pinning: `draft.cpus`, `target.cpus`), for its start info."""
        return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []

    def active_sessions(self) -> int:
        return len(self._engine.sessions) if self._engine else 0

    def sessions_started(self) -> int:
        return self._engine.sessions.started if self._engine else 0

    def batch_stats(self) -> dict:
        """Cumulative forward passes (a draft counts one per drafting step), rows and the largest batch."""
        return self._engine.stats.as_dict() if self._engine else {}
