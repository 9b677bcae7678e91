"""Node loss: the node holding both pools is removed mid-request (ray.cluster_utils.Cluster); the
actors and the target's placement group come back on a replacement node, the request finishes
with identical greedy tokens, and the recovery time is measured."""
import os
import time

import pytest

from protos.specpool.v1 import generation_pb2
from tests.conftest import RunningService, service_config

POOL_NODE = {"num_cpus": 4, "resources": {"draft_pool": 1, "target_pool": 1}}


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster
    environ = dict(os.environ)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    ray.init(address=cluster.address, namespace="specpool-node-loss", log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()
    os.environ.clear()
    os.environ.update(environ)


def test_node_removed_mid_request(cluster, byte_pair, reference_generate):
    doomed = cluster.add_node(**POOL_NODE)
    cluster.wait_for_nodes()
    service = RunningService(service_config(byte_pair, router={"target_recovery_s": 180.0}))
    try:
        request = generation_pb2.GenerateRequest(prompt_token_ids=[2, 7, 1, 8], max_new_tokens=150)
        request.speculation.k = 2
        chunks, arrivals = [], []
        for chunk in service.stub.GenerateStream(request, timeout=300):
            chunks.append(chunk)
            arrivals.append(time.monotonic())
            if len(chunks) == 5:
                cluster.add_node(**POOL_NODE)              # the replacement
                cluster.remove_node(doomed)
                arrivals[-1] = time.monotonic()
        assert [t for c in chunks for t in c.token_ids] == reference_generate([2, 7, 1, 8], 150)
        stall = max(b - a for a, b in zip(arrivals[4:], arrivals[5:]))
        ks = list(chunks[-1].stats.k_per_round)
        print(f"\nnode loss: longest stall after removal {stall:.1f}s; K per round {ks[:12]}...")
        assert stall < 180
        assert len(cluster.list_all_nodes()) == 2
    finally:
        service.stop()
