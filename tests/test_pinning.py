"""Pinning workers to CPUs (`draft.cpus`, `target.cpus`): CPU lists, each rank's slice, `auto` on one machine,
config errors naming the key, and a process's every thread confined (in a child process, not this one)."""
import multiprocessing
import os
import threading

import pytest

from engine.pinning import auto_cpus, pin_process, pin_worker, rank_slice
from router import launch
from settings.cpu_list import format_cpus, parse_cpus
from settings.errors import ConfigError
from settings.schema import config_from_dict

needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux's")


@pytest.mark.parametrize("spec, ids", [("", []), ([], []), ("auto", []), ([3, 1], [3, 1]), ("0", [0]),
                                       ("0-3,8", [0, 1, 2, 3, 8]), (" 2 , 4-5", [2, 4, 5])])
def test_cpu_lists_read_as_taskset_reads_them(spec, ids):
    assert parse_cpus(spec) == ids


@pytest.mark.parametrize("ids, text", [([], ""), ([0], "0"), ([8, 0, 1, 2, 3], "0-3,8"), ([1, 3, 5], "1,3,5"),
                                      ([4, 5], "4-5")])
def test_cpu_lists_are_shown_as_taskset_takes_them(ids, text):
    assert format_cpus(ids) == text and parse_cpus(text) == sorted(ids)


@pytest.mark.parametrize("spec", ["x", "3-1", "0,,1", "-1", "0-", [0, 0], "1,1", [-1], [True], [1.0], {"a": 1}])
def test_a_malformed_cpu_list_is_refused(spec):
    with pytest.raises(ValueError):
        parse_cpus(spec)


def test_config_errors_name_the_key(tiny_pair):
    def config(**target):
        return config_from_dict({"draft": {"model": tiny_pair[0]}, "target": {"model": tiny_pair[1], **target}})
    with pytest.raises(ConfigError, match=r"^target\.cpus: '5-2' is not a CPU id"):
        config(cpus="5-2")
    with pytest.raises(ConfigError, match=r"^target\.cpus: must be list or str \(got 3\)"):
        config(cpus=3)
    with pytest.raises(ConfigError, match=r"^target\.cpus: 1 CPU\(s\) for 2 ranks; give each rank at least one"):
        config(cpus=[0], tensor_parallel_size=2)
    assert config(cpus="0-1", tensor_parallel_size=2).target.cpus == "0-1"
    assert config(cpus="auto", tensor_parallel_size=2).target.cpus == "auto"


def test_ranks_split_a_pools_cpus_into_contiguous_slices_that_cover_them_once():
    assert [rank_slice([0, 1, 2, 3], r, 2) for r in range(2)] == [[0, 1], [2, 3]]
    assert [rank_slice([4, 5, 6, 7, 8], r, 3) for r in range(3)] == [[4, 5], [6, 7], [8]]
    assert rank_slice([2], 0, 1) == [2] and rank_slice([], 1, 2) == []


def test_auto_gives_each_actor_its_own_cpus_targets_first_or_none_when_too_few():
    plan = auto_cpus([0, 1, 2, 3, 4, 5], taken=set(), pools=[("target", 2, 2), ("draft", 1, 1)])
    assert plan == {"target": [[0, 1], [2, 3]], "draft": [[4]]}
    assert auto_cpus([0, 1, 2], taken={0}, pools=[("draft", 2, 1)]) == {"draft": [[1], [2]]}
    assert auto_cpus([0, 1], taken=set(), pools=[("target", 1, 2), ("draft", 1, 1)]) is None


def test_the_launcher_resolves_auto_per_actor_on_a_local_instance_only(monkeypatch, tiny_pair):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    config = config_from_dict({"draft": {"model": tiny_pair[0], "cpus": "auto", "replicas": 2},
                               "target": {"model": tiny_pair[1], "cpus": "auto", "tensor_parallel_size": 2}})
    assert [launch.actor_cpus(config, "target", 0)] == [[0, 1]]
    assert [launch.actor_cpus(config, "draft", i) for i in range(2)] == [[2], [3]]
    assert launch.actor_cpus(config, "draft", 2) == ""               # a replica added later: none left for it
    config.target.cpus = [3]                                         # an explicit list is taken as it is ...
    assert launch.actor_cpus(config, "target", 0) == [3]
    assert [launch.actor_cpus(config, "draft", i) for i in range(2)] == [[0], [1]]   # ... and kept out of auto's
    config.ray.address = "auto"                                      # a cluster: its nodes are not this one
    assert launch.actor_cpus(config, "draft", 0) == ""


def _pinned_threads(cpus, queue):
    """In a child process: start a thread, pin the process, start another; every thread's CPU set."""
    parked = threading.Event()
    before = threading.Thread(target=parked.wait)
    before.start()
    threads = pin_worker({"cpus": cpus, "num_threads": 0}, "draft")
    after = threading.Thread(target=parked.wait)
    after.start()
    sets = [os.sched_getaffinity(int(tid)) for tid in os.listdir("/proc/self/task")]
    parked.set()
    queue.put((threads, sets))


@needs_affinity
def test_pinning_confines_every_thread_of_the_process_before_and_after():
    cpu = max(os.sched_getaffinity(0))
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_pinned_threads, args=([cpu], queue))
    child.start()
    threads, sets = queue.get(timeout=60)
    child.join(60)
    assert threads == 1                            # num_threads 0: one torch thread per pinned CPU
    assert len(sets) >= 3 and all(s == {cpu} for s in sets)


@needs_affinity
def test_a_cpu_the_node_lacks_is_an_error_naming_the_key():
    missing = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(RuntimeError, match=rf"^target\.cpus: CPU\(s\) \[{missing}\] are not available on this node"):
        pin_process([missing], "target.cpus")


def test_a_sandbox_that_forbids_pinning_fails_a_list_but_auto_serves_on_unpinned(monkeypatch, capsys):
    def forbidden(tid, cpus):
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "sched_setaffinity", forbidden, raising=False)
    with pytest.raises(RuntimeError, match=r"^target\.cpus: this process may not pin itself"):
        pin_worker({"cpus": [0], "num_threads": 1}, "target")
    assert pin_worker({"cpus": [1], "cpus_auto": True, "num_threads": 0}, "draft") == 0   # torch's default
    assert "draft.cpus auto: not pinned" in capsys.readouterr().out
