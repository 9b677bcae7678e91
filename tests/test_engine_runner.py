"""EngineRunner (engine/worker_server.py): engine calls one at a time on the engine thread, or, for a short steady
call that finds the engine idle, on the event loop's own thread with no thread hop."""
import asyncio
import threading
import time

from engine.worker_server import EngineRunner


def where(seconds: float = 0.0) -> str:
    """The name of the thread that ran this call (after `seconds` of work)."""
    time.sleep(seconds)
    return threading.current_thread().name


def test_a_short_inline_call_runs_on_the_loop_once_its_length_is_known():
    async def scenario():
        runner = EngineRunner(inline_max_s=1.0)
        first = await runner.run(where, inline=True)          # its length is not known yet: the engine thread
        second = await runner.run(where, inline=True)
        plain = await runner.run(where)                       # not marked inline: always the engine thread
        return first, second, plain, threading.current_thread().name
    first, second, plain, loop_thread = asyncio.run(scenario())
    assert first.startswith("engine") and plain.startswith("engine")
    assert second == loop_thread


def test_calls_longer_than_the_limit_or_with_inline_off_stay_on_the_engine_thread():
    async def scenario():
        slow, off = EngineRunner(inline_max_s=0.01), EngineRunner(inline_max_s=0.0)
        return ([await slow.run(where, 0.03, inline=True) for _ in range(3)]
                + [await off.run(where, inline=True) for _ in range(3)])
    assert all(name.startswith("engine") for name in asyncio.run(scenario()))


def test_an_inline_call_never_overlaps_a_call_on_the_engine_thread():
    """While a long call holds the engine thread, a short call marked inline queues behind it there."""
    active, overlaps, release = [0], [], threading.Event()

    def work(hold: bool = False) -> str:
        active[0] += 1
        overlaps.append(active[0] > 1)
        if hold:
            release.wait(30)
        active[0] -= 1
        return threading.current_thread().name

    async def scenario():
        runner = EngineRunner(inline_max_s=1.0)
        await runner.run(work, inline=True)                   # learn that the short call is short
        long = asyncio.ensure_future(runner.run(work, True))
        await asyncio.sleep(0)                                # the long call holds the engine thread
        short = asyncio.ensure_future(runner.run(work, inline=True))
        await asyncio.sleep(0)
        release.set()
        return await short, await long
    short, _ = asyncio.run(scenario())
    assert short.startswith("engine") and not any(overlaps)
