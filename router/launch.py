"""Placing the worker pools on Ray: draft replicas as actors, each target replica as a STRICT_PACK
placement group of tensor-parallel rank actors. Pools are steered to their nodes by the Ray
resources named in the config (e.g. draft_gpu / target_gpu). No torch is imported here."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import threading
import uuid
from dataclasses import dataclass, field

import psutil
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from draft_worker.actor import DraftWorker
from engine.pinning import auto_cpus
from router.oplog import say
from settings.cpu_list import AUTO, parse_cpus
from settings.schema import SpecpoolConfig
from target_worker.actor import TargetRank
from target_worker.tp_support import ModelRefused
from settings.schema import PoolConfig


@dataclass
class Pools:
    tag: str = ""                                          # names this deployment's actors
    draft_started: list[dict] = field(default_factory=list)    # of drafts waited for (launch_more): Started infos
    draft_starts: list = field(default_factory=list)       # launch(): the first drafts' start() refs, still loading
    target_started: list[dict] = field(default_factory=list)   # per replica: Started (group_started)
    target_info: dict = field(default_factory=dict)        # rank 0 of the first target replica
    draft_actors: list = field(default_factory=list)
    target_actors: list[list] = field(default_factory=list)  # per replica, its ranks
    placement_groups: list = field(default_factory=list)

    def shutdown(self) -> None:
        for actor in self.draft_actors + [a for ranks in self.target_actors for a in ranks]:
            ray.kill(actor, no_restart=True)
        for group in self.placement_groups:
            remove_placement_group(group)


# A local instance runs no dashboard, so Ray's own metrics have no agent to go to (every export failed, logged), and
# tearing their exporter down raced with its threads: the driver died with SIGSEGV right after "Stats module has
# shutdown" (seen twice in the test suite's process, a thread of that exporter jumping to address 0). specpool's own
# metrics are the router's Prometheus endpoint.
LOCAL_SYSTEM_CONFIG = {"enable_metrics_collection": False}
NICENESS = "RAY_worker_niceness"     # the CPU priority Ray gives a worker process (15 unless told), read from its env
_local_niceness: tuple | None = None  # (session, niceness): the local instance this process started, and the
                                      # niceness its raylet gives every worker


def init_local(niceness: int, **kwargs) -> None:
    """ray.init(**kwargs) a local instance whose raylet gives every worker process `niceness` (RAY_worker_niceness
    in the raylet's environment), so that actors need no runtime_env of their own (_worker_options): an actor
    then starts in a worker process Ray started ahead while one is idle, and else in a new one without the
    runtime-env agent's part. Measured on this machine, from the actor's creation to its constructor: 0.02-0.23 s
    and then 0.73-0.94 s, against 1.21-1.85 s with a runtime_env (each worker's start, and each restart)."""
    global _local_niceness
    before = os.environ.get(NICENESS)
    os.environ[NICENESS] = str(niceness)
    try:
        ray.init(**kwargs)
        _local_niceness = (session(), niceness)
    finally:
        if before is None:
            os.environ.pop(NICENESS, None)
        else:
            os.environ[NICENESS] = before


def session() -> str | None:
    """The Ray session this process is connected to (None: none)."""
    node = getattr(ray._private.worker, "_global_node", None)
    return node.session_name if node is not None else None


def connect(config: SpecpoolConfig, quiet: bool = False) -> bool:
    """Join RAY_ADDRESS / ray.address, or start a local instance with the configured resources (logical CPUs:
    `local_num_cpus`). True if this started a local instance (then `disconnect` stops it). `quiet`: only Ray's
    errors on this terminal, and the workers' output (model loading) left in Ray's log files."""
    if ray.is_initialized():
        return False
    logging.getLogger("ray._private.worker").addFilter(no_sigterm_notice)
    address = config.ray.address or os.environ.get("RAY_ADDRESS") or "local"   # "local": never join by accident
    kwargs = {"namespace": config.ray.namespace, "log_to_driver": not quiet,
              "logging_level": logging.ERROR if quiet else logging.INFO}
    if not local(config):
        ray.init(address=address, **kwargs)
        return False
    kwargs.update(include_dashboard=False, resources=config.ray.resources or None, num_cpus=local_num_cpus(config),
                  _node_ip_address=config.ray.node_ip or None, _system_config=LOCAL_SYSTEM_CONFIG)
    try:
        init_local(config.ray.worker_niceness, address=address, **kwargs)
    except Exception as exc:  # noqa: BLE001 - Ray raises bare Exception when its processes start too slowly
        say(f"the local Ray instance did not start ({str(exc).splitlines()[0]}); trying once more")
        disconnect()
        init_local(config.ray.worker_niceness, address=address, **kwargs)
    return True


def no_sigterm_notice(record: logging.LogRecord) -> bool:
    """A logging filter that drops ray.init's "SIGTERM handler is not set because current thread is not the main
    thread": serve calls it on a thread on purpose, and handles SIGTERM itself (a drain); Ray's handler, which the
    warning misses, would exit at once. On serve's terminal the line read as if SIGTERM went unhandled."""
    return not record.getMessage().startswith("SIGTERM handler is not set")


def local(config: SpecpoolConfig) -> bool:
    """Whether `connect` starts a local instance (no cluster named), rather than joining one."""
    return not (config.ray.address or os.environ.get("RAY_ADDRESS"))


def disconnect() -> None:
    """Stop the local Ray instance this process started, and every process it started: its agents, which Ray
    leaves to notice their raylet's death on their own (for up to a minute), are ended here, by PID. If one of
    them has already died (a SIGTERM sent to serve's whole process group reaches Ray's processes too), Ray's own
    shutdown would wait on it for seconds: then they are all ended first."""
    node = getattr(ray._private.worker, "_global_node", None)
    started = [info.process.pid for infos in (node.all_processes.values() if node else ()) for info in infos]
    processes = []
    for pid in started:
        with contextlib.suppress(psutil.NoSuchProcess):
            process = psutil.Process(pid)
            processes += [process, *process.children(recursive=True)]
    global _local_niceness
    if any(not running(process) for process in processes):
        end(processes)
    ray.shutdown()
    _local_niceness = None
    end(processes, wait=1)


def running(process: psutil.Process) -> bool:
    with contextlib.suppress(psutil.NoSuchProcess):
        return process.status() != psutil.STATUS_ZOMBIE
    return False


def end(processes: list, wait: float = 0) -> None:
    """Wait up to `wait` s for `processes` to exit, then terminate and at last kill those still running."""
    _, alive = psutil.wait_procs(processes, timeout=wait)
    for signal_name in ("terminate", "kill"):
        for process in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                getattr(process, signal_name)()
        _, alive = psutil.wait_procs(alive, timeout=2)


def draft_replicas(config: SpecpoolConfig) -> int:
    """The draft pool's replicas: none with draft.method ngram (proposals come from the router)."""
    return config.draft.replicas if config.draft.uses_model else 0


def demand(config: SpecpoolConfig) -> dict[str, float]:
    """Ray resources every replica of both pools asks for, summed by resource name."""
    asks = [(draft_replicas(config), config.draft), (config.target.replicas * config.target.tensor_parallel_size,
                                                    config.target)]
    total: dict[str, float] = {}
    for count, pool in asks:
        for name, amount in {"CPU": pool.num_cpus, "GPU": pool.num_gpus, **pool.resources}.items():
            total[name] = total.get(name, 0) + count * amount
    return {name: amount for name, amount in total.items() if amount}


def local_num_cpus(config: SpecpoolConfig) -> int:
    """A local instance's logical CPUs: `ray.num_cpus`, else this machine's cores or, if the pools ask for more,
    that many (logical CPUs only schedule; a minimal TP=2 config must place on a 2-core machine)."""
    return config.ray.num_cpus or max(os.cpu_count() or 1, math.ceil(demand(config).get("CPU", 0)))


def shortfall(config: SpecpoolConfig, available: dict[str, float]) -> str:
    """'' if `available` covers what the pools ask for, else what they ask and what there is."""
    asked = demand(config)
    short = {name: amount for name, amount in asked.items() if amount > available.get(name, 0) + 1e-9}
    if not short:
        return ""
    def show(resources):
        return ", ".join(f"{name} {amount:g}" for name, amount in sorted(resources.items()))
    return (f"the pools ask for {show(asked)} ({draft_replicas(config)} draft, {config.target.replicas} target "
            f"x TP {config.target.tensor_parallel_size}); the cluster has "
            f"{show({name: available.get(name, 0) for name in asked})}: "
            f"short of {show({name: asked[name] - available.get(name, 0) for name in short})}")


def _bundle(pool: PoolConfig) -> dict:
    bundle = {"CPU": pool.num_cpus, "GPU": pool.num_gpus, **pool.resources}
    return {name: amount for name, amount in bundle.items() if amount} or {"CPU": 0.01}


def _worker_options(config: SpecpoolConfig, pool: PoolConfig) -> dict:
    """Actor options every draft and target worker shares: its pool's resources, restarts, and its process's CPU
    priority. Ray starts worker processes at nice 15 (RAY_worker_niceness) so that they yield to its own daemons;
    a model's forward is the work a serving node exists for, and at 15 every process at 0 beside it (the router,
    Ray's agents, a client on the same machine) pre-empts it. A local instance this process started gives every
    worker the configured niceness already (init_local); in a cluster the variable goes in the actor's
    runtime_env, which reaches each worker, restarts too."""
    options = {"num_cpus": pool.num_cpus, "num_gpus": pool.num_gpus, "resources": pool.resources,
               "max_restarts": -1, "max_task_retries": -1, "max_concurrency": 64}
    if not (local(config) and _local_niceness == (session(), config.ray.worker_niceness)):
        options["runtime_env"] = {"env_vars": {NICENESS: str(config.ray.worker_niceness)}}
    return options


def actor_cpus(config: SpecpoolConfig, pool: str, index: int) -> list | str:
    """The `cpus` of actor `index` of `pool` ("draft", or "target": a replica, its ranks together): the pool's
    own list, or for `auto` CPUs of its own on a local instance (engine.pinning.auto_cpus over the CPUs this
    process may use), "" (not pinned) in a cluster or where there are too few."""
    if getattr(config, pool).cpus != AUTO:
        return getattr(config, pool).cpus
    if config.ray.address or not hasattr(os, "sched_getaffinity"):
        return ""
    counts = {"target": (config.target.replicas, config.target.tensor_parallel_size),
              "draft": (draft_replicas(config), 1)}
    auto = [(name, counts[name][0], counts[name][1] * max(getattr(config, name).num_threads, 1))
            for name in ("target", "draft") if getattr(config, name).cpus == AUTO]
    taken = {cpu for name in ("target", "draft") for cpu in parse_cpus(getattr(config, name).cpus)}
    plan = auto_cpus(sorted(os.sched_getaffinity(0)), taken, auto)
    if plan is None or index >= len(plan[pool]):
        say(f"{pool}.cpus auto: too few CPUs for each worker its own; {pool} {index} is not pinned")
        return ""
    return plan[pool][index]


def _pool_dict(config: SpecpoolConfig, pool: str, index: int) -> dict:
    """The pool section as its actor `index` gets it, with that actor's own `cpus` (and whether they came from
    `auto`, which serves on unpinned where the node forbids pinning)."""
    return {**dataclasses.asdict(getattr(config, pool)), "cpus": actor_cpus(config, pool, index),
            "cpus_auto": getattr(config, pool).cpus == AUTO}


def start_draft(config: SpecpoolConfig, index: int, tag: str):
    pool = config.draft
    actor = ray.remote(DraftWorker).options(
        name=f"specpool-{tag}-draft-{index}", **_worker_options(config, pool),
    ).remote(_pool_dict(config, "draft", index), dataclasses.asdict(config.tls))
    return actor, actor.start.remote(config.ray.node_ip or None)


def start_target(config: SpecpoolConfig, index: int, tag: str):
    pool, size = config.target, config.target.tensor_parallel_size
    group = placement_group([_bundle(pool)] * size, strategy="STRICT_PACK", name=f"specpool-{tag}-target-{index}")
    ranks = [ray.remote(TargetRank).options(
        name=f"specpool-{tag}-target-{index}-rank-{rank}", **_worker_options(config, pool),
        scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank),
    ).remote(_pool_dict(config, "target", index), dataclasses.asdict(config.draft), rank, size,
             dataclasses.asdict(config.tls))
        for rank in range(size)]
    return group, ranks


class WorkerFailed(RuntimeError):
    """A worker raised while loading its model; the message names the worker and its exception, in one line."""


def get_started(refs, worker: str, timeout: float | None = None):
    """ray.get of workers' start() calls, a worker's own exception raised as WorkerFailed naming it."""
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause if isinstance(getattr(exc, "cause", None), BaseException) else exc
        if isinstance(cause, ModelRefused):
            raise cause from None                   # its own one line names the model, the TP size and why
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        raise WorkerFailed(f"{worker}: {type(cause).__name__}: {first}") from None


def start_group(ranks: list, host: str | None, timeout: float | None = None) -> list[dict]:
    """Rendezvous at rank 0, then start every rank; returns their infos (rank 0's has the address)."""
    master = get_started(ranks[0].rendezvous.remote(host), "target rank 0", timeout)
    return get_started([rank.start.remote(master, host) for rank in ranks], "target", timeout)


def group_started(infos: list[dict]) -> dict:
    """A target replica's start as its client takes it (worker_client.Started): rank 0's address, every rank's
    CPUs."""
    return {"address": infos[0]["address"], "cpus": sorted({cpu for info in infos for cpu in info.get("cpus", ())})}


def recover_draft(actor, host: str | None, timeout: float | None = None) -> dict:
    """The draft replica's start info (address, CPUs) once it serves again (Ray restarts a killed actor; start()
    reloads)."""
    return ray.get(actor.start.remote(host), timeout=timeout)


def recover_target(ranks: list, host: str | None, timeout: float | None = None) -> dict:
    """Tear the whole TP group down and start it again: no half-alive group lingers. Its group_started info."""
    for rank in ranks:
        ray.kill(rank, no_restart=False)
    return group_started(start_group(ranks, host, timeout))


def start_drafts(config: SpecpoolConfig, pools: "Pools", count: int) -> list:
    """Create `count` more draft actors (loading begins at once); returns their start() refs."""
    first = len(pools.draft_actors)
    started = [start_draft(config, first + i, pools.tag) for i in range(count)]
    pools.draft_actors.extend(actor for actor, _ in started)
    return [ref for _, ref in started]


def load_draft(start_ref, name: str, timeout: float | None = None) -> dict:
    """The start info (address, CPUs) of a draft replica launch() left loading, once it has loaded (blocking).
    WorkerFailed if it raised while loading, or did not load within `timeout` seconds."""
    try:
        return get_started(start_ref, name, timeout)
    except ray.exceptions.GetTimeoutError:
        raise WorkerFailed(f"{name}: not loaded within {timeout:g} s (router.ready_timeout_s)") from None


def check_drafts(refs: list) -> None:
    """WorkerFailed if a draft replica has already failed to load (the others may still be loading)."""
    if refs:
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        get_started(done, "draft")


def await_drafts(pools: "Pools", refs: list, timeout: float | None = None) -> list:
    """Wait for drafts started by start_drafts; append their start infos; return the new actors."""
    pools.draft_started.extend(get_started(refs, "draft", timeout))
    return pools.draft_actors[-len(refs):] if refs else []


def launch_more(config: SpecpoolConfig, pools: "Pools", pool: str, count: int,
                timeout: float | None = None) -> list:
    """Start `count` more replicas of `pool` ("draft" or "target") and wait until they serve.
    Returns the new draft actors or target rank groups; their start infos are appended to `pools`."""
    if pool == "draft":
        return await_drafts(pools, start_drafts(config, pools, count), timeout)
    first, groups = len(pools.target_actors), []
    for i in range(count):
        group, ranks = start_target(config, first + i, pools.tag)
        pools.placement_groups.append(group)
        pools.target_actors.append(ranks)
        ray.get(group.ready(), timeout=timeout)
        infos = start_group(ranks, config.ray.node_ip or None, timeout)
        pools.target_started.append(group_started(infos))
        pools.target_info = pools.target_info or infos[0]
        groups.append(ranks)
    return groups


class Unplaceable(RuntimeError):
    """A fixed (local) Ray instance has fewer resources than the pools ask for: they would wait forever."""


def check_placement(config: SpecpoolConfig, fixed: bool) -> str:
    """What the pools lack ('' if nothing); on a `fixed` instance (it cannot grow) that is Unplaceable, at once."""
    short = shortfall(config, ray.cluster_resources())
    if short and fixed:
        raise Unplaceable(f"cannot place the worker pools: {short}")
    return short


def report_placement(config: SpecpoolConfig, done: threading.Event, every: float = 30.0) -> None:
    """While the pools wait on a cluster that lacks what they ask for, say what is missing every `every` s."""
    while (short := check_placement(config, fixed=False)) and not done.is_set():
        say(f"waiting for the cluster to place the pools: {short}")
        if done.wait(every):
            return


def launch(config: SpecpoolConfig, timeout: float | None = None, fixed: bool = False) -> Pools:
    """Start every replica of both pools; return once the target replicas have loaded their models. The draft
    replicas load meanwhile and may still be loading (`pools.draft_starts`, their start() refs: see load_draft);
    one that has already failed fails the launch. `fixed`: the cluster cannot grow (a local instance), so pools
    it cannot place are an error at once.
    Actors are named specpool-<tag>-draft-<i> and specpool-<tag>-target-<i>-rank-<r>."""
    check_placement(config, fixed)
    done = threading.Event()
    threading.Thread(target=report_placement, args=(config, done), daemon=True).start()
    pools = Pools(tag=uuid.uuid4().hex[:6])
    try:
        pools.draft_starts = start_drafts(config, pools, draft_replicas(config))   # drafts load while targets start
        launch_more(config, pools, "target", config.target.replicas, timeout)
        check_drafts(pools.draft_starts)
        return pools
    except BaseException:
        pools.shutdown()                            # a failed start leaves no actor or placement group behind
        raise
    finally:
        done.set()
