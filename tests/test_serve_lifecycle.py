"""`specpool serve` from start to exit, each run in its own process with its own Ray temp dir, so that every
process it starts can be found afterwards (by that dir on its command line; nothing is killed by name):

- pools that a local instance cannot place are refused at once, saying what they ask for and what there is
  (they used to wait out ready_timeout_s without a word);
- a worker that fails to load its model ends serve with the worker's own exception, in one line;
- a local instance sizes its logical CPUs to the pools (a TP=2 target and a draft place on a 2-core machine);
- after a failed start no process that serve started remains (Ray's agents used to stay up for a minute).
"""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from router import launch
from settings.schema import config_from_dict
from tests.conftest import service_config, wait_gone


def serve(config: dict, tmp_path, ray_tmp: str, timeout: float = 240) -> subprocess.CompletedProcess:
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "RAY_ADDRESS": "", "RAY_TMPDIR": ray_tmp, "RAY_gcs_server_port_wait_time_s": "120"}
    return subprocess.run([sys.executable, "-m", "router.cli", "serve", "--config", str(path)], env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_unplaceable_pools_are_refused_at_once_with_what_they_lack(tmp_path, ray_tmp, byte_pair):
    config = service_config(byte_pair, router={"ready_timeout_s": 600.0}, ray={"num_cpus": 4},
                            draft={"resources": {"draft_gpu": 1}}, target={"resources": {}})
    done = serve(config, tmp_path, ray_tmp)
    assert done.returncode == 1, done.stdout + done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("specpool: could not start: Unplaceable: cannot place the worker pools: "
                           "the pools ask for CPU 2, draft_gpu 1"), line
    assert "the cluster has CPU 4, draft_gpu 0: short of draft_gpu 1" in line, line
    assert wait_gone(ray_tmp, 10) == []


def test_a_worker_that_cannot_load_is_reported_in_one_line(tmp_path, ray_tmp, byte_pair):
    broken = tmp_path / "broken-draft"
    shutil.copytree(byte_pair[0], broken)
    (broken / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    config = service_config((str(broken), byte_pair[1]), router={"ready_timeout_s": 600.0},
                            ray={"num_cpus": 4, "resources": {"draft_pool": 1, "target_pool": 1}})
    done = serve(config, tmp_path, ray_tmp)
    assert done.returncode == 1, done.stdout + done.stderr
    line = done.stderr.strip().splitlines()[-1]
    # (the target reads the draft's config too, to check the pair: whichever worker tries first reports it)
    assert re.match(r"specpool: could not start: WorkerFailed: (draft|target): ValueError: ", line), line
    assert "no-such-architecture" in line, line
    assert "Traceback" not in done.stderr.split("specpool: could not start")[-1]
    assert wait_gone(ray_tmp, 10) == []


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU affinity is Linux's")
def test_a_worker_pinned_to_a_cpu_its_node_lacks_is_reported_in_one_line_naming_the_key(tmp_path, ray_tmp, byte_pair):
    missing = max(os.sched_getaffinity(0)) + 1
    config = service_config(byte_pair, router={"ready_timeout_s": 600.0}, target={"cpus": [missing]},
                            ray={"num_cpus": 4, "resources": {"draft_pool": 1, "target_pool": 1}})
    done = serve(config, tmp_path, ray_tmp)
    assert done.returncode == 1, done.stdout + done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith(f"specpool: could not start: WorkerFailed: target: RuntimeError: target.cpus: CPU(s) "
                           f"[{missing}] are not available on this node (available: "), line
    assert wait_gone(ray_tmp, 10) == []


def test_a_local_instance_has_the_cpus_its_pools_ask_for(monkeypatch, byte_pair):
    """The minimal TP=2 config of the issue on a 2-core machine: a draft (1 CPU) and two ranks (1 CPU each)."""
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    minimal = config_from_dict({"draft": {"model": byte_pair[0]},
                                "target": {"model": byte_pair[1], "tensor_parallel_size": 2}})
    assert launch.demand(minimal) == {"CPU": 3}
    assert launch.local_num_cpus(minimal) == 3
    assert launch.shortfall(minimal, {"CPU": 3.0, "memory": 1e9}) == ""
    assert launch.local_num_cpus(config_from_dict({"ray": {"num_cpus": 1}})) == 1     # ray.num_cpus decides
    assert launch.local_num_cpus(config_from_dict({})) == 2
    short = launch.shortfall(minimal, {"CPU": 2.0})
    assert short.endswith("the cluster has CPU 2: short of CPU 1"), short
