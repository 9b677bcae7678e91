"""The target's engine in a process of its own (`target.engine_process: true`), fed by the gRPC process.

On a thread of the gRPC process the engine shares its interpreter, and under `cpus` its core, with the event loop
and gRPC's threads: under load its forward ran 1.4x slower there than alone (README, Concurrency sweep). Here, as
vLLM's engine core is, the engine runs in a child process pinned to the target's CPUs, the gRPC process moves to
the node's other CPUs, and they talk over a pipe. The child runs one command at a time, in order:

    ("batch", VerifyBatch)             -> [VerifyResponse or exception per row]
    ("release", ReleaseRequest)        -> ReleaseResponse
    ("together", [run state], n)       -> ([None or exception per run], [run state])   (EngineSteps.together)
    ("alone", run state, n)            -> run state                                    (EngineSteps.alone)

A decode run's state goes to the child with the call and comes back with its answer (DecodeRun.state); the answers
it sends meanwhile come as ("emit", call, run index, VerifyResponse), in order before the call's own. Its runs read
Signals from shared memory between steps, as on a thread. A second pipe, answered by a thread of the child, takes
the actor's questions (sessions held, batch stats, CPU seconds, GC pauses). The child exits when the gRPC process
goes (its pipe closes). One rank only: a TP group's rank 0 keeps its engine on a thread.

    side = EngineProcess(build_engine, (config, draft, 0, 1, master))
    info = await side.started()              # the engine loaded in the child: its model_info
    servicer = TargetServicer(side, 1, max_batch=16)
"""
from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import os
import pickle
import queue
import threading
import time
from typing import Callable

from target_worker.engine_steps import EngineSteps, Signals

_CONTEXT = multiprocessing.get_context("spawn")     # never fork a process that holds Ray's and gRPC's threads
DIRECT_BYTES = 16 * 1024       # commands unread by the child (at most those not yet answered) written straight from
                               # the event loop while they total at most this, far below a socket's buffer; beyond
                               # it, by a thread, so that the loop never blocks writing while the child blocks on it


class EngineProcess:
    """The gRPC process's side of an engine process: the calls TargetServicer makes, answered over the pipe."""

    is_engine_side = True

    def __init__(self, build: Callable, args: tuple, on_lost: Callable[[], None] = lambda: None):
        self.signals = Signals(_CONTEXT.RawArray("q", 4))
        self._conn, child = _CONTEXT.Pipe()
        self._queries, child_queries = _CONTEXT.Pipe()
        self._process = _CONTEXT.Process(target=serve, args=(child, child_queries, self.signals, build, args),
                                         name="specpool-target-engine", daemon=True)
        self._process.start()
        child.close()
        child_queries.close()
        self._calls = itertools.count(1)
        self._pending: dict[int, tuple[asyncio.Future, list, int]] = {}   # call -> (its future, runs, bytes)
        self._unanswered = 0                         # bytes of the commands not answered yet
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._put = self._written = 0                # commands put in the outbox (by the loop), written from it
        threading.Thread(target=self._write_outbox, name="engine-commands", daemon=True).start()
        self._asking = threading.Lock()
        self._on_lost, self._lost = on_lost, None
        self.pid = self._process.pid

    async def started(self) -> dict:
        """Wait for the child's engine to load: its model_info. Raises what loading raised there."""
        kind, payload = await asyncio.to_thread(self._conn.recv)
        if kind == "failed":
            raise payload
        asyncio.get_running_loop().add_reader(self._conn.fileno(), self._readable)
        return payload

    def _readable(self) -> None:
        """The child's answers: each call's emits, then its result (or the exception it raised)."""
        try:
            while self._conn.poll():
                self._take(self._conn.recv())
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(self._conn.fileno())
            self._fail_all(RuntimeError(f"the target's engine process ({self.pid}) exited"))

    def _take(self, message: tuple) -> None:
        kind, call, *rest = message
        future, runs, size = self._pending[call]
        if kind == "emit":
            runs[rest[0]].emit(rest[1])
            return
        del self._pending[call]
        self._unanswered -= size
        if future.done():                            # withdrawn meanwhile
            return
        if kind == "failed":
            future.set_exception(rest[0])
        else:
            future.set_result(rest[0])

    def _fail_all(self, exc: Exception) -> None:
        self._lost = exc
        for future, _, _ in self._pending.values():
            if not future.done():
                future.set_exception(exc)
        self._pending.clear()
        self._on_lost()                              # the actor exits, as a TP rank that lost its group: Ray restarts it

    async def _call(self, kind: str, payload, runs: list = ()):
        if self._lost is not None:
            raise self._lost
        call, future = next(self._calls), asyncio.get_running_loop().create_future()
        message = pickle.dumps((kind, call, payload), protocol=pickle.HIGHEST_PROTOCOL)
        self._pending[call] = future, list(runs), len(message)
        self._unanswered += len(message)
        if self._put != self._written or self._unanswered > DIRECT_BYTES:
            self._put += 1
            self._outbox.put(message)
        else:
            self._conn.send_bytes(message)
        return await future

    def _write_outbox(self) -> None:
        while True:
            message = self._outbox.get()
            try:
                self._conn.send_bytes(message)
            except OSError:
                return                               # the child is gone: the reader fails the calls
            finally:
                self._written += 1

    async def verify_batch(self, batch, inline: bool = False) -> list:
        return await self._call("batch", batch)

    async def release(self, request):
        return await self._call("release", request)

    async def together(self, runs: list) -> list:
        results, states = await self._call("together", ([run.state() for run in runs], self.signals.withdrawn),
                                           runs)
        for run, state in zip(runs, states):
            vars(run).update(state)
        return results

    async def alone(self, run) -> None:
        vars(run).update(await self._call("alone", (run.state(), self.signals.withdrawn), [run]))

    def ask(self, question: str):
        """The child's answer to `question` (see _answer_questions), from any thread of this process."""
        with self._asking:
            self._queries.send(question)
            return self._queries.recv()


def serve(conn, queries, signals: Signals, build: Callable, args: tuple) -> None:
    """The engine process: load the engine (`build(*args)`, which pins this process), then run the gRPC process's
    commands until it goes."""
    from engine.gc_pauses import settle
    from engine.modeling import model_info
    try:
        engine = build(*args)
    except Exception as exc:  # noqa: BLE001 - the gRPC process reports it as its start's failure
        conn.send(("failed", RuntimeError(f"the target's engine process failed to load: {exc!r}")))
        return
    watch = settle()
    threading.Thread(target=_answer_questions, args=(queries, engine, watch), daemon=True,
                     name="engine-questions").start()
    conn.send(("ready", model_info(engine.model)))
    steps = EngineSteps(engine, 1, signals)
    while True:
        try:
            kind, call, payload = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            os._exit(0)
        try:
            conn.send(("done", call, _run(steps, kind, call, payload, conn)))
        except Exception as exc:  # noqa: BLE001 - the call's failure, answered to its caller
            conn.send(("failed", call, _portable(exc)))


def _run(steps: EngineSteps, kind: str, call: int, payload, conn):
    from target_worker.server import DecodeRun

    def emitter(index: int) -> Callable:
        return lambda response: conn.send(("emit", call, index, response))
    if kind == "batch":
        return steps.verify_batch(payload)
    if kind == "release":
        return steps.release(payload)
    states, withdrawn = payload
    if kind == "alone":
        run = DecodeRun.resumed(states, emitter(0))
        steps.alone(run, withdrawn)
        return run.state()
    runs = [DecodeRun.resumed(state, emitter(i)) for i, state in enumerate(states)]
    results = steps.together(runs, withdrawn)
    return [_portable(result) if result else None for result in results], [run.state() for run in runs]


def _portable(exc: Exception) -> Exception:
    """`exc`, or in its place a RuntimeError naming it when it would not survive the pipe's pickling."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any exception that does not round-trip
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _answer_questions(queries, engine, watch) -> None:
    answers = {"active_sessions": lambda: len(engine.sessions), "sessions_started": lambda: engine.sessions.started,
               "batch_stats": lambda: engine.stats.as_dict(), "cpu_seconds": time.process_time,
               "gc_pauses": watch.snapshot, "cpus": lambda: sorted(os.sched_getaffinity(0))}
    while True:
        try:
            queries.send(answers[queries.recv()]())
        except (EOFError, OSError):
            return
