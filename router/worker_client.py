"""The router's gRPC clients for draft and target workers, and the session re-sync rule.

Each call sends only the committed tokens the worker does not hold yet (from `synced`). A worker
that answers NOT_FOUND has lost the session: the call is repeated once with position 0 and the
whole committed context (re-prefill).
"""
from __future__ import annotations

import asyncio
import contextlib
import datetime
import itertools
import threading
import time
from typing import AsyncIterator, Awaitable, Callable, Union

import grpc

from engine.handoff import HandoffStream
from protos.specpool.v1 import worker_pb2, worker_pb2_grpc
from router.oplog import say
from settings.schema import TlsConfig
from settings.tls import worker_channel

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024),
                   ("grpc.max_send_message_length", 64 * 1024 * 1024)]


async def synced_answers(rpc: Callable[..., AsyncIterator], make_request: Callable, tokens: list[int],
                         synced: int, timeout: float) -> AsyncIterator:
    """Call `rpc(make_request(position, new_tokens, start))` and yield each of its answers as (response,
    wire_bytes); if the worker answers NOT_FOUND (it lost the session), re-prefill from position 0."""
    position = synced
    while True:
        request = make_request(position, tokens[position:], position == 0)
        sent = request.ByteSize()
        async with contextlib.aclosing(rpc(request, timeout=timeout)) as answers:
            try:
                async for response in answers:
                    yield response, sent + response.ByteSize()
                    sent = 0                       # counted once, with the first answer
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND or position == 0 or not sent:
                    raise
        position = 0


async def synced_call(rpc: Callable[..., Awaitable], make_request: Callable, tokens: list[int],
                      synced: int, timeout: float):
    """synced_answers for a call that answers once: (response, wire_bytes)."""
    async def once(request, timeout: float) -> AsyncIterator:
        yield await rpc(request, timeout=timeout)
    async with contextlib.aclosing(synced_answers(once, make_request, tokens, synced, timeout)) as answers:
        return await anext(answers)


async def in_daemon_thread(fn: Callable[[], str]) -> str:
    """fn() on a daemon thread. A recovery can sit in ray.get for minutes (a node is coming back); if the
    router shuts down meanwhile, that thread must not hold the process open, as asyncio.to_thread's
    executor threads do (they are joined at interpreter exit, and ray.get spins once Ray is shut down)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result, error) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def run() -> None:
        try:
            result, error = fn(), None
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:          # the event loop is gone: nobody is waiting any more
            pass
    threading.Thread(target=run, name="specpool-recover", daemon=True).start()
    return await future


def rpc_error(code: grpc.StatusCode, message: str) -> grpc.aio.AioRpcError:
    """The error a unary call would have raised, for a call answered (or lost) on a stream."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), message)


class GaveUp(grpc.aio.AioRpcError):
    """A request stopped waiting for a failed worker to come back; its detail says which worker, why it stopped
    (the recovery bound, or the client's deadline) and what the worker failed with."""

    def __init__(self, code: grpc.StatusCode, detail: str):
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), detail)


class _Stream:
    """One open bidirectional call, the calls waiting on it, and the queue its writer task sends from."""

    def __init__(self, call):
        self.call, self.outbox, self.pending, self.closed = call, asyncio.Queue(), {}, False
        self.writer = asyncio.ensure_future(self._write())
        self.reader: asyncio.Task | None = None

    async def _write(self) -> None:
        """Send queued requests in order. Writes happen here, never in a caller's task, so a caller that is
        cancelled mid-write cannot cancel the whole stream (grpc.aio would) and every other call on it."""
        try:
            while True:
                await self.call.write(await self.outbox.get())
        except (asyncio.InvalidStateError, grpc.aio.AioRpcError):
            pass                          # the stream ended: its reader fails whatever is still waiting


class CallStream:
    """Calls to one worker over one long-lived bidirectional stream (ProposeStream / VerifyStream) instead of a
    unary call each; `await stream(request, timeout=...)` behaves as the unary call would: it returns the
    answer or raises AioRpcError with the worker's status, DEADLINE_EXCEEDED past `timeout`, or UNAVAILABLE
    when the stream breaks (the worker died; the next call opens a new stream). A call given up (timeout,
    or its caller cancelled) is withdrawn on the worker."""

    def __init__(self, open_stream: Callable, request_type):
        self._open_stream, self._request_type = open_stream, request_type
        self._stream: _Stream | None = None
        self._ids = itertools.count(1)

    async def __call__(self, request, timeout: float | None = None):
        future = asyncio.get_running_loop().create_future()
        stream, call_id = self._send(request, future)
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            self._withdraw(stream, call_id)
            raise _past_deadline(timeout) from None
        except asyncio.CancelledError:
            self._withdraw(stream, call_id)
            raise
        finally:
            stream.pending.pop(call_id, None)

    async def answers(self, request, timeout: float | None = None) -> AsyncIterator:
        """A call that answers more than once (a decode run): each answer as it arrives, up to the one without
        `more`; `timeout` bounds the wait for each answer. Closing the iterator early withdraws the call."""
        inbox: asyncio.Queue = asyncio.Queue()
        stream, call_id = self._send(request, inbox)
        finished = False
        try:
            while not finished:
                try:
                    response = await asyncio.wait_for(inbox.get(), timeout)
                except asyncio.TimeoutError:
                    raise _past_deadline(timeout) from None
                if isinstance(response, Exception):
                    finished = True
                    raise response
                finished = not response.more
                yield response
        finally:
            stream.pending.pop(call_id, None)
            if not finished:
                self._withdraw(stream, call_id)

    def _send(self, request, waiting: asyncio.Future | asyncio.Queue) -> tuple[_Stream, int]:
        """Queue `request` on the current stream under a new call id, its answers going to `waiting`."""
        stream = self._current()
        request.call_id = call_id = next(self._ids)
        stream.pending[call_id] = waiting
        stream.outbox.put_nowait(request)
        return stream, call_id

    def _current(self) -> _Stream:
        if self._stream is None or self._stream.closed:
            self._stream = stream = _Stream(self._open_stream())
            stream.reader = asyncio.ensure_future(self._read(stream))
        return self._stream

    def _withdraw(self, stream: _Stream, call_id: int) -> None:
        """Tell the worker to drop the call (queued behind the stream's other writes; nobody waits for it)."""
        if not stream.closed:
            stream.outbox.put_nowait(self._request_type(call_id=call_id, cancel=True))

    @staticmethod
    async def _read(stream: _Stream) -> None:
        """Settle each answer's future; when the stream ends, fail every call still waiting on it."""
        error = rpc_error(grpc.StatusCode.UNAVAILABLE, "the worker's stream ended")
        try:
            async for response in stream.call:
                waiting = stream.pending.get(response.call_id)
                if waiting is not None:
                    _settle(waiting, rpc_error(_CODES[response.status.code], response.status.message)
                            if response.status.code else response)
        except grpc.aio.AioRpcError as exc:
            error = exc if exc.code() != grpc.StatusCode.CANCELLED else error
        finally:
            stream.closed = True
            stream.writer.cancel()
            for waiting in stream.pending.values():
                _settle(waiting, error)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.call.cancel()
            self._stream.closed = True


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _past_deadline(timeout: float) -> grpc.aio.AioRpcError:
    return rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {timeout:.3g}s")


def _settle(waiting: asyncio.Future | asyncio.Queue, outcome) -> None:
    """Hand an answer (or an AioRpcError) to the call waiting for it: a unary-like call's future, or the queue
    of a call that answers more than once."""
    if isinstance(waiting, asyncio.Queue):
        waiting.put_nowait(outcome)
    elif not waiting.done():
        waiting.set_exception(outcome) if isinstance(outcome, Exception) else waiting.set_result(outcome)


NOBODY = 1 << 63        # a session id no request has (the router's are random 63-bit numbers); not 0, whose Release
                        # message is empty, which a target's TP ranks cannot broadcast
Started = Union[str, dict]     # a worker's start: its address, or its start info {"address", "cpus": [...]}


class WorkerClient:
    """One worker replica's channel, the number of sessions the router has routed to it, and its
    recovery: after a failure, `recover()` (blocking; it restarts or re-finds the worker through Ray
    and returns its new start, Started) runs in the background until the worker is back. `cpus`: the CPUs the
    worker runs on, where its start said (every rank's, for a target replica).

    `state`: "ready"; "down" (recovering); "loading": made with no address, its first start is still loading its
    model (`load()`, blocking, returns its Started) and it joins once that returns; "failed": it did not load
    (`error` says why) and stays out of the pool. Only a ready worker is `healthy`. Each change of state (or of
    address) is told to the callables in `listeners` (the router's health and session gauges follow it), and the
    operator's log gets one line per failure, give-up and return, never one per request."""

    RETRY_PAUSE_S = 0.5
    STILL_DOWN_EVERY_S = 30.0          # the most often a failing recovery is logged
    FAILED_NOTE = "recovering it"       # what the pool does meanwhile (DraftClient, TargetClient say it better)

    def __init__(self, address: Started | None, stub_class, stream: tuple[str, type], timeout: float,
                 recover: Callable[[], Started] | None = None, tls: TlsConfig | None = None,
                 load: Callable[[], Started] | None = None, name: str = "", clock: Callable[[], float] = time.time):
        self.timeout = timeout
        self._tls = tls
        self.outstanding = 0
        self._stub_class = stub_class
        self._stream_method, self._request_type = stream      # e.g. ("VerifyStream", VerifyRequest)
        self._recover_fn = recover
        self._recovering: asyncio.Task | None = None
        self._clock = clock
        self.name, self.error, self.cpus = name or started_address(address), "", []
        self.last_error, self.down_since, self.gave_up = "", None, 0   # the current (or last) outage
        self.listeners: list[Callable[["WorkerClient"], None]] = []
        if address is None:
            self.state, self.address, self.channel = "loading", "", None
            self._recovering = asyncio.get_running_loop().create_task(self._load(load))
        else:
            self.state = "ready"
            self._connect(address)

    def _connect(self, started: Started) -> None:
        address = self.address = started_address(started)
        self.cpus = list(started.get("cpus", ())) if isinstance(started, dict) else []
        self.channel = worker_channel(address, self._tls, CHANNEL_OPTIONS)
        self.stub = self._stub_class(self.channel)
        self.stream = CallStream(getattr(self.stub, self._stream_method), self._request_type)

    def _set_state(self, state: str) -> None:
        self.state = state
        for listener in list(self.listeners):
            listener(self)

    @property
    def healthy(self) -> bool:
        return self.state == "ready"

    def describe(self) -> dict:
        """For Admin.GetStatus: its name and state, its address once known; if it did not load, why; if it is
        down, since when (seconds ago) and with what error; once it is back, the error it last failed with; the CPUs
        it runs on, where its start said."""
        down = {"down_since": datetime.datetime.fromtimestamp(self.down_since).isoformat(sep=" ", timespec="seconds"),
                "down_for_s": round(self._clock() - self.down_since, 1)} if self.state == "down" else {}
        return {"name": self.name, "state": self.state, "address": self.address,
                **({"cpus": self.cpus} if self.cpus else {}), **down,
                **({"last_error": self.last_error} if self.last_error else {}),
                **({"error": self.error} if self.error else {})}

    async def _load(self, load: Callable[[], Started]) -> None:
        """Wait (off the event loop) for the first start to load; then connect and make a first call
        (unreachable), or stay out with the error. Until then it is loading (wait_recovered waits for it)."""
        try:
            self._connect(await in_daemon_thread(load))
            error = await self.unreachable()
        except Exception as exc:  # noqa: BLE001 - whatever it was, the pool serves on without this worker
            error = str(exc)
        finally:
            self._recovering = None
        if error:
            self.stay_out(error)
            return
        self._set_state("ready")
        self.joined()

    def stay_out(self, error: str) -> None:
        """It did not load, or its channel cannot reach it: out of the pool until a restart, with `error` in status
        and the log."""
        self.error = error
        self._set_state("failed")
        say(f"{self.name} did not load and stays out of the pool (restart to retry): {error}")

    def joined(self) -> None:
        """The operator's line for a replica that has loaded (at start-up, or added by a reload)."""
        say(f"{self.name} loaded, at {self.address}: it joins the pool")

    def mark_failed(self, error: grpc.aio.AioRpcError | None = None) -> None:
        """Start recovering this worker (once, however many requests saw it fail), saying so in the log."""
        if self._recover_fn is not None and self.state == "ready":
            self.last_error = describe_error(error, self.timeout) if error is not None else "unknown error"
            self.down_since, self.gave_up = self._clock(), 0
            self._set_state("down")
            self._recovering = asyncio.get_running_loop().create_task(self._recover())
            say(f"{self.name} failed ({self.last_error}): {self.FAILED_NOTE}")

    def give_up(self, recovery_s: float) -> None:
        """A request stopped waiting for this worker after `recovery_s`: logged once per outage (the count is
        in the line that says the worker is back)."""
        self.gave_up += 1
        if self.gave_up == 1:
            say(f"requests waiting for {self.name} give up: it did not recover within router.target_recovery_s = "
                f"{recovery_s:g} s")

    async def _recover(self) -> None:
        """Retry recover() every RETRY_PAUSE_S until the worker is back; then connect to it and close the old channel.
        A failure right after the return (during that close) starts a recovery of its own: this one's end leaves
        it in `_recovering`."""
        told = None
        try:
            while True:
                try:
                    started = await in_daemon_thread(self._recover_fn)
                    break
                except Exception as exc:  # noqa: BLE001 - keep trying until the worker is back
                    told = self._still_down(exc, told)
                    await asyncio.sleep(self.RETRY_PAUSE_S)
            old, old_stream = self.channel, self.stream
            self._connect(started)
            self._set_state("ready")
            gave_up = f"; {self.gave_up} request(s) gave up meanwhile" if self.gave_up else ""
            say(f"{self.name} is back, at {self.address}, after {self._clock() - self.down_since:.1f} s{gave_up}")
            old_stream.close()
            await old.close()
        finally:
            if self._recovering is asyncio.current_task():
                self._recovering = None

    def _still_down(self, exc: Exception, told: float | None) -> float | None:
        """Log a failed recovery attempt: the outage's first, then at most every STILL_DOWN_EVERY_S (a recover()
        that fails fast is retried every RETRY_PAUSE_S). Returns when the outage was last told."""
        now = self._clock()
        if told is not None and now - told < self.STILL_DOWN_EVERY_S:
            return told
        say(f"{self.name} still down: {exc!r}")
        return now

    async def wait_recovered(self, timeout: float) -> None:
        """Wait until recovery finishes; raises TimeoutError past `timeout` seconds."""
        if self._recovering is not None:
            await asyncio.wait_for(asyncio.shield(self._recovering), timeout)

    async def release(self, session_id: int) -> None:
        if self.channel is None:          # still loading (or never loaded): it holds no session
            return
        await self.stub.Release(worker_pb2.ReleaseRequest(session_id=session_id), timeout=self.timeout)

    async def unreachable(self) -> str:
        """"" if the worker answers a first call over its channel (a Release of no session), else why not, in one
        line. A worker its channel cannot reach (over TLS: a certificate that does not name the worker's address,
        say) would fail every request while reading as ready."""
        try:
            await self.release(NOBODY)
        except grpc.aio.AioRpcError as exc:
            tls = (" (tls.internal: the workers' certificate, tls.cert, must name the address they are dialled at "
                   "in its subjectAltName, or set tls.server_name to a name it has)") if self._tls and \
                self._tls.enabled and self._tls.internal else ""
            return f"{self.name} at {self.address} does not answer: {exc.code().name}: {exc.details()}{tls}"
        return ""

    async def close(self) -> None:
        """Stop any recovery in progress and close the channel (the router is shutting down)."""
        if self._recovering is not None:
            self._recovering.cancel()
        if self.channel is not None:
            self.stream.close()
            await self.channel.close()


def started_address(started: Started | None) -> str | None:
    """The address of a worker's start (Started)."""
    return started["address"] if isinstance(started, dict) else started


def describe_error(error: grpc.aio.AioRpcError, timeout: float) -> str:
    """A worker call's failure for the operator: its code and detail; a call that ran past the worker timeout
    names router.worker_timeout_s (a stalled worker, torn down as a dead one is)."""
    if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"DEADLINE_EXCEEDED: no answer within router.worker_timeout_s = {timeout:g} s"
    return f"{error.code().name}: {error.details()}"


class DraftClient(WorkerClient):
    FAILED_NOTE = "restarting it; rounds draft by n-gram (or K = 0 where none matches) until it is back"

    def __init__(self, address: Started | None, timeout: float = 30.0, recover: Callable[[], Started] | None = None,
                 tls: TlsConfig | None = None, load: Callable[[], Started] | None = None, name: str = ""):
        super().__init__(address, worker_pb2_grpc.DraftWorkerStub, ("ProposeStream", worker_pb2.ProposeRequest),
                         timeout, recover, tls, load, name)

    async def propose(self, session_id: int, tokens: list[int], synced: int, k: int, start: dict, mode: int,
                      timeout: float, runner_ups: bool = False, branches: list[tuple[int, int]] = (),
                      hand_to: tuple[str, int] = ("", 0), committed: int = 0):
        """k drafts after `tokens` (the worker holding `synced` of them, the first `committed` verified, 0: all;
        `start`: the session start's fields, RequestState.session_start); with `runner_ups`, each draft's
        runner-up; with `branches` [(context length, token)], also k - 1 drafts after each of those; with
        `hand_to` (target address, handoff id), the drafts also handed straight to that target."""
        make = _request(worker_pb2.ProposeRequest, session_id, start, k=k, mode=mode, runner_ups=runner_ups,
                        hand_to=hand_to[0], handoff_id=hand_to[1], committed=committed,
                        branches=[worker_pb2.BranchPoint(at=at, token_id=token) for at, token in branches])
        return await synced_call(self.stream, make, tokens, synced, timeout)

    def propose_chained(self, session_id: int, tokens: list[int], synced: int, k: int, start: dict, mode: int,
                        timeout: float, then: worker_pb2.ChainedPredraft,
                        hand_to: tuple[str, int] = ("", 0), committed: int = 0) -> AsyncIterator:
        """propose (with runner-ups) with the next round's pre-draft chained to it (ProposeRequest.then): yields
        (response, wire_bytes) for the drafts, then for the pre-draft the worker starts right after them."""
        make = _request(worker_pb2.ProposeRequest, session_id, start, k=k, mode=mode, runner_ups=True,
                        hand_to=hand_to[0], handoff_id=hand_to[1], then=then, committed=committed)
        return synced_answers(self.stream.answers, make, tokens, synced, timeout)


class TargetClient(WorkerClient):
    FAILED_NOTE = "tearing its group down and restarting it; its requests wait for it (router.target_recovery_s)"

    def __init__(self, address: Started, timeout: float = 30.0, recover: Callable[[], Started] | None = None,
                 tls: TlsConfig | None = None, name: str = ""):
        self.handoffs: HandoffStream | None = None             # the router's copies of handed-off drafts
        super().__init__(address, worker_pb2_grpc.TargetWorkerStub, ("VerifyStream", worker_pb2.VerifyRequest),
                         timeout, recover, tls, name=name)

    def _connect(self, started: Started) -> None:
        if self.handoffs is not None:
            self.handoffs.close()
        super()._connect(started)
        self.handoffs = HandoffStream(self.stub.HandDrafts)

    async def close(self) -> None:
        if self.handoffs is not None:
            self.handoffs.close()
        await super().close()

    async def verify(self, session_id: int, tokens: list[int], synced: int, drafts: list[int],
                     hidden: bytes, start: dict, timeout: float, top_logprobs: int | None = None,
                     handoff_id: int = 0):
        """Verify `drafts`; with `handoff_id`, those of that handoff instead, waiting on the target for them."""
        make = _request(worker_pb2.VerifyRequest, session_id, start, top_logprobs=top_logprobs,
                        draft_token_ids=drafts, draft_hidden_states=hidden, handoff_id=handoff_id)
        return await synced_call(self.stream, make, tokens, synced, timeout)

    async def stage(self, session_id: int, position: int, candidates: list[worker_pb2.StagedDrafts],
                    timeout: float, top_logprobs: int | None = None):
        """A staged round (VerifyRequest.staged): the target verifies, once the session's round that starts at
        `position` has its verdict, the candidate drafts that guessed it. Returns (response, wire_bytes); the
        response is `missed` when no candidate did."""
        request = worker_pb2.VerifyRequest(session_id=session_id, position=position, top_logprobs=top_logprobs,
                                           staged=worker_pb2.StagedRound(candidates=candidates))
        response = await self.stream(request, timeout=timeout)
        return response, request.ByteSize() + response.ByteSize()

    def decode_run(self, session_id: int, tokens: list[int], synced: int, steps: int, stop_ids: frozenset,
                   start: dict, timeout: float, top_logprobs: int | None = None,
                   lookup: worker_pb2.PromptLookup | None = None, answer_delay_us: int = 0) -> AsyncIterator:
        """Up to `steps` tokens in one call, by plain decoding or (`lookup`) with the target's own prompt-lookup
        drafts: yields (response, wire_bytes) per message (a target step, with the steps held before it in
        `earlier`, see VerifyRequest.answer_delay_us)."""
        make = _request(worker_pb2.VerifyRequest, session_id, start, top_logprobs=top_logprobs, decode_steps=steps,
                        stop_token_ids=sorted(stop_ids), lookup=lookup, answer_delay_us=answer_delay_us)
        return synced_answers(self.stream.answers, make, tokens, synced, timeout)


def _request(request_type, session_id: int, start: dict, **fields) -> Callable:
    """make_request(position, new_tokens, at_start) for a draft or target call (the `start` fields only at the
    session's start)."""
    def make(position: int, new: list[int], at_start: bool):
        return request_type(session_id=session_id, position=position, new_token_ids=new,
                            **(start if at_start else {}), **fields)
    return make


def least_loaded(clients: list[WorkerClient]) -> WorkerClient:
    """The replica with the fewest outstanding sessions (first one on ties), a healthy one if any is."""
    return min(clients, key=lambda client: (not client.healthy, client.outstanding))
