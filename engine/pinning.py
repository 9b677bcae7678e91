"""Confining a worker process to CPUs of its node (`draft.cpus`, `target.cpus`), as `taskset` would.

Draft and target on separate hardware work at the same time; on one machine, pinning each pool to cores of its
own comes closest to that: the target's forward is neither preempted by the draft's pre-draft nor moved between
cores. A target's ranks split the pool's CPUs into equal contiguous slices, one per rank (as vLLM's CPU backend
binds one CPU range per rank). No torch here.

    threads = pin_worker(config, "target", rank=1, world_size=2)   # cpus "0-3": this rank's threads on 2 and 3
"""
from __future__ import annotations

import os

from settings.cpu_list import parse_cpus


def pin_worker(config: dict, section: str, rank: int = 0, world_size: int = 1) -> int:
    """Pin this worker process (rank `rank` of `world_size`) to its share of its pool's `cpus`; the torch threads
    it should run: `num_threads`, else one per pinned CPU (0: torch's default)."""
    cpus = rank_slice(parse_cpus(config.get("cpus")), rank, world_size)
    try:
        pin_process(cpus, f"{section}.cpus")
    except PermissionError as exc:             # a sandbox that forbids it: `auto` serves on unpinned
        if not config.get("cpus_auto"):
            raise RuntimeError(f"{section}.cpus: this process may not pin itself ({exc})") from None
        print(f"[specpool] {section}.cpus auto: not pinned, this process may not pin itself ({exc})", flush=True)
        cpus = []
    if cpus:
        print(f"[specpool] {section}{f' rank {rank}' if world_size > 1 else ''}: pinned to CPU(s) "
              f"{','.join(map(str, cpus))}", flush=True)
    return config.get("num_threads") or len(cpus)


def rank_slice(cpus: list[int], rank: int, world_size: int) -> list[int]:
    """Rank `rank`'s share of a pool's CPUs: equal contiguous slices (the first ranks take one more when they do
    not divide evenly)."""
    if not cpus:
        return []
    share, extra = divmod(len(cpus), world_size)
    start = rank * share + min(rank, extra)
    return cpus[start:start + share + (rank < extra)]


def pin_process(cpus: list[int], key: str) -> None:
    """Confine every thread of this process to `cpus` (threads started later inherit it). RuntimeError naming
    `key` when a CPU is not one this process may use on its node, or the platform cannot pin."""
    if not cpus:
        return
    if not hasattr(os, "sched_setaffinity"):
        raise RuntimeError(f"{key}: pinning to CPUs needs Linux (os.sched_setaffinity)")
    allowed = os.sched_getaffinity(0)
    missing = sorted(set(cpus) - allowed)
    if missing:
        raise RuntimeError(f"{key}: CPU(s) {missing} are not available on this node (available: "
                           f"{sorted(allowed)})")
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:                # a thread that ended meanwhile
            pass


def auto_cpus(available: list[int], taken: set[int], pools: list[tuple[str, int, int]]) -> dict[str, list] | None:
    """`cpus: auto` on one machine: each actor of `pools` [(pool, actors, CPUs each)] its own CPUs from `available`
    less those `taken` by explicit lists, in order (targets first, so a target rank takes the first cores):
    {pool: [CPUs of actor i]}; None when there are too few to give every actor its own."""
    free = [cpu for cpu in available if cpu not in taken]
    if sum(actors * each for _, actors, each in pools) > len(free):
        return None
    plan, at = {}, 0
    for pool, actors, each in pools:
        plan[pool] = [free[at + i * each:at + (i + 1) * each] for i in range(actors)]
        at += actors * each
    return plan
