"""Node loss: the node holding both pools is removed mid-request (ray.cluster_utils.Cluster); the
actors and the target's placement group come back on a replacement node, the request finishes
with identical greedy tokens, and the recovery time (the stream's longest stall) is measured.

The scenario process once stayed alive after printing its result, spinning: the router's background
draft recovery was still in ray.get when Ray shut down, on an executor thread that interpreter exit joins.
Recoveries now run on daemon threads and close() cancels them (tests/test_recovery_bound.py).

Twice in CI (sessions 32 and 48) the scenario died of SIGSEGV with no sign of where. It now prints its result
before Ray's teardown and marks that on stderr, with faulthandler on: a crash while the request runs fails
here with both outputs in full; one in Ray's teardown of the test's own cluster, after the result and the
service's stop, is reported and the result checked as usual."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.node_loss_scenario import PROMPT, RESULT_OUT

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_node_removed_mid_request(byte_pair, reference_generate):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    run = subprocess.run([sys.executable, "-m", "tests.node_loss_scenario", *byte_pair], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    if run.returncode != 0 and RESULT_OUT not in run.stderr:
        pytest.fail(f"the scenario exited {run.returncode} before its result\n--- stdout ---\n{run.stdout[-3000:]}"
                    f"\n--- stderr ---\n{run.stderr[-6000:]}", pytrace=False)
    if run.returncode != 0:
        # The request and the service's stop are behind us; only the test's own Ray cluster was being torn down.
        print(f"\nnode loss: Ray's teardown of the test cluster exited {run.returncode} after the result\n"
              f"{run.stderr[run.stderr.index(RESULT_OUT):][-3000:]}")
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["tokens"] == reference_generate(PROMPT, 150)
    assert result["nodes"] == 2
    assert result["target_moved"]               # the router re-found the restarted target at its new address
    print(f"\nnode loss: longest stall after removal {result['stall_s']:.1f}s")
    # The removal did stall the stream (a restarted target is a new process loading its model: over 1 s),
    # and the loss was noticed when the workers' connections broke, not by a call waiting out
    # worker_timeout_s (120 s); the README records 4.7-14 s. (target_recovery_s, 500 s, only bounds a
    # request that is failing.)
    assert 1.0 < result["stall_s"] < result["worker_timeout_s"]
