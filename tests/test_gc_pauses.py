"""The collector's pauses (engine/gc_pauses.py): a process that has started serving keeps what it holds out of every
later collection, so a full collection scans only what it allocated since, and its pauses are counted."""
import gc

import pytest

from engine.gc_pauses import PauseWatch, settle


@pytest.fixture
def unfrozen():
    """Whatever a test freezes goes back to the collector afterwards (this process runs many tests)."""
    yield
    gc.unfreeze()


def test_a_watch_counts_each_collection_by_generation_with_its_pause():
    ticks = iter(range(100))
    watch = PauseWatch(clock=lambda: next(ticks) * 0.5)      # every reading half a second after the last
    try:
        gc.collect(2)
        gc.collect(0)
        gc.collect(2)
        pauses = watch.snapshot()
    finally:
        watch.close()
    assert pauses["gen2"] == {"count": 2, "seconds": 1.0, "longest_s": 0.5}
    assert pauses["gen0"] == {"count": 1, "seconds": 0.5, "longest_s": 0.5} and pauses["gen1"]["count"] == 0
    gc.collect(2)
    assert watch.snapshot()["gen2"]["count"] == 2                # closed: no longer counting


def test_settling_freezes_what_the_process_holds_and_later_garbage_is_still_collected(unfrozen):
    held = [[i] for i in range(1000)]                           # alive when the process settles
    watch = settle()
    try:
        assert watch.snapshot()["frozen"] >= len(held)
        cycle = []
        cycle.append(cycle)                                      # garbage made after settling
        del cycle
        assert gc.collect(2) >= 1                                # found: the collector scans what came since
    finally:
        watch.close()
