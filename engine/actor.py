"""What a draft worker and a target rank answer alike when the router, tests or benchmarks ask a Ray
actor about its engine. Module import pulls in no torch."""
from __future__ import annotations

import os


class EngineActor:
    """Base of the worker actors: `_engine` is set once the model has loaded (None before)."""

    _engine = None

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
