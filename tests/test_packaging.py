"""Repository invariants: committed gRPC stubs match the .proto files, the router imports no torch,
and the shipped configs load."""
import subprocess
import sys
from pathlib import Path

import pytest

from settings.schema import ConfigError, config_from_dict, load_config

ROOT = Path(__file__).resolve().parent.parent


def test_committed_stubs_match_protos():
    from protos.generate import stale_files
    assert stale_files() == [], "run: python -m protos.generate"


def test_router_imports_no_torch():
    code = ("import sys, router.cli, router.server, router.launch, router.speculation, router.worker_client, openai_api.app; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"


def test_local_config_loads():
    config = load_config(ROOT / "deploy" / "local.yaml")
    assert config.router.port == 50051 and config.target.tensor_parallel_size == 1


def test_one_gpu_config_puts_the_target_on_the_gpu_and_the_draft_on_a_cpu_core():
    config = load_config(ROOT / "deploy" / "one-gpu.yaml")
    assert (config.target.device, config.target.num_gpus, config.target.dtype) == ("cuda", 1.0, "bfloat16")
    assert (config.draft.device, config.draft.num_gpus, config.draft.dtype) == ("cpu", 0.0, "float32")
    assert config.draft.cpus == "auto" and config.speculation.overlap


@pytest.mark.parametrize("data, message", [
    ({"draft": {"replica": 2}}, "draft.replica: unknown key"),
    ({"target": {"tensor_parallel_size": 0}}, "target.tensor_parallel_size:"),
    ({"router": {"port": "x"}}, "router.port: must be int"),
    ({"router": {"admin_port": 70000}}, "router.admin_port: must be a port number"),
    ({"router": {"port": 50060, "admin_port": 50060}}, "router.admin_port: 50060 is router.port too"),
    ({"speculation": {"draft_sampling": "beam"}}, "speculation.draft_sampling:"),
    ({"speculation": {"k": -1}}, "speculation.k:"),
    ({"speculation": {"overlap_branch_guesses": 3}}, "speculation.overlap_branch_guesses: must be 1 or 2"),
    ({"draft": {"dtype": "float8"}}, "draft.dtype:"),
    ({"bogus": {}}, "bogus: unknown key"),
    ({"ray": {"worker_niceness": -5}}, "ray.worker_niceness:"),
])
def test_bad_config_names_the_key(data, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        config_from_dict(data)
