"""A target that keeps failing: the round retries through recovery, then gives up target_recovery_s
after its first failure (no request loops forever, whatever the cause: a crash loop, a TLS mistake)."""
import asyncio
import time

import grpc
import pytest

from protos.specpool.v1 import generation_pb2, worker_pb2
from router.speculation import RequestState, resilient_round


class AlwaysDownTarget:
    """Every verify fails UNAVAILABLE; every recovery 'succeeds' at once (the worst case for a loop)."""
    timeout = 5.0

    def __init__(self):
        self.calls = self.recoveries = 0

    async def verify(self, *args):
        self.calls += 1
        await asyncio.sleep(0.01)
        raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "down")

    def mark_failed(self):
        self.recoveries += 1

    async def wait_recovered(self, timeout):
        assert timeout > 0


def state() -> RequestState:
    return RequestState(session_id=1, tokens=[1, 2], prompt_len=2, max_new_tokens=4,
                        sampling=generation_pb2.SamplingParams(), fixed_k=0,
                        draft_mode=worker_pb2.DRAFT_MODE_GREEDY, max_context=0)


def test_round_gives_up_recovery_s_after_its_first_failure():
    target = AlwaysDownTarget()
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(resilient_round(state(), None, target, 0, recovery_s=0.3))
    elapsed = time.monotonic() - started
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert 0.3 <= elapsed < 2.0 and target.calls > 2 and target.recoveries == target.calls - 1
