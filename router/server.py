"""The router's public gRPC server: specpool.v1.Generation, grpc.health.v1 and server reflection.

Health for service "" is NOT_SERVING until the target pool has loaded (`Router` attached), then SERVING while a
target replica is ready and NOT_SERVING while none is (all recovering), and NOT_SERVING for good from the shutdown
on; draft replicas join as they load (Admin.GetStatus `workers`, metric specpool_worker_replicas{pool,state}).
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import random
import time
import uuid
from typing import Callable

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health_pb2, health_pb2_grpc
import yaml
from grpc_reflection.v1alpha import reflection

from protos.specpool.v1 import admin_pb2, admin_pb2_grpc, generation_pb2
from settings.schema import ConfigError, SpecpoolConfig, config_to_yaml, parse_config
from router.addresses import cannot_listen, host_port, port_taken
from router.bearer import ADMIN_REFUSED, allowed, metadata_authorization
from router.failures import worker_failure
from router.k_selection import KSelector
from router.metrics import Metrics
from router.oplog import say
from engine.ngram import NgramIndex
from router.prediction import method_for, prediction_ids, trial_for
from router.reload import RestartRequired, check_reloadable, logged_reload, reload_document, with_overrides
from router.request_log import ClientRequest, request_line
from router.request_state import DRAFT_MODES, RequestState
from router.speculation import generate, releases_done
from router.stopping import output_chunks
from router.text import encode, max_token_chars, word_sequences
from router.structured_output import added_token, compiled, matcher_tokenizer
from router.validation import MAX_REQUEST_ID_CHARS, ModelLimits, RequestError, check_prompt_text, validate
from router.affinity import PrefixAffinity
from router.worker_client import DraftClient, TargetClient

MAX_MESSAGE_BYTES = 4 * 1024 * 1024           # a request over this gets RESOURCE_EXHAUSTED (counted)
TRANSPORT_MAX_BYTES = 2 * MAX_MESSAGE_BYTES   # ... and one over this is cut off by gRPC before it is read
GENERATION, ADMIN, HEALTH = (generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
                             admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name,
                             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)


class Router:
    """Live serving state: worker replicas, tokenizer, model limits, and the RNG for ids and seeds."""

    def __init__(self, config: SpecpoolConfig, drafts: list[DraftClient], targets: list[TargetClient],
                 model_info: dict, tokenizer, rng: random.Random | None = None, scale_up=None,
                 overrides: dict | None = None, metrics: Metrics | None = None):
        self.config = config
        self._scale_up = scale_up        # (pool name, count) -> factories of new clients; blocking (Ray)
        self.overrides = overrides or {}  # the command line's values over every reloaded file's (`with_overrides`)
        self.drafts, self.targets = drafts, targets
        slack = config.router.prefix_affinity_slack
        self.affinity = {"draft": PrefixAffinity(slack), "target": PrefixAffinity(slack)}   # router/affinity.py
        self.tokenizer = tokenizer
        self._max_token_chars = max_token_chars(tokenizer)
        self.eos_ids = frozenset(model_info["eos_token_ids"])
        self.model_info = model_info
        self._rng = rng or random.Random()
        self.metrics = metrics or Metrics()      # made (and its port bound) before the pools start: Service
        self.metrics.count_replicas({"draft": self.drafts, "target": self.targets})
        self.k_selector = KSelector(config.speculation, self.metrics, random.Random(self._rng.getrandbits(64)),
                                    config.draft.ngram_max_tokens, config.draft.method,
                                    config.draft.prediction_max_tokens)
        self._slots = asyncio.Semaphore(config.router.max_active_requests)
        self.queued = 0
        self.running = 0            # requests holding a slot
        self.reserved = 0           # places reserved for requests not started yet (Reservation)
        self.metrics.queued.set_function(lambda: self.queued)
        self._shedding = Shedding()
        self._session_series: dict[int, tuple[str, str]] = {}   # id(worker) -> its gauge's (pool, address)
        self.serving_changed: Callable[[], None] | None = None   # told when `serving` may have changed
        self._serving = self.serving
        self.draining, self.in_flight = False, 0     # shutting down: new requests refused; requests in run()
        for pool, clients in (("draft", drafts), ("target", targets)):
            for client in clients:
                self._watch(pool, client)

    def _watch(self, pool: str, worker) -> None:
        worker.listeners.append(functools.partial(self._worker_changed, pool))

    def _worker_changed(self, pool: str, worker) -> None:
        """A worker's state (and maybe address) changed: move its session gauge; a target's change may change
        whether the router can serve at all (health)."""
        self._publish_sessions(pool, worker)
        if pool != "target" or self.serving == self._serving:
            return
        self._serving = self.serving
        say(self._serving_line())
        if self.serving_changed is not None:
            self.serving_changed()

    def _serving_line(self) -> str:
        """The log line for a change of `serving`: what health now says (NOT_SERVING for good while draining)."""
        if not self._serving:
            return "no target replica is ready: health NOT_SERVING until one is back (requests in flight wait for it)"
        if self.draining:
            return "a target replica is ready again (health stays NOT_SERVING: shutting down)"
        return "a target replica is ready again: health SERVING"

    @property
    def serving(self) -> bool:
        """Whether any target replica is ready: while none is, health says NOT_SERVING (a load balancer routes
        elsewhere), though requests already here wait for a recovery."""
        return any(target.healthy for target in self.targets)

    @contextlib.asynccontextmanager
    async def admission(self, reservation: Reservation | None = None):
        """A generation slot; waits in a bounded queue, and past its bound refuses at once (unless it was
        `reservation`'s, taken when its request was sent)."""
        if reservation is None or not reservation.take():
            self.check_room()
        self.queued += 1
        try:
            await self._slots.acquire()
        finally:
            self.queued -= 1
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self._slots.release()

    def check_room(self) -> None:
        """Raise Overloaded if a request would be refused now: every slot and queue place taken (or reserved)."""
        limits = self.config.router
        if self.running + self.queued + self.reserved >= limits.max_active_requests + limits.max_queued_requests:
            running = limits.max_active_requests
            busy = f"{running} request{'s' * (running != 1)} running and {self.queued + self.reserved} queued"
            self._shedding.refused(busy)
            raise Overloaded(f"{busy}: try again later")

    def reserve(self) -> Reservation:
        """A place for a request that starts later (a background response), taken now: Overloaded if there is none,
        so that it is refused when it is sent rather than failing once it runs."""
        self.check_room()
        return Reservation(self)

    @functools.cached_property
    def added_token(self):
        """text -> the ID of the added token that is that text, or None (structured output's reasoning markers)."""
        return added_token(self.tokenizer)

    @functools.cached_property
    def grammar_tokenizer(self):
        """The tokenizer structured-output grammars are checked against (router/structured_output.py)."""
        return matcher_tokenizer(self.tokenizer, self.model_info["vocab_size"], self.eos_ids)

    @property
    def limits(self) -> ModelLimits:
        return ModelLimits(self.model_info["vocab_size"], self.model_info["max_context"],
                           self.config.speculation.k_max, self.config.router.max_prompt_tokens,
                           self.config.router.max_new_tokens, self._max_token_chars, self.eos_ids)

    async def admit(self, request: generation_pb2.GenerateRequest, streamed: bool = True) -> RequestState:
        """Validate and normalise a request into the router's state for it (raises RequestError). A text
        prompt's size is checked before it is encoded, and it is encoded off the event loop. `streamed`: the
        client reads the output as it comes (False: whole, at the end; see KSelector.answer_delay_s)."""
        if request.prompt and not request.prompt_token_ids:
            check_prompt_text(request, self.limits)
            prompt_ids = await encode(self.tokenizer, request.prompt)
        else:
            prompt_ids = list(request.prompt_token_ids)
        validate(request, prompt_ids, self.limits)
        prediction = await prediction_ids(request, self.tokenizer, self.limits)
        grammar = await asyncio.to_thread(lambda: compiled(request, self.eos_ids, self.grammar_tokenizer,
                                                           self.added_token)) \
            if request.HasField("structured_output") else None      # off the loop: the tokenizer's first build too
        sampling = generation_pb2.SamplingParams()
        sampling.CopyFrom(request.sampling)
        sampling.top_p = request.sampling.top_p if request.sampling.HasField("top_p") else 1.0
        if not sampling.HasField("seed"):
            sampling.seed = self._rng.getrandbits(63)
        spec = request.speculation
        fixed_k = 0 if spec.disable else (spec.k if spec.HasField("k") else None)
        mode = "greedy" if sampling.temperature == 0 else self.config.speculation.draft_sampling
        if fixed_k is None and mode == "sampled" and request.sampling.HasField("seed"):
            # Same seed, same output: a sampled draft's random draws depend on K, so K must not depend on
            # load. (A greedy draft's verification is coupled to plain decoding: any K gives the same output.)
            fixed_k = self.config.speculation.k
        return RequestState(session_id=self._rng.getrandbits(63), tokens=list(prompt_ids),
                            prompt_len=len(prompt_ids), max_new_tokens=request.max_new_tokens, sampling=sampling,
                            fixed_k=fixed_k, draft_mode=DRAFT_MODES[mode], max_context=self.limits.max_context,
                            stop_ids=frozenset(request.stop_token_ids),
                            eos_ids=frozenset() if request.ignore_eos else self.eos_ids,
                            method=method_for(self.config.draft.method, prediction, fixed_k),
                            prediction=tuple(prediction),
                            prediction_trial=trial_for(prediction, fixed_k, self.config.draft.prediction_trial_rounds),
                            ngram=NgramIndex(self.config.draft.ngram_min, self.config.draft.ngram_max, prediction,
                                             len(prompt_ids)),
                            stop_strings=tuple(request.stop), include_stop=request.include_stop_str_in_output,
                            keep_special=request.keep_special_tokens,
                            top_logprobs=request.logprobs if request.HasField("logprobs") else None,
                            streamed=streamed, min_new_tokens=request.min_new_tokens, grammar=grammar,
                            bad_words=word_sequences(self.tokenizer, request.bad_words),
                            prompt_top_logprobs=request.prompt_logprobs if request.HasField("prompt_logprobs")
                            else None)

    async def run(self, state: RequestState):
        """The request's rounds on the least-loaded draft and target replicas (sticky for the request); counted in
        `in_flight` (queued included) for the shutdown's drain."""
        last, first = time.perf_counter(), True
        self.in_flight += 1
        try:
            async with self.admission(state.reservation):
                self.k_selector.attach(state)
                workers = []
                try:                           # a request on prompt lookup alone takes no draft replica
                    draft = (self.affinity["draft"].choose(self.drafts, state.tokens)
                             if self.drafts and not state.lookup_alone else None)
                    target = self.affinity["target"].choose(self.targets, state.tokens)
                    workers = [w for w in (draft, target) if w]
                    self._count_sessions(workers, +1)
                    async with contextlib.aclosing(generate(state, draft, target, self.k_selector,
                                                            self.config.router.target_recovery_s)) as rounds:
                        async for tokens in rounds:
                            now = time.perf_counter()
                            self.metrics.observe_tokens(now - last, len(tokens), first)
                            last, first = now, False
                            yield tokens
                finally:
                    self.k_selector.detach(state)
                    self.metrics.observe_prefix_caches(state.stats)
                    for pool, calls in state.out_of_memory.items():
                        self.metrics.out_of_memory.labels(pool).inc(calls)
                    self._count_sessions(workers, -1)
        finally:
            self.in_flight -= 1

    def ended(self, request: ClientRequest, code: str, detail: str = "") -> None:
        """Count a client request under its final gRPC status (its latency, if it succeeded) and, with
        router.log_requests, log it (router/request_log.py): `detail`, what a failed one's client was told."""
        self.metrics.requests.labels(code).inc()
        if code == "OK":
            self.metrics.e2e.observe(time.perf_counter() - request.started)
        if self.config.router.log_requests:
            say(request_line(request, code, detail))

    async def drained(self, timeout: float, poll_s: float = 0.05) -> bool:
        """Wait until no request is in flight (True), or `timeout` seconds (False): the shutdown's grace."""
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(poll_s)
        return not self.in_flight

    def _count_sessions(self, workers: list, delta: int) -> None:
        for worker in workers:
            worker.outstanding += delta
            self._publish_sessions("draft" if worker in self.drafts else "target", worker)

    def _publish_sessions(self, pool: str, worker) -> None:
        """specpool_worker_active_sessions{pool, address} = the worker's outstanding sessions, under its current
        address: the series of an address it had before (it was restarted elsewhere) is removed, so no phantom
        sessions stay behind. A worker with no address yet (loading) has no series."""
        old, new = self._session_series.pop(id(worker), None), (pool, worker.address)
        if old is not None and old != new:
            self.metrics.worker_sessions.remove(*old)
        if worker.address and (old is not None or worker.outstanding):
            self.metrics.worker_sessions.labels(*new).set(worker.outstanding)
            self._session_series[id(worker)] = new

    async def reload(self, data: dict, config_dir: str | None = None) -> None:
        """Apply a new config without a restart: the speculation section between rounds, and more
        draft/target replicas (started, then added to the pools). Anything else is refused. Relative model
        paths are read from `config_dir`, and the command line's overrides (serve --port) win over the
        document's values, both as at start-up."""
        new = with_overrides(parse_config(data, config_dir), self.overrides)
        check_reloadable(self.config, new, bool(self.drafts), data)
        for name, clients in (("draft", self.drafts), ("target", self.targets)):
            extra = getattr(new, name).replicas - getattr(self.config, name).replicas
            if extra > 0:
                if self._scale_up is None:
                    raise RestartRequired(f"{name}.replicas: this router cannot start replicas")
                factories = await asyncio.to_thread(self._scale_up, name, extra)
                for make in factories:
                    await self._add_replica(name, clients, make())
        self.k_selector.update_config(new.speculation, new.draft.ngram_max_tokens, new.draft.method,
                                      new.draft.prediction_max_tokens)
        self.config = new

    async def _add_replica(self, pool: str, clients: list, client) -> None:
        """A replica a reload started (loaded already) joins its pool, as the first ones did, once it answers a first
        call (WorkerClient.unreachable: a new node whose address the TLS certificate does not name, say); else it
        stays out, failed, with the error in status and the log. The call is made before it is in the pool, so that no
        request goes to it meanwhile."""
        problem = await client.unreachable()
        clients.append(client)
        self._watch(pool, client)
        if problem:
            client.stay_out(problem)
            return
        client.joined()
        if pool == "target":
            self._worker_changed(pool, client)

    async def close(self) -> None:
        """Close every worker client once the releases of ended requests are done, cancelling recoveries still in
        progress."""
        await releases_done()
        await asyncio.gather(*(client.close() for client in self.drafts + self.targets), return_exceptions=True)

    def status(self) -> dict:
        return {"k": self.k_selector.k_now, "k_from": self.k_selector.k_from,   # what greedy rounds get now (the
                                                                                # `k` gauge), from which controller
                "pool": self.k_selector.pool.snapshot(), "pools": self.k_selector.snapshot(),
                "delivered": self.k_selector.delivery(),       # model+ngram: both sources against lookup alone
                "active_requests": len(self.k_selector.active), "queued_requests": self.queued,
                "draining": self.draining,                                  # shutting down: new requests refused
                "outstanding_sessions": {"draft": [c.outstanding for c in self.drafts],
                                         "target": [c.outstanding for c in self.targets]},
                "workers": {"draft": [c.describe() for c in self.drafts],
                            "target": [c.describe() for c in self.targets]},
                "prefix_cache": self.metrics.prefix_caches()}


class Overloaded(Exception):
    """The admission queue is full."""


class Reservation:
    """A place in admission held for a request that has not started (Router.reserve): its run takes it on entering
    admission; released if the request ends without having run."""

    def __init__(self, router: Router):
        self.router, self.held = router, True
        router.reserved += 1

    def take(self) -> bool:
        """Whether it was still held (now taken: its request is counted as queued instead)."""
        held, self.held = self.held, False
        self.router.reserved -= held
        return held

    def release(self) -> None:
        self.take()


class Shedding:
    """Requests refused for overload (RESOURCE_EXHAUSTED), told to the operator at most once per INTERVAL_S: the
    first refusal after a quiet interval at once, the ones after it in one line with their count when the interval
    ends (a timer: a burst is told within INTERVAL_S, never folded into a line much later). A burst of refusals
    must not flood the log."""

    INTERVAL_S = 10.0

    def __init__(self):
        self._count, self._last, self._busy = 0, None, ""
        self._flush: asyncio.TimerHandle | None = None

    def refused(self, busy: str) -> None:
        loop = asyncio.get_running_loop()
        self._count, self._busy = self._count + 1, busy
        if self._last is None or loop.time() - self._last >= self.INTERVAL_S:
            self._tell()
        elif self._flush is None:
            self._flush = loop.call_later(self._last + self.INTERVAL_S - loop.time(), self._tell)

    def _tell(self) -> None:
        """Log the refusals counted since the last line (none: nothing to say)."""
        if self._flush is not None:
            self._flush.cancel()
        now = asyncio.get_running_loop().time()
        since = f" in the last {round(now - self._last, 1):g} s" if self._last is not None and self._count > 1 else ""
        count, self._count, self._last, self._flush = self._count, 0, now, None
        if count:
            say(f"overloaded: {count} request(s) refused with RESOURCE_EXHAUSTED{since} ({self._busy})")


def _response(state: RequestState, request_id: str, tokens: list[int], text: str, logprobs: list = (),
              first: bool = True) -> generation_pb2.GenerateResponse:
    """A Generate answer, or (`first` or not) a GenerateStream message; the first carries the prompt's logprobs."""
    response = generation_pb2.GenerateResponse(token_ids=tokens, text=text, request_id=request_id,
                                               logprobs=logprobs, prompt_logprobs=(first and state.prompt_logprobs)
                                               or ())
    if state.finish_reason:
        response.finish_reason = state.finish_reason
        response.stats.CopyFrom(state.stats)
    return response


DEADLINE_SLACK_S = 0.1


def _ended(context) -> str:
    """The status of a call that ended under the handler: its deadline passed, or the client cancelled it. A
    client's deadline runs out on the client first, which then cancels the call: that cancel reaches the handler
    while the server's copy of the deadline (counted from when the request arrived) still has a little time left,
    so a call that ends within DEADLINE_SLACK_S of its deadline counts as DEADLINE_EXCEEDED."""
    remaining = context.time_remaining()
    return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= DEADLINE_SLACK_S else "CANCELLED"


class GenerationServicer:
    """Generate and GenerateStream. Each reads its request itself, as raw bytes (see `add_generation`), so every
    call is answered and counted under its final status: one cancelled before its message was read, one whose
    message does not parse (INVALID_ARGUMENT), one past its deadline (DEADLINE_EXCEEDED)."""

    def __init__(self, clock=time.monotonic):
        self.router: Router | None = None
        self._clock, self._since = clock, clock()
        self.ready_timeout_s: float | None = None   # router.ready_timeout_s, for loading_message (the Service's)

    def loading_message(self) -> str:
        """What a call gets before the pools have loaded (a big model's first load can take most of an hour): for
        how long they have been loading, and the bound."""
        bound = f" of router.ready_timeout_s = {self.ready_timeout_s:g} s" if self.ready_timeout_s else ""
        return (f"specpool is still loading its worker pools ({self._clock() - self._since:.0f} s so far{bound}; "
                f"serve's log shows each worker's progress)")

    async def _read(self, context) -> generation_pb2.GenerateRequest:
        raw = await context.read()
        if raw is grpc.aio.EOF:
            try:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request: no GenerateRequest was sent")
            except grpc.aio.AbortError:
                raise
            except Exception:   # noqa: BLE001 - no status can be sent: the call had ended (a cancel, its deadline)
                raise asyncio.CancelledError from None
        if len(raw) > MAX_MESSAGE_BYTES:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"request: {len(raw)} bytes is over the limit of {MAX_MESSAGE_BYTES}")
        try:
            return generation_pb2.GenerateRequest.FromString(raw)
        except DecodeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request: not a specpool.v1.GenerateRequest ({exc})")

    async def _admit(self, context, streamed: bool, client: ClientRequest) -> tuple[Router, RequestState, str]:
        request = await self._read(context)
        if len(request.request_id) <= MAX_REQUEST_ID_CHARS:      # else refused below, and logged without it
            client.request_id = request.request_id
        router = self.router
        if router is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.loading_message())
        if router.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "specpool is shutting down")
        try:
            state = await router.admit(request, streamed)
        except RequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        remaining = context.time_remaining()
        if remaining is not None:
            state.deadline = time.monotonic() + remaining
        client.request_id, client.states = request.request_id or uuid.uuid4().hex, [state]
        return router, state, client.request_id

    @contextlib.asynccontextmanager
    async def _tracked(self, context, route: str):
        """The request (a ClientRequest), ended under its final status (Router.ended); a worker failure becomes
        UNAVAILABLE (or DEADLINE_EXCEEDED, if the client's deadline is what cut the worker's call short)."""
        client, code, detail = ClientRequest(route, context.peer()), "OK", ""
        try:
            yield client
        except grpc.aio.AioRpcError as exc:
            code, detail = worker_failure(exc, _ended(context) == "DEADLINE_EXCEEDED")
            await context.abort(grpc.StatusCode[code], detail)
        except Overloaded as exc:
            code, detail = "RESOURCE_EXHAUSTED", str(exc)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, detail)
        except (asyncio.CancelledError, GeneratorExit):     # grpc.aio closes a cancelled stream's generator
            code = _ended(context)
            raise
        except BaseException:
            code, detail = (context.code().name, context.details() or "") if context.code() else ("UNKNOWN", "")
            raise
        finally:
            if self.router is not None:
                self.router.ended(client, code, detail)

    async def GenerateStream(self, request_iterator, context):
        async with self._tracked(context, "GenerateStream") as client:
            router, state, request_id = await self._admit(context, True, client)
            first = True
            async for chunk in output_chunks(router.run(state), state, router.tokenizer):
                yield _response(state, request_id, chunk.token_ids, chunk.text, chunk.logprobs, first)
                first = False

    async def Generate(self, request_iterator, context):
        async with self._tracked(context, "Generate") as client:
            router, state, request_id = await self._admit(context, False, client)
            text = [chunk.text async for chunk in output_chunks(router.run(state), state, router.tokenizer)]
            return _response(state, request_id, state.tokens[state.prompt_len:], "".join(text), state.logprobs)


def add_generation(servicer: GenerationServicer, server: grpc.aio.Server) -> None:
    """Register Generation with its requests left as bytes for the handlers to read (client-streaming handlers
    on the wire of unary-request methods: a client sends one message either way). A handler then starts as
    its call arrives, not once gRPC has read and parsed the message, which it would answer with UNKNOWN."""
    serialize = generation_pb2.GenerateResponse.SerializeToString
    handlers = {"Generate": grpc.stream_unary_rpc_method_handler(servicer.Generate, response_serializer=serialize),
                "GenerateStream": grpc.stream_stream_rpc_method_handler(servicer.GenerateStream,
                                                                        response_serializer=serialize)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(GENERATION, handlers),))


class AdminServicer(admin_pb2_grpc.AdminServicer):
    """Hot reload of the speculation section, and a read-back of config and live statistics. With router.admin_keys
    set, a call must carry one of them (router/bearer.py): the keys serve started with until the router is up, then
    its running config's, so a reload may rotate them."""

    def __init__(self, generation: GenerationServicer, admin_keys: list[str] = ()):
        self._generation, self._admin_keys = generation, list(admin_keys)

    async def _router(self, context) -> Router:
        router = self._generation.router
        keys = router.config.router.admin_keys if router is not None else self._admin_keys
        if not allowed(keys, metadata_authorization(context.invocation_metadata())):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, ADMIN_REFUSED)
        if router is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self._generation.loading_message())
        return router

    async def Reload(self, request, context):
        router = await self._router(context)
        try:
            changes = await logged_reload(router, lambda: reload_document(request.config_yaml),
                                          request.config_dir or None, "by Admin.Reload (specpool reload)")
        except RestartRequired as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except (ConfigError, ValueError, yaml.YAMLError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return admin_pb2.ReloadResponse(speculation_yaml=config_to_yaml(router.config.speculation), changes=changes)

    async def GetStatus(self, request, context):
        router = await self._router(context)
        return admin_pb2.GetStatusResponse(config_yaml=config_to_yaml(router.config),
                                           stats_json=json.dumps(router.status()))


class PortBusy(OSError):
    """A configured gRPC port could not be bound (in use, or not allowed)."""


def grpc_server() -> grpc.aio.Server:
    """A server for specpool's clients: messages up to TRANSPORT_MAX_BYTES; a port in use is refused, not shared."""
    return grpc.aio.server(options=[("grpc.max_receive_message_length", TRANSPORT_MAX_BYTES),
                                    ("grpc.so_reuseport", 0)])


def bind(server: grpc.aio.Server, key: str, host: str, port: int, credentials: grpc.ServerCredentials | None) -> int:
    """Listen on host:port (TLS with `credentials`); the port bound, or a PortBusy naming the config key."""
    address = host_port(host, port)
    if port and port_taken(host, port):
        raise PortBusy(cannot_listen(key, host, port))
    try:
        return server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError:
        raise PortBusy(cannot_listen(key, host, port)) from None


async def start_public_server(host: str, port: int, credentials: grpc.ServerCredentials | None = None,
                              with_admin: bool = False, admin_keys: list[str] = ()
                              ) -> tuple[grpc.aio.Server, int, GenerationServicer, health_async.HealthServicer]:
    """Start Generation + health (NOT_SERVING) + reflection, and Admin too `with_admin` (router.admin_port -1, its
    calls carrying one of `admin_keys` if any); attach a Router later. With `credentials` the port speaks TLS."""
    server = grpc_server()
    servicer = GenerationServicer()
    add_generation(servicer, server)
    if with_admin:
        admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(servicer, admin_keys), server)
    health = health_async.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    services = (GENERATION, *((ADMIN,) if with_admin else ()), HEALTH, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(services, server)
    bound = bind(server, "router.port", host, port, credentials)
    await set_health(health, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    return server, bound, servicer, health


async def start_admin_server(generation: GenerationServicer, host: str, port: int,
                             credentials: grpc.ServerCredentials | None = None,
                             admin_keys: list[str] = ()) -> tuple[grpc.aio.Server, int]:
    """Start Admin (Reload, GetStatus) + reflection on a port of its own (router.admin_host:admin_port), away from
    the port clients reach; its calls carry one of `admin_keys` (router.admin_keys) if any."""
    server = grpc_server()
    admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(generation, admin_keys), server)
    reflection.enable_server_reflection((ADMIN, reflection.SERVICE_NAME), server)
    bound = bind(server, "router.admin_port", host, port, credentials)
    await server.start()
    return server, bound


HEALTH_SERVICES = ("", GENERATION)   # probes name either


async def set_health(health: health_async.HealthServicer, status) -> None:
    """The same health status for the server ("") and for specpool.v1.Generation, which a probe may name."""
    for service in HEALTH_SERVICES:
        await health.set(service, status)


async def mark_ready(servicer: GenerationServicer, health: health_async.HealthServicer, router: Router) -> None:
    """Attach the router and let health for service "" follow it from now on: SERVING while a target replica is
    ready, NOT_SERVING while none is (enter_graceful_shutdown, at shutdown, makes it NOT_SERVING for good)."""
    servicer.router = router
    updates: set = set()

    async def follow() -> None:     # reads `serving` when it runs: the last update wins, whatever their order
        await set_health(health, health_pb2.HealthCheckResponse.SERVING if router.serving
                         else health_pb2.HealthCheckResponse.NOT_SERVING)

    def changed() -> None:
        task = asyncio.ensure_future(follow())
        updates.add(task)
        task.add_done_callback(updates.discard)
    router.serving_changed = changed
    await follow()
