"""Shared fixtures: tiny model pairs built offline, a local Ray instance, and running services."""
from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks.service import LoopThread  # noqa: E402
from protos.specpool.v1 import generation_pb2_grpc  # noqa: E402
from settings.schema import RayConfig, config_from_dict  # noqa: E402

ALPHABET = "abcdefgh"
_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the test process here, with pytest's own exit status, once every fixture (the local Ray instance
    included) is torn down and the summary printed, instead of running the interpreter's teardown: there
    grpcio's C core aborts now and then ("Mutex corrupt: both reader and writer lock held", seen in a fresh-clone
    `.ci/run` after all 359 tests had passed), a known hazard of gRPC threads in a process that Ray forked
    from. A test's failure still fails the run; specpool's own shutdown is tested in subprocesses
    (test_shutdown, test_serve_lifecycle), which this does not touch."""
    if _EXIT_STATUS:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])


@pytest.fixture(scope="session")
def byte_pair(tmp_path_factory):
    """A byte-level random-init pair (vocab 257)."""
    from engine.model_pair import PairSpec, ensure_pair
    draft, target = ensure_pair(tmp_path_factory.mktemp("pairs") / "bytes", PairSpec(seed=3, target_hidden=128))
    return str(draft), str(target)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """A pair over a 9-token vocabulary with peaked, different distributions: cheap to test exactly."""
    from engine.model_pair import PairSpec, ensure_pair
    spec = PairSpec(alphabet=ALPHABET, seed=5, init_std=0.3, target_hidden=64, target_layers=2)
    draft, target = ensure_pair(tmp_path_factory.mktemp("pairs") / "tiny", spec)
    return str(draft), str(target)


def pair_engines(pair: tuple[str, str], device: str = "cpu") -> tuple:
    """(DraftEngine, TargetEngine, the target alone as a transformers model) of a pair, in this process."""
    from transformers import AutoModelForCausalLM
    from draft_worker.proposer import DraftEngine
    from target_worker.verifier import TargetEngine
    draft, target = pair
    return (DraftEngine(draft, device=device), TargetEngine(target, draft, device=device),
            AutoModelForCausalLM.from_pretrained(target).to(device).eval())


@pytest.fixture(scope="module")
def byte_engines(byte_pair):
    return pair_engines(byte_pair)


@pytest.fixture(scope="module")
def tiny_engines(tiny_pair):
    return pair_engines(tiny_pair)


@pytest.fixture(scope="session")
def family_models(tmp_path_factory):
    """Tiny random models of the families users bring (tests/model_families.py): name -> (draft, target)."""
    from tests.model_families import FAMILIES, build_family
    root = tmp_path_factory.mktemp("families")
    return {name: build_family(name, root / name) for name in FAMILIES}


RAY_POOLS = {"CPU": 32, "draft_pool": 16, "target_pool": 32}     # the local instance's resources


def ray_module(item) -> str:
    """The file of a test item whose fixtures reach the local Ray instance ('' if they do not)."""
    return item.nodeid.split("::")[0] if "ray_local" in getattr(item, "fixturenames", ()) else ""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session):
    """Run the modules that use the local Ray instance last and together (a stable sort: each keeps its order), so
    that one instance serves them all instead of one per module (its start and stop took 7-8 s each time), and no
    Ray of ours runs beside the modules that start their own (ray up, node loss, `specpool serve`). Here, after
    every plugin's reordering (--ff, --nf), so that none of them can put a module beside the shared instance."""
    modules = {ray_module(item) for item in session.items} - {""}
    session.items.sort(key=lambda item: item.nodeid.split("::")[0] in modules)


@pytest.fixture(scope="session")
def _ray_instance():
    """The local Ray instance the Ray modules share (started on first use, stopped at the end)."""
    import ray
    environ = dict(os.environ)
    from router.launch import LOCAL_SYSTEM_CONFIG, init_local
    kwargs = dict(address="local", num_cpus=RAY_POOLS["CPU"], include_dashboard=False, namespace="specpool-tests",
                  resources={name: RAY_POOLS[name] for name in ("draft_pool", "target_pool")},
                  _node_ip_address="127.0.0.1", log_to_driver=False, _system_config=LOCAL_SYSTEM_CONFIG)
    for attempt in range(3):      # Ray's processes can start too slowly on a loaded 2-core machine (seen in CI:
        try:                      # GCS deadline exceeded twice in a row for one module): up to twice more
            init_local(RayConfig().worker_niceness, **kwargs)       # as `specpool serve` starts it
            break
        except Exception:  # noqa: BLE001
            ray.shutdown()
            if attempt == 2:
                raise
            time.sleep(5)
    yield ray
    ray.shutdown()
    os.environ.clear()
    os.environ.update(environ)      # ray.init sets RAY_* variables that must not leak into later tests


def held_resources(ray) -> dict[str, float]:
    """How much of each of the local instance's resources is taken now."""
    available = ray.available_resources()
    return {name: total - available.get(name, 0) for name, total in RAY_POOLS.items()}


@pytest.fixture(scope="module")
def ray_local(_ray_instance):
    """The shared local Ray instance, for one test module. After the module every resource it took must be free
    again (its services stopped, its actors and placement groups gone), or the next module would start on what
    this one left: that fails here, naming what is still held."""
    yield _ray_instance
    deadline = time.monotonic() + 60
    while any((held := held_resources(_ray_instance)).values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(held.values()), f"this module left Ray resources held: {held}"


def service_config(pair, **overrides) -> dict:
    draft, target = pair
    config = {
        "router": {"host": "127.0.0.1", "port": 0, "admin_port": 0, "worker_timeout_s": 60.0},
        "ray": {"node_ip": "127.0.0.1"},
        "draft": {"model": draft, "resources": {"draft_pool": 1}, "num_threads": 1},
        "target": {"model": target, "resources": {"target_pool": 1}, "num_threads": 1},
        "speculation": {"k": 3},
    }
    for section, values in overrides.items():
        config.setdefault(section, {}).update(values)
    return config


class RunningService:
    """A specpool Service on its own event loop thread, as `specpool serve` runs it; by default it is returned once
    its draft replicas have loaded too (`specpool serve` serves while they load)."""

    def __init__(self, config: dict, drafts_loaded: bool = True):
        from router.service import Service
        self.background = LoopThread()
        self.service = self._run(Service(config_from_dict(config)).start())
        if drafts_loaded:
            try:
                self._run(self.service.drafts_loaded())
            except BaseException:
                self.background.run(self.service.stop(grace=0), 60)   # nothing of it left on the shared instance
                self.background.close()
                raise
        self.address = f"127.0.0.1:{self.service.port}"
        self.admin_address = f"127.0.0.1:{self.service.admin_port}"     # Admin (reload, status): a port of its own
        self.channel = grpc.insecure_channel(self.address)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    def _run(self, coro, timeout=600):
        return self.background.run(coro, timeout)

    def reload_draft_method(self, method: str) -> None:
        """Hot-reload the running config with draft.method = `method` (as Admin.Reload would)."""
        self.reload(draft={"method": method})

    def reload(self, **sections) -> dict:
        """Hot-reload the running config with these keys changed (section -> {key: value}), as Admin.Reload
        would; returns what they were, for a test to put back."""
        router = self.service.router
        data = dataclasses.asdict(router.config)
        before = {section: {key: data[section][key] for key in values} for section, values in sections.items()}
        for section, values in sections.items():
            data[section].update(values)
        self._run(router.reload(data))
        return before

    def stop(self):
        self.channel.close()
        self._run(self.service.stop(grace=1.0))
        self.background.close()


@pytest.fixture(scope="module")
def start_service(ray_local):
    """Start services for one test module; they stop (and free their Ray resources) after it."""
    running = []

    def start(config: dict, drafts_loaded: bool = True) -> RunningService:
        service = RunningService(config, drafts_loaded)
        running.append(service)
        return service
    yield start
    failed = []
    for service in running:          # each stopped whatever the others do: none left on the shared instance
        try:
            service.stop()
        except Exception as exc:  # noqa: BLE001 - raised below, once every service is stopped
            failed.append(exc)
    if failed:
        raise failed[0]


@pytest.fixture(scope="session")
def reference_generate(byte_pair):
    """Greedy transformers generate() of the target alone, cached per (prompt, length)."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(byte_pair[1]).eval()
    cache = {}

    def generate(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in cache:
            out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False)
            tokens = out[0, len(prompt_ids):].tolist()
            eos = model.generation_config.eos_token_id
            cache[key] = tokens[:tokens.index(eos) + 1] if eos in tokens else tokens
        return cache[key]
    return generate


@pytest.fixture(scope="module")
def demo_engines():
    """(DraftEngine, TargetEngine) of the committed demo pair, in this process (no Ray, no gRPC)."""
    from draft_worker.proposer import DraftEngine
    from target_worker.verifier import TargetEngine
    models = Path(__file__).resolve().parent.parent / "deploy" / "models" / "demo-pair"
    return DraftEngine(str(models / "draft")), TargetEngine(str(models / "target"), str(models / "draft"))


@pytest.fixture
def ray_tmp():
    """A Ray temp dir (RAY_TMPDIR) for one `specpool serve` process: every process its Ray instance starts
    names it on its command line, so they can be found afterwards."""
    path = tempfile.mkdtemp(prefix="sp-", dir="/tmp")     # short: Ray's socket paths must fit in 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


def processes_under(path: str) -> list[str]:
    """Command lines of the processes that name `path` (Ray's session dir is on all of theirs)."""
    import psutil
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if path in cmdline:
            found.append(cmdline[:160])
    return found


def wait_gone(path: str, timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := processes_under(path)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left
