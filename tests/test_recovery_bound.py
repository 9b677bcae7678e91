"""Bounded recovery. A target that keeps failing: the round retries through recovery, then gives up
target_recovery_s after its first failure (no request loops forever, whatever the cause: a crash loop, a
TLS mistake). A recovery still blocked when the router stops does not keep the process alive."""
import asyncio
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import grpc
import pytest

from protos.specpool.v1 import generation_pb2, worker_pb2
from router.request_state import RequestState
from router.speculation import resilient_round

ROOT = Path(__file__).resolve().parent.parent


class AlwaysDownTarget:
    """Every verify fails UNAVAILABLE; every recovery 'succeeds' at once (the worst case for a loop)."""
    timeout, name = 5.0, "target 0"

    def __init__(self):
        self.calls = self.recoveries = 0
        self.last_error = None

    async def verify(self, *args, **_):
        self.calls += 1
        await asyncio.sleep(0.01)
        raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "down")

    def mark_failed(self, error=None):
        self.recoveries += 1
        self.last_error = error

    async def wait_recovered(self, timeout):
        assert timeout > 0

    def give_up(self, recovery_s: float):
        self.gave_up_after = recovery_s         # the router logs the give-up once per outage


def state() -> RequestState:
    return RequestState(session_id=1, tokens=[1, 2], prompt_len=2, max_new_tokens=4,
                        sampling=generation_pb2.SamplingParams(), fixed_k=0,
                        draft_mode=worker_pb2.DRAFT_MODE_GREEDY, max_context=0)


def test_round_gives_up_recovery_s_after_its_first_failure():
    target = AlwaysDownTarget()
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(resilient_round(state(), None, target, 0, recovery_s=1.0))
    elapsed = time.monotonic() - started
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and target.gave_up_after == 1.0
    assert "target 0 did not recover within router.target_recovery_s = 1 s" in info.value.details()
    assert 1.0 <= elapsed < 10.0 and target.calls > 2
    assert target.recoveries == target.calls               # each failure marked failed, the last too


def test_a_blocked_recovery_does_not_hold_the_process_open():
    """A recovery stuck in ray.get (a node still coming back) when the router shuts down: the process
    still exits (the recovery runs on a daemon thread and is cancelled by close())."""
    script = textwrap.dedent("""
        import asyncio, time
        from router.worker_client import DraftClient

        async def main():
            client = DraftClient("127.0.0.1:9", recover=lambda: time.sleep(3600) or "unreachable")
            client.mark_failed()
            await asyncio.sleep(0.2)
            await client.close()

        asyncio.run(main())
        print("exited", flush=True)
    """)
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "exited" in run.stdout, run.stderr[-2000:]
