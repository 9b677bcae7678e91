"""The operator's log: one line per event, on serve's standard output, stamped with the local time so that a
stall or a failure can be matched to the metrics and to the workers' own lines.

    2026-11-25 14:16:02.123 [specpool] target 0 failed (UNAVAILABLE: ...): restarting it
"""
from __future__ import annotations

import datetime


def say(message: str, now=datetime.datetime.now) -> None:
    """Print one stamped line of the operator's log (flushed: serve's output is often a pipe or a file). The log is
    best-effort and never raises: a write that fails (its reader is gone: BrokenPipeError; stdout closed: ValueError)
    is dropped, so that the recovery, refusal or shutdown that logs it still happens."""
    try:
        print(f"{now().isoformat(sep=' ', timespec='milliseconds')} [specpool] {message}", flush=True)
    except (OSError, ValueError):
        pass
