"""Prefix-aware replica choice (router/affinity.py), against fake replicas: a prompt that begins as an earlier one's
goes where that one went, within the slack; the longest shared prefix decides; a replica that is out or too busy,
a pool of one, a short prompt or slack -1 leave the choice to the least loaded replica. End to end, with two
target replicas: a request sharing a prefix with one served before finds it in that replica's prefix cache."""
import contextlib
import threading
import time
from dataclasses import dataclass

import grpc

from protos.specpool.v1 import generation_pb2
from router.affinity import PrefixAffinity
from tests.test_e2e_replicas import service  # noqa: F401 - the two-replica service fixture

PREFIX = [(5 * i + 1) % 200 for i in range(40)]        # 2 blocks of 16 and 8 tokens


@dataclass(eq=False)
class Replica:
    name: str
    outstanding: int = 0
    healthy: bool = True


def pool(*loads: int) -> list[Replica]:
    return [Replica(f"r{i}", load) for i, load in enumerate(loads)]


def test_a_prompt_sharing_a_prefix_goes_where_the_first_went_within_the_slack():
    replicas, affinity = pool(3, 0), PrefixAffinity(slack=4)
    first = affinity.choose(replicas, PREFIX + [1])
    assert first is replicas[1]                                  # nothing known: the least loaded
    first.outstanding = 4
    assert affinity.choose(replicas, PREFIX + [2, 3]) is first   # 4 sessions, the other 3: within 4 more
    first.outstanding = 8
    assert affinity.choose(replicas, PREFIX + [4]) is replicas[0]   # 8 > 3 + 4: the least loaded takes it...
    assert affinity.choose(replicas, PREFIX + [5]) is replicas[0]   # ... and now holds those blocks


def test_the_longest_shared_prefix_decides():
    replicas, affinity = pool(0, 0), PrefixAffinity(slack=4)
    assert affinity.choose(replicas, PREFIX[:16] + [9] * 20) is replicas[0]
    replicas[0].outstanding = 1
    assert affinity.choose(replicas, PREFIX) is replicas[0]       # its first block: replica 0's
    replicas[0].outstanding, replicas[1].outstanding = 0, 1
    other = PrefixAffinity(slack=4)
    other.choose([replicas[1]] * 2, PREFIX)                       # replica 1 took the whole prefix...
    other.choose([replicas[0]] * 2, PREFIX[:16] + [7] * 20)       # ... replica 0 only its first block since
    assert other.choose(replicas, PREFIX + [1]) is replicas[1]    # the deeper match wins


def test_out_of_the_pool_a_pool_of_one_a_short_prompt_or_slack_minus_one_is_least_loaded():
    replicas, affinity = pool(0, 1), PrefixAffinity(slack=4)
    assert affinity.choose(replicas, PREFIX) is replicas[0]
    replicas[0].healthy = False
    assert affinity.choose(replicas, PREFIX) is replicas[1]
    assert PrefixAffinity(slack=4).choose(replicas[:1], PREFIX) is replicas[0]
    replicas = pool(2, 0)
    short = PrefixAffinity(slack=4)
    short.choose(list(reversed(replicas)), [1] * 15)
    assert short.choose(replicas, [1] * 15) is replicas[1]        # no full block: nothing to follow
    off = PrefixAffinity(slack=-1)
    off.choose([replicas[0]] * 2, PREFIX)
    assert off.choose(replicas, PREFIX) is replicas[1]


def test_it_remembers_at_most_max_blocks():
    affinity = PrefixAffinity(slack=4, max_blocks=3)
    replicas = pool(0, 0)
    affinity.choose(replicas, PREFIX)                             # 2 blocks
    affinity.choose(replicas, [3] * 40)                           # 2 more: the oldest goes
    assert len(affinity._owners) == 3


def test_a_request_sharing_a_prefix_finds_it_on_the_replica_that_served_it(service):  # noqa: F811
    """The prefix's first request goes to replica 0 (least loaded, first on ties); then a long request holds a
    session on replica 0, so least-loaded choice alone would send the next request with the prefix to replica 1,
    which never saw it. Affinity sends it to replica 0, whose prefix cache holds the prefix's first two blocks."""
    targets = service.service.router.targets

    def request(prompt, max_new):
        return generation_pb2.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=max_new)

    def idle() -> bool:
        deadline = time.monotonic() + 10
        while any(t.outstanding for t in targets) and time.monotonic() < deadline:
            time.sleep(0.02)
        return not any(t.outstanding for t in targets)
    assert service.stub.Generate(request(PREFIX + [1], 4)).stats.cached_prompt_tokens == 0
    assert idle()
    started, stream = threading.Event(), service.stub.GenerateStream(request([9, 8, 7], 400))

    def read() -> None:
        with contextlib.suppress(grpc.RpcError):        # cancelled below
            for _ in stream:
                started.set()
    reader = threading.Thread(target=read)
    reader.start()
    try:
        assert started.wait(60) and [t.outstanding for t in targets] == [1, 0]
        assert service.stub.Generate(request(PREFIX + [2], 4)).stats.cached_prompt_tokens == 32
    finally:
        stream.cancel()
        reader.join(30)
