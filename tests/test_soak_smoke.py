"""The soak benchmark, briefly, on the tiny byte-level pair: two streams run for 6 s while the draft worker is
SIGKILLed every 2.5 s, and every request still finishes OK with the fault-free reference's tokens. (Seed 2 makes
the killer pick the draft: a target kill is covered by tests/test_chaos.py, and its recovery, seconds on two
busy cores, would make this smoke test slow.)

    .venv/bin/python -m pytest -q tests/test_soak_smoke.py
"""
import os
import threading

import yaml

from benchmarks.soak import SoakConfig, run
from tests.conftest import service_config


def write_config(folder, pair) -> str:
    """A soak config YAML in `folder` whose model paths are relative to that folder (as in deploy/local.yaml),
    so they resolve only if the soak reads them against the YAML's folder rather than the working directory."""
    data = service_config(pair)
    for section in ("draft", "target"):
        data[section]["model"] = os.path.relpath(data[section]["model"], folder)
    path = folder / "soak.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_soak_with_kills_gives_reference_tokens(ray_local, byte_pair, tmp_path):
    cfg = SoakConfig(config=write_config(tmp_path, byte_pair), out=str(tmp_path), streams=2, minutes=0.1,
                     kill_every=2.5, max_new_tokens=32, seed=2)
    summary = run(cfg)
    assert summary["requests"] > 0
    assert summary["by_status"] == {"OK": summary["requests"]}
    assert summary["identical_to_reference"] == summary["ok"] == summary["requests"]
    assert [kill for kill in summary["kills"] if "skipped" not in kill], summary["kills"]
    # the service's event loop ended with it (it used to run on beside later tests' grpc.aio loops)
    assert not [thread for thread in threading.enumerate() if thread.name == "service-loop"]
