"""Placing the worker pools on Ray: draft replicas as actors, each target replica as a STRICT_PACK
placement group of tensor-parallel rank actors. Pools are steered to their nodes by the Ray
resources named in the config (e.g. draft_gpu / target_gpu). No torch is imported here."""
from __future__ import annotations

import dataclasses
import logging
import os
import uuid
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from draft_worker.actor import DraftWorker
from settings.schema import SpecpoolConfig
from target_worker.actor import TargetRank
from target_worker.tp_support import ModelRefused
from settings.schema import PoolConfig


@dataclass
class Pools:
    tag: str = ""                                          # names this deployment's actors
    draft_addresses: list[str] = field(default_factory=list)
    target_addresses: list[str] = field(default_factory=list)
    target_info: dict = field(default_factory=dict)        # rank 0 of the first target replica
    draft_actors: list = field(default_factory=list)
    target_actors: list[list] = field(default_factory=list)  # per replica, its ranks
    placement_groups: list = field(default_factory=list)

    def shutdown(self) -> None:
        for actor in self.draft_actors + [a for ranks in self.target_actors for a in ranks]:
            ray.kill(actor, no_restart=True)
        for group in self.placement_groups:
            remove_placement_group(group)


def connect(config: SpecpoolConfig, quiet: bool = False) -> None:
    """Join RAY_ADDRESS / ray.address, or start a local instance with the configured resources. `quiet`: only
    Ray's errors on this terminal, and the workers' output (model loading) left in Ray's log files."""
    if ray.is_initialized():
        return
    address = config.ray.address or os.environ.get("RAY_ADDRESS") or "local"   # "local": never join by accident
    kwargs = {"namespace": config.ray.namespace, "log_to_driver": not quiet,
              "logging_level": logging.ERROR if quiet else logging.INFO}
    if address != "local":
        ray.init(address=address, **kwargs)
        return
    kwargs.update(include_dashboard=False, resources=config.ray.resources or None,
                  num_cpus=config.ray.num_cpus or None, _node_ip_address=config.ray.node_ip or None)
    try:
        ray.init(address=address, **kwargs)
    except Exception as exc:  # noqa: BLE001 - Ray raises bare Exception when its processes start too slowly
        print(f"[specpool] the local Ray instance did not start ({str(exc).splitlines()[0]}); trying once more",
              flush=True)
        ray.shutdown()
        ray.init(address=address, **kwargs)


def _bundle(pool: PoolConfig) -> dict:
    bundle = {"CPU": pool.num_cpus, "GPU": pool.num_gpus, **pool.resources}
    return {name: amount for name, amount in bundle.items() if amount} or {"CPU": 0.01}


def start_draft(config: SpecpoolConfig, index: int, tag: str):
    pool = config.draft
    actor = ray.remote(DraftWorker).options(
        name=f"specpool-{tag}-draft-{index}", num_cpus=pool.num_cpus, num_gpus=pool.num_gpus,
        resources=pool.resources, max_restarts=-1, max_task_retries=-1, max_concurrency=64,
    ).remote(dataclasses.asdict(pool), dataclasses.asdict(config.tls))
    return actor, actor.start.remote(config.ray.node_ip or None)


def start_target(config: SpecpoolConfig, index: int, tag: str):
    pool, size = config.target, config.target.tensor_parallel_size
    group = placement_group([_bundle(pool)] * size, strategy="STRICT_PACK", name=f"specpool-{tag}-target-{index}")
    ranks = [ray.remote(TargetRank).options(
        name=f"specpool-{tag}-target-{index}-rank-{rank}", num_cpus=pool.num_cpus, num_gpus=pool.num_gpus,
        resources=pool.resources, max_restarts=-1, max_task_retries=-1, max_concurrency=64,
        scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank),
    ).remote(dataclasses.asdict(pool), dataclasses.asdict(config.draft), rank, size, dataclasses.asdict(config.tls))
        for rank in range(size)]
    return group, ranks


def start_group(ranks: list, host: str | None, timeout: float | None = None) -> list[dict]:
    """Rendezvous at rank 0, then start every rank; returns their infos (rank 0's has the address)."""
    master = ray.get(ranks[0].rendezvous.remote(host), timeout=timeout)
    try:
        return ray.get([rank.start.remote(master, host) for rank in ranks], timeout=timeout)
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, ModelRefused):
            raise exc.cause from None               # its one line, not the actor's traceback
        raise


def recover_draft(actor, host: str | None, timeout: float | None = None) -> str:
    """The draft replica's address once it serves again (Ray restarts a killed actor; start() reloads)."""
    return ray.get(actor.start.remote(host), timeout=timeout)["address"]


def recover_target(ranks: list, host: str | None, timeout: float | None = None) -> str:
    """Tear the whole TP group down and start it again: no half-alive group lingers."""
    for rank in ranks:
        ray.kill(rank, no_restart=False)
    return start_group(ranks, host, timeout)[0]["address"]


def start_drafts(config: SpecpoolConfig, pools: "Pools", count: int) -> list:
    """Create `count` more draft actors (loading begins at once); returns their start() refs."""
    first = len(pools.draft_actors)
    started = [start_draft(config, first + i, pools.tag) for i in range(count)]
    pools.draft_actors.extend(actor for actor, _ in started)
    return [ref for _, ref in started]


def await_drafts(pools: "Pools", refs: list, timeout: float | None = None) -> list:
    """Wait for drafts started by start_drafts; append their addresses; return the new actors."""
    pools.draft_addresses.extend(info["address"] for info in ray.get(refs, timeout=timeout))
    return pools.draft_actors[-len(refs):] if refs else []


def launch_more(config: SpecpoolConfig, pools: "Pools", pool: str, count: int,
                timeout: float | None = None) -> list:
    """Start `count` more replicas of `pool` ("draft" or "target") and wait until they serve.
    Returns the new draft actors or target rank groups; their addresses are appended to `pools`."""
    if pool == "draft":
        return await_drafts(pools, start_drafts(config, pools, count), timeout)
    first, groups = len(pools.target_actors), []
    for i in range(count):
        group, ranks = start_target(config, first + i, pools.tag)
        pools.placement_groups.append(group)
        pools.target_actors.append(ranks)
        ray.get(group.ready(), timeout=timeout)
        infos = start_group(ranks, config.ray.node_ip or None, timeout)
        pools.target_addresses.append(infos[0]["address"])
        pools.target_info = pools.target_info or infos[0]
        groups.append(ranks)
    return groups


def launch(config: SpecpoolConfig, timeout: float | None = None) -> Pools:
    """Start every replica of both pools and wait until all have loaded their models.
    Actors are named specpool-<tag>-draft-<i> and specpool-<tag>-target-<i>-rank-<r>."""
    pools = Pools(tag=uuid.uuid4().hex[:6])
    drafts = config.draft.replicas if config.draft.uses_model else 0   # draft.method ngram: no draft pool
    try:
        draft_refs = start_drafts(config, pools, drafts)                # drafts load while targets start
        launch_more(config, pools, "target", config.target.replicas, timeout)
        await_drafts(pools, draft_refs, timeout)
    except BaseException:
        pools.shutdown()                            # a failed start leaves no actor or placement group behind
        raise
    return pools
