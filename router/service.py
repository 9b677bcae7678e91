"""The composition root: a running specpool is its public server, its worker pools on Ray and the Router
that joins them. The CLI, the tests and the benchmarks all start one through `Service`.

    service = await Service(load_config("deploy/local.yaml")).start()   # ... await service.stop()

`overrides` are the command line's values over the file's ({"router": {"port": 50071}} for `serve --port 50071`):
they apply at start and to every reloaded config (Admin.Reload, SIGHUP).
"""
from __future__ import annotations

import asyncio
import threading
import time
from functools import partial
from pathlib import Path

from router.addresses import host_port
from router.oplog import say
from settings.schema import SpecpoolConfig, read_yaml


def build_router(config: SpecpoolConfig, pools, overrides: dict | None = None, metrics=None):
    from router.launch import launch_more, load_draft, recover_draft, recover_target
    from router.server import Router
    from router.text import load_tokenizer
    from router.worker_client import DraftClient, TargetClient

    timeout, ready, host = config.router.worker_timeout_s, config.router.ready_timeout_s, config.ray.node_ip or None
    # The first drafts may still be loading: their clients join the pool as each one loads (until then, rounds
    # use n-gram proposals where the context matches, else K=0).
    drafts = [DraftClient(None, timeout, partial(recover_draft, actor, host, ready), config.tls,
                          load=partial(load_draft, start, f"draft {i}", ready), name=f"draft {i}")
              for i, (actor, start) in enumerate(zip(pools.draft_actors, pools.draft_starts))]
    targets = [TargetClient(started, timeout, partial(recover_target, ranks, host, ready), config.tls, f"target {i}")
               for i, (started, ranks) in enumerate(zip(pools.target_started, pools.target_actors))]

    recovers = {"draft": (DraftClient, recover_draft), "target": (TargetClient, recover_target)}

    def scale_up(pool: str, count: int) -> list:
        """Start `count` more replicas of a pool through Ray (blocking); factories of their clients (named on from
        the pool's last), to be called on the event loop."""
        client, recover = recovers[pool]
        started = launch_more(config, pools, pool, count, ready)      # draft actors, or target rank groups
        first, started_infos = len(getattr(pools, f"{pool}_actors")) - count, getattr(pools, f"{pool}_started")
        return [partial(client, started_infos[-count + i], timeout, partial(recover, replica, host, ready), config.tls,
                        name=f"{pool} {first + i}")
                for i, replica in enumerate(started)]
    return Router(config, drafts, targets, pools.target_info, load_tokenizer(pools.target_info["model_path"]),
                  scale_up=scale_up, overrides=overrides, metrics=metrics)


class WorkerUnreachable(RuntimeError):
    """A target replica loaded but its channel cannot reach it: the start fails rather than serve every request an
    error while health says SERVING."""


async def reachable(targets: list) -> None:
    """WorkerUnreachable naming the first target replica that does not answer a first call
    (WorkerClient.unreachable)."""
    for problem in await asyncio.gather(*(target.unreachable() for target in targets)):
        if problem:
            raise WorkerUnreachable(problem)


class Service:
    """A running specpool: public server up at once (NOT_SERVING), pools launched, SERVING once the targets have
    loaded (the drafts join as they load)."""

    def __init__(self, config: SpecpoolConfig, quiet: bool = False, keep_ray: bool = False,
                 overrides: dict | None = None):
        from router.reload import with_overrides
        self.overrides = overrides or {}    # the command line's values, over the file's now and at every reload
        self.config = with_overrides(config, self.overrides)
        self.quiet = quiet             # Ray's warnings and the workers' loading output off this terminal
        self.keep_ray = keep_ray       # leave a local Ray instance it started running (the next service reuses it)
        self.server = self.port = self.pools = self.router = self.metrics_port = self.health = self.metrics = None
        self.admin_server = self.admin_port = None    # admin_port: where Admin answers (the public port at -1)
        self.http = self.http_port = None
        self.owns_ray = False          # this service started the local Ray instance (and stops it)
        self.gc_watch = None           # this process's collector pauses, once `specpool serve` settled it (gc_pauses)

    async def start(self) -> "Service":
        from router import launch
        from router.server import mark_ready, start_public_server
        from settings.tls import server_credentials

        credentials, router = server_credentials(self.config.tls, self.config.tls.client_auth), self.config.router
        self.server, self.port, servicer, self.health = await start_public_server(
            router.host, router.port, credentials, with_admin=router.admin_port < 0, admin_keys=router.admin_keys)
        servicer.ready_timeout_s = router.ready_timeout_s
        say(f"gRPC on {host_port(router.host, self.port)} (NOT_SERVING until the target pool is ready)")
        connecting = not launch.ray.is_initialized()    # a failed start ends a local instance only if it started it
        try:
            await self._start_admin(servicer, credentials)
            await self._start_http(servicer)
            self._start_metrics()           # every port is bound before Ray starts: a busy one fails at once
            self.owns_ray = await to_thread_to_its_end(launch.connect, self.config, self.quiet)
            connecting = False
            self.pools = await asyncio.to_thread(launch.launch, self.config, self.config.router.ready_timeout_s,
                                                 self.owns_ray)
            self.router = build_router(self.config, self.pools, self.overrides, self.metrics)
            await reachable(self.router.targets)
            await mark_ready(servicer, self.health, self.router)
        except BaseException:
            self.owns_ray = self.owns_ray or (connecting and launch.local(self.config))   # half up: it goes too
            await self.stop(grace=0)       # the public server goes down with the failed start, on this loop
            raise
        drafts = len(self.pools.draft_starts)
        say(f"SERVING: {len(self.pools.target_started)} target replica(s) (TP="
            f"{self.config.target.tensor_parallel_size}); "
            + (f"{drafts} draft replica(s) join as they load" if drafts else "no draft pool (draft.method ngram)"))
        return self

    def _start_metrics(self) -> None:
        """The router's metrics, and their /metrics endpoint on router.host:router.metrics_port (if not -1)."""
        from router.metrics import Metrics
        self.metrics = Metrics()
        if self.config.router.metrics_port >= 0:
            self.metrics_port = self.metrics.serve(self.config.router.host, self.config.router.metrics_port)
            say(f"metrics on http://{host_port(self.config.router.host, self.metrics_port)}/metrics")

    async def _start_admin(self, servicer, credentials) -> None:
        """Admin (specpool reload / status) on router.admin_host:admin_port, or on the public port at -1."""
        from router.server import start_admin_server
        router = self.config.router
        if router.admin_port < 0:
            self.admin_port = self.port
            say(f"admin (specpool reload / status) on the public port {self.port}")
            return
        self.admin_server, self.admin_port = await start_admin_server(servicer, router.admin_host, router.admin_port,
                                                                      credentials, router.admin_keys)
        say(f"admin (specpool reload / status) on {host_port(router.admin_host, self.admin_port)}")

    async def drafts_loaded(self) -> None:
        """Wait until no draft replica is still loading (each has joined the pool, or failed to load)."""
        await asyncio.gather(*(draft.wait_recovered(None) for draft in self.router.drafts))

    async def _start_http(self, servicer) -> None:
        """The OpenAI-compatible HTTP API on router.host:http.port (503 until the pools are ready)."""
        if self.config.http.port < 0:
            return
        from openai_api.app import create_app
        from openai_api.server import HttpServer
        self.http = HttpServer(create_app(self.config.http, lambda: servicer.router, servicer.loading_message),
                               self.config.router.host, self.config.http.port, self.config.tls)
        self.http_port = await self.http.start()
        scheme = "https" if self.config.tls.enabled else "http"
        say(f"OpenAI-compatible HTTP on {scheme}://{host_port(self.config.router.host, self.http_port)}/v1")

    async def stop(self, grace: float = 5.0) -> None:
        """Health NOT_SERVING, refuse new requests, give in-flight ones `grace` seconds, stop the pools. The public
        ports stay open while the requests drain, so that health checks read NOT_SERVING (a stopped gRPC server
        refuses connections at once) and new requests are refused with UNAVAILABLE."""
        started = time.monotonic()
        if self.health:
            await self.health.enter_graceful_shutdown()
        if self.router:
            self.router.draining = True
            say(f"draining {self.router.in_flight} request(s) (grace {grace:g}s)")
            await self.router.drained(grace)
        left = max(grace - (time.monotonic() - started), 0.0)
        await asyncio.gather(*(server.stop(left) for server in (self.http, self.server, self.admin_server) if server))
        if self.router:
            await self.router.close()
        if self.metrics:
            self.metrics.stop()
        from router import launch
        if self.owns_ray and not self.keep_ray:      # Ray's processes, workers and agents end with us, by PID
            await in_daemon_thread(launch.disconnect, RAY_STOP_S)
        elif self.pools and not await in_daemon_thread(self.pools.shutdown, RAY_STOP_S):
            say(f"Ray did not remove the pools within {RAY_STOP_S:g}s; going on")
        if self.router:
            say("stopped")


RAY_STOP_S = 10.0      # how long stopping waits on one call into Ray


async def to_thread_to_its_end(fn, *args):
    """asyncio.to_thread(fn, *args), except that a cancel waits for fn to return before it is raised: a stop
    while Ray starts then finds every process Ray started (they would outlive serve otherwise)."""
    call = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(call)
    except asyncio.CancelledError:
        await asyncio.wait([call])
        raise


async def in_daemon_thread(fn, timeout: float) -> bool:
    """Run fn() on a daemon thread and wait up to `timeout` s; False if it has not returned by then. A call into
    Ray blocks for good once Ray's GCS or raylet is gone (a SIGTERM sent to serve's whole process group, as
    systemd and `timeout` do, reaches them too): a daemon thread stuck there does not hold the process open."""
    loop, done = asyncio.get_running_loop(), asyncio.Event()

    def run() -> None:
        try:
            fn()
        finally:
            loop.call_soon_threadsafe(done.set)
    threading.Thread(target=run, name=getattr(fn, "__name__", "ray-call"), daemon=True).start()
    try:
        await asyncio.wait_for(done.wait(), timeout)
        return True
    except asyncio.TimeoutError:
        return False


async def reload_from_file(service: Service, path: str) -> None:
    """SIGHUP: re-read the config file and apply it, the command line's overrides over it (or keep the running
    config; the log says which, as for Admin.Reload). An empty file (one being rewritten, say) is refused."""
    from router.reload import logged_reload, not_empty

    try:
        await logged_reload(service.router, lambda: not_empty(read_yaml(path), path), str(Path(path).parent),
                            f"{path} (SIGHUP)")
    except ValueError:       # ConfigError (bad file or value) and RestartRequired: logged, running config kept
        pass
