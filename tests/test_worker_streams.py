"""Router <-> worker calls over one long-lived stream (router.worker_client.CallStream on the router,
engine.worker_server.serve_stream on the worker) behave as unary calls do: each caller gets its own answer
whatever order they finish in, a worker error arrives as its gRPC status and leaves the stream up, a call
given up (deadline, or its caller cancelled) is withdrawn on the worker, and a dead worker fails what was
waiting with UNAVAILABLE instead of hanging. A real grpc.aio server on 127.0.0.1; no models."""
import asyncio

import grpc
import pytest

from engine.sessions import SessionLost
from engine.worker_server import serve_stream
from protos.specpool.v1 import worker_pb2
from router.worker_client import CallStream


class Worker:
    """A VerifyStream whose calls take `session_id` milliseconds; session 404 is lost, 999 never finishes."""

    def __init__(self):
        self.started, self.withdrawn, self.withdrawal = [], [], asyncio.Event()

    async def submit(self, request, emit):
        self.started.append(request.session_id)
        try:
            for token in range(request.decode_steps - 1):     # a call that answers more than once
                await asyncio.sleep(0.002)
                emit(worker_pb2.VerifyResponse(next_token_id=token, more=True))
            if request.session_id == 404:
                raise SessionLost("session 404: not here")
            if request.session_id == 500:
                raise RuntimeError("the engine broke")
            await asyncio.sleep(3600 if request.session_id == 999 else request.session_id / 1000)
        except asyncio.CancelledError:
            self.withdrawn.append(request.session_id)
            self.withdrawal.set()
            raise
        return worker_pb2.VerifyResponse(next_token_id=request.session_id)

    async def VerifyStream(self, requests, context):
        async for response in serve_stream(requests, self.submit, worker_pb2.VerifyResponse):
            yield response


async def serving(worker: Worker):
    handler = grpc.stream_stream_rpc_method_handler(
        worker.VerifyStream, request_deserializer=worker_pb2.VerifyRequest.FromString,
        response_serializer=worker_pb2.VerifyResponse.SerializeToString)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Worker", {"VerifyStream": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    open_stream = channel.stream_stream("/t.Worker/VerifyStream",
                                        request_serializer=worker_pb2.VerifyRequest.SerializeToString,
                                        response_deserializer=worker_pb2.VerifyResponse.FromString)
    return server, channel, CallStream(open_stream, worker_pb2.VerifyRequest)


def call(session_id: int) -> worker_pb2.VerifyRequest:
    return worker_pb2.VerifyRequest(session_id=session_id)


def scenario(body):
    async def main():
        worker = Worker()
        server, channel, stream = await serving(worker)
        try:
            return await body(worker, server, stream)
        finally:
            stream.close()
            await channel.close()
            await server.stop(0)
    return asyncio.run(main())


def test_each_caller_gets_its_own_answer_whatever_order_they_finish_in():
    async def body(worker, server, stream):
        return await asyncio.gather(*(stream(call(ms), timeout=10) for ms in (60, 5, 30, 1)))
    assert [r.next_token_id for r in scenario(body)] == [60, 5, 30, 1]


@pytest.mark.parametrize("session, code, text", [(404, grpc.StatusCode.NOT_FOUND, "not here"),
                                                 (500, grpc.StatusCode.UNKNOWN, "the engine broke")])
def test_a_worker_error_is_its_status_and_the_stream_stays_up(session, code, text):
    async def body(worker, server, stream):
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stream(call(session), timeout=10)
        return error.value, await stream(call(2), timeout=10)
    error, after = scenario(body)
    assert error.code() == code and text in error.details()
    assert after.next_token_id == 2


def test_a_call_past_its_deadline_is_withdrawn_on_the_worker():
    async def body(worker, server, stream):
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stream(call(999), timeout=0.1)
        await asyncio.wait_for(worker.withdrawal.wait(), 10)
        return error.value, list(worker.withdrawn)          # a copy: the teardown cancels whatever still runs
    error, withdrawn = scenario(body)
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and withdrawn == [999]


def test_a_cancelled_caller_withdraws_its_call():
    async def body(worker, server, stream):
        pending = asyncio.ensure_future(stream(call(999), timeout=10))
        while not worker.started:
            await asyncio.sleep(0.01)
        pending.cancel()
        await asyncio.wait_for(worker.withdrawal.wait(), 10)
        answer = (await stream(call(3), timeout=10)).next_token_id
        return list(worker.started), list(worker.withdrawn), answer
    assert scenario(body) == ([999, 3], [999], 3)


def test_a_dead_worker_fails_waiting_calls_with_unavailable():
    async def body(worker, server, stream):
        pending = asyncio.ensure_future(stream(call(999), timeout=10))
        await asyncio.sleep(0.1)
        await server.stop(0)
        with pytest.raises(grpc.aio.AioRpcError) as waiting:
            await pending
        with pytest.raises(grpc.aio.AioRpcError) as next_call:
            await stream(call(1), timeout=5)
        return waiting.value.code(), next_call.value.code()
    assert scenario(body) == (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE)


def test_callers_cancelled_mid_write_leave_the_other_calls_on_the_stream_alone():
    """grpc.aio cancels a whole stream when a write is cancelled; a caller's cancellation must not reach it."""
    async def body(worker, server, stream):
        kept = []
        for steps in range(8):                          # cancel after 0..7 turns of the loop: some mid-write
            calls = [asyncio.ensure_future(stream(call(50 + i), timeout=10)) for i in range(20)]
            for _ in range(steps):
                await asyncio.sleep(0)
            for doomed in calls[::2]:
                doomed.cancel()
            results = await asyncio.gather(*calls, return_exceptions=True)
            kept.append([r if isinstance(r, Exception) else r.next_token_id for r in results[1::2]])
        return kept, (await stream(call(1), timeout=10)).next_token_id
    kept, after = scenario(body)
    assert kept == [list(range(51, 70, 2))] * 8 and after == 1


def run_call(session_id: int, steps: int) -> worker_pb2.VerifyRequest:
    return worker_pb2.VerifyRequest(session_id=session_id, decode_steps=steps)


def test_a_call_that_answers_more_than_once_gets_every_answer_in_order_beside_other_calls():
    async def body(worker, server, stream):
        async def collect():
            return [(r.next_token_id, r.more) async for r in stream.answers(run_call(20, 5), timeout=10)]
        return await asyncio.gather(collect(), stream(call(7), timeout=10), collect())
    runs_a, single, runs_b = scenario(body)
    expected = [(0, True), (1, True), (2, True), (3, True), (20, False)]
    assert runs_a == expected == runs_b and single.next_token_id == 7


def test_closing_a_call_that_answers_more_than_once_withdraws_it_on_the_worker():
    async def body(worker, server, stream):
        answers = stream.answers(run_call(999, 3), timeout=10)
        first = await anext(answers)
        await answers.aclose()
        await asyncio.sleep(0.2)
        return first.more, worker.withdrawn, (await stream(call(3), timeout=10)).next_token_id
    assert scenario(body) == (True, [999], 3)


def test_an_error_ends_a_call_that_answers_more_than_once_with_its_status():
    async def body(worker, server, stream):
        got = []
        with pytest.raises(grpc.aio.AioRpcError) as error:
            async for response in stream.answers(run_call(404, 3), timeout=10):
                got.append(response.next_token_id)
        return got, error.value.code()
    assert scenario(body) == ([0, 1], grpc.StatusCode.NOT_FOUND)
