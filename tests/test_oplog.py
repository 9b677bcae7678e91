"""The operator's log: every line of it is stamped with the local time, to the millisecond."""
import datetime
import sys

from router.oplog import say
from tests.fake_workers import ClosedPipe


def test_a_log_line_carries_its_time_then_the_tag(capsys):
    say("target 0 failed", now=lambda: datetime.datetime(2026, 11, 25, 14, 16, 2, 123456))
    assert capsys.readouterr().out == "2026-11-25 14:16:02.123 [specpool] target 0 failed\n"


def test_a_log_line_whose_reader_went_away_is_dropped_without_raising(monkeypatch):
    """The log is best-effort: the recovery, refusal or shutdown that logs a line must still happen."""
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    say("target 0 failed")
