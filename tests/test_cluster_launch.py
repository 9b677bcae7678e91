"""The cluster files.

- deploy/cluster.yaml (AWS) passes Ray's own cluster-config schema, checked offline.
- Every pool of deploy/serve-cluster.yaml fits a node type of deploy/cluster.yaml.
- A real `ray up` (slow): deploy/cluster-local.yaml.in filled in for Ray's `local` provider, whose
  head is this machine over SSH on 127.0.0.1, then `specpool serve` joined to that cluster answers a
  greedy request token-identical to transformers generate() of the target alone, then `ray down`.

The slow test runs its own sshd (port, host key, authorized keys, pid file all in a temp dir, so
~/.ssh is never touched) and reaches it through the cluster file's ssh_proxy_command. Its SSH
sessions get their own HOME and a PATH whose `ray` is the project's venv's, except that
`ray stop` (which `ray down` runs on the head) stops only this cluster's processes: a plain
`ray stop` would stop every Ray instance on the machine. Everything it starts is stopped by PID.
It takes about a minute; `pytest -k "not slow"` leaves it out.
"""
from __future__ import annotations

import getpass
import hashlib
import inspect
import json
import math
import os
import shutil
import signal
import socket
import string
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CLUSTER_FILE = REPO / "deploy" / "cluster.yaml"
SERVE_CLUSTER_FILE = REPO / "deploy" / "serve-cluster.yaml"
LOCAL_TEMPLATE = REPO / "deploy" / "cluster-local.yaml.in"
VENV_BIN = Path(sys.executable).parent
SSHD = "/usr/sbin/sshd"


def prepared(config: dict) -> dict:
    """Ray's own preparation (defaults merged, per-type worker bounds filled), then its schema."""
    from ray.autoscaler._private.util import prepare_config, validate_config
    config = prepare_config(config)
    validate_config(config)
    return config


@pytest.fixture
def no_network(monkeypatch):
    """Any connection attempt (AWS API, instance metadata) fails the test instead of happening."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access during an offline check: {args!r}")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture(scope="module")
def cluster():
    return yaml.safe_load(CLUSTER_FILE.read_text())


# ---------------------------------------------------------------- the AWS cluster file, offline

def test_cluster_yaml_passes_ray_schema(cluster, no_network):
    config = prepared(cluster)
    assert config["provider"]["type"] == "aws"
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"].get("GPU") == 0 and head["max_workers"] == 0
    assert {"draft_gpu", "target_gpu"}.isdisjoint(head["resources"])

    draft = types["draft_a10g"]
    assert draft["node_config"]["InstanceType"] == "g5.xlarge" and draft["min_workers"] >= 1
    assert draft["resources"]["draft_gpu"] == draft["resources"]["GPU"] == 1
    target = types["target_a100"]
    assert target["node_config"]["InstanceType"] == "p4d.24xlarge"
    assert target["resources"]["target_gpu"] == target["resources"]["GPU"] == 8

    # Pinned installs, torch before the project; the serve config is mounted on the head.
    setup = config["head_setup_commands"]
    torch_at = next(i for i, c in enumerate(setup) if "torch==2.13.0" in c)
    ray_at = next(i for i, c in enumerate(setup) if "ray[default]==2.60.0" in c)
    project_at = next(i for i, c in enumerate(setup) if "pip install" in c and "-e ~/specpool" in c)
    assert torch_at < project_at and ray_at < project_at
    assert config["worker_setup_commands"][:len(cluster["setup_commands"])] == cluster["setup_commands"]
    mounts = config["file_mounts"]
    assert mounts["~/serve-cluster.yaml"] == "deploy/serve-cluster.yaml"
    assert all((REPO / local).exists() for local in mounts.values())
    assert any("--autoscaling-config=~/ray_bootstrap_config.yaml" in c for c in config["head_start_ray_commands"])


# ---------------------------------------------------------------- pools vs node types

def replica_demand(pool, ranks: int) -> dict:
    """What one replica asks of the single node it lands on (the target's ranks are STRICT_PACK)."""
    demand = {"CPU": pool.num_cpus * ranks, "GPU": pool.num_gpus * ranks}
    for name, amount in pool.resources.items():
        demand[name] = demand.get(name, 0) + amount * ranks
    return {name: amount for name, amount in demand.items() if amount}


def replicas_per_node(node_resources: dict, demand: dict) -> int:
    fits = []
    for name, amount in demand.items():
        if name == "CPU" and name not in node_resources:
            continue                                   # CPU count auto-detected from the instance
        fits.append(math.floor(node_resources.get(name, 0) / amount))
    return min(fits) if fits else 0


def test_serve_cluster_pools_fit_node_types(cluster):
    from settings.schema import load_config
    serve = load_config(SERVE_CLUSTER_FILE)
    assert serve.ray.address == "auto"
    config = prepared(cluster)
    types, head_type = config["available_node_types"], config["head_node_type"]
    homes = {}
    for name, pool, ranks in (("draft", serve.draft, 1),
                              ("target", serve.target, serve.target.tensor_parallel_size)):
        assert pool.device.startswith("cuda") and pool.num_gpus >= 1, name
        assert pool.resources, f"{name}: no custom resource steers the pool to its node type"
        demand = replica_demand(pool, ranks)
        capacity = {node_type: replicas_per_node(spec["resources"], demand) for node_type, spec in types.items()}
        hosts = [node_type for node_type, fit in capacity.items() if fit]
        assert hosts, f"{name}: no node type provides {demand} on one node"
        assert head_type not in hosts, f"{name}: would be placed on the head"
        most = sum(capacity[t] * (1 if t == head_type else types[t]["max_workers"]) for t in hosts)
        assert pool.replicas <= most, f"{name}: {pool.replicas} replicas, room for {most}"
        assert all(types[t]["min_workers"] >= 1 for t in hosts), f"{name}: its node type may scale to zero"
        homes[name] = set(hosts)
    assert homes["draft"].isdisjoint(homes["target"])
    # The target at TP=8 takes one whole p4d.24xlarge per replica.
    assert homes["target"] == {"target_a100"} and serve.target.tensor_parallel_size in (4, 8)


# ---------------------------------------------------------------- a real `ray up`, local provider

def kill_matching(markers, exclude=()):
    """Stop, by PID, every process whose command line contains one of `markers`, and their
    descendants (Ray workers retitle themselves `ray::...`, so they are found as the raylet's
    children). Never this process or its ancestors. Returns how many were stopped."""
    import psutil
    me = psutil.Process()
    spared = {me.pid, *(p.pid for p in me.parents()), *exclude}
    found = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.pid in spared or not any(m in arg for arg in proc.info["cmdline"] or () for m in markers):
                continue
            found[proc.pid] = proc
            for child in proc.children(recursive=True):
                found.setdefault(child.pid, child)
        except psutil.Error:
            pass
    procs = [p for pid, p in found.items() if pid not in spared]
    for proc in procs:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=5)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)
    return len(procs)


def running_with(marker: str) -> list[int]:
    import psutil
    pids = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if any(marker in arg for arg in proc.info["cmdline"] or ()):
            pids.append(proc.pid)
    return pids


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def ensure_ssh_tools() -> None:
    """sshd, ssh and rsync, or a skip naming what is missing (`make test` installs them first where it can:
    tools/ssh_tools.sh, with root or passwordless sudo, never enabling a service)."""
    missing = [tool for tool, path in (("sshd", SSHD), ("ssh", shutil.which("ssh")), ("rsync", shutil.which("rsync")),
                                       ("ssh-keygen", shutil.which("ssh-keygen")))
               if not path or not os.access(path, os.X_OK)]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}: run tools/ssh_tools.sh as root or with passwordless sudo "
                    "(apt-get install openssh-server rsync)")


PROXY = '''\
"""ssh ProxyCommand: relay stdin/stdout to the test's sshd on 127.0.0.1:PORT."""
import os, socket, sys, threading
conn = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
def upstream():
    while data := os.read(0, 65536):
        conn.sendall(data)
    conn.shutdown(socket.SHUT_WR)
threading.Thread(target=upstream, daemon=True).start()
while data := conn.recv(65536):
    os.write(1, data)
'''

SESSION = '''\
#!/bin/sh
# ForceCommand of the test's sshd: each SSH session of the test cluster runs in its own HOME.
export HOME={home}
cd "$HOME" || exit 1
[ -n "$SSH_ORIGINAL_COMMAND" ] || exec /bin/bash --login
exec /bin/bash -c "$SSH_ORIGINAL_COMMAND"
'''

BASHRC = '''\
export PATH={guard}:{venv_bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export TMPDIR={tmp} SPECPOOL_CACHE={cache} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export RAY_USAGE_STATS_ENABLED=0 GRPC_VERBOSITY=ERROR TOKENIZERS_PARALLELISM=false
'''

GUARD = '''\
#!{python}
"""`ray` in the test cluster's SSH sessions: the venv's ray, except that `ray stop` (run by
`ray down`) stops only this cluster's processes instead of every Ray instance on the machine."""
import os, sys
if sys.argv[1:2] != ["stop"]:
    os.execv({ray!r}, [{ray!r}, *sys.argv[1:]])
{kill_matching}
print(f"stopped {{kill_matching([{marker!r}])}} processes of this cluster ({marker})")
'''

SSHD_CONFIG = '''\
Port {port}
ListenAddress 127.0.0.1
HostKey {dir}/ssh_host_ed25519_key
PidFile {dir}/sshd.pid
AuthorizedKeysFile {dir}/authorized_keys
AllowUsers {user}
ForceCommand {dir}/session.sh
StrictModes no
UsePAM no
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
PermitRootLogin prohibit-password
X11Forwarding no
LogLevel ERROR
'''

NO_PTY_SSH = '''\
#!/bin/sh
# `ssh` for `ray up` and `ray down` when the test's sshd does not run as root: such an sshd cannot give a
# session a pty (it must chown it to the tty group), and Ray's login-shell commands ask for one with
# `ssh -tt`, which then fails. The same command runs without a pty (-T).
for arg; do shift; [ "$arg" = -tt ] && arg=-T; set -- "$@" "$arg"; done
exec {ssh} "$@"
'''


class LocalCluster:
    """The files, sshd and cluster file of one `ray up` on loopback, under one temp dir."""

    def __init__(self):
        # Short path: Ray's AF_UNIX sockets live under the temp dir (108-byte limit).
        self.dir = Path(tempfile.mkdtemp(prefix="sp-", dir="/tmp"))
        self.home, self.guard, self.cache = self.dir / "home", self.dir / "guard", self.dir / "cache"
        self.tmp, self.ray_temp, self.no_pty = self.dir / "tmp", self.dir / "raytmp", self.dir / "no-pty"
        for folder in (self.home, self.guard, self.cache, self.tmp, self.no_pty):
            folder.mkdir()
        self.name = f"specpool-test-{self.dir.name[3:].lower()}"
        self.ssh_port, self.gcs_port, self.client_port, self.agent_port, self.router_port = free_ports(5)
        self.file = self.dir / "cluster.yaml"
        self.sshd: subprocess.Popen | None = None
        self.serve: subprocess.Popen | None = None

    def env(self) -> dict:
        path = f"{VENV_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}"
        if os.geteuid() != 0:
            path = f"{self.no_pty}:{path}"
        env = dict(os.environ, PATH=path,
                   TMPDIR=str(self.tmp), RAY_USAGE_STATS_ENABLED="0", GRPC_VERBOSITY="ERROR")
        env.pop("RAY_ADDRESS", None)
        return env

    def write_files(self) -> None:
        key = self.dir / "id_ed25519"
        for path in (key, self.dir / "ssh_host_ed25519_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", self.name, "-f", str(path)],
                           check=True, capture_output=True)
        shutil.copy(f"{key}.pub", self.dir / "authorized_keys")
        (self.dir / "sshd_config").write_text(SSHD_CONFIG.format(port=self.ssh_port, dir=self.dir,
                                                                 user=getpass.getuser()))
        (self.dir / "proxy.py").write_text(PROXY)
        session = self.dir / "session.sh"
        session.write_text(SESSION.format(home=self.home))
        bashrc = BASHRC.format(guard=self.guard, venv_bin=VENV_BIN, tmp=self.tmp, cache=self.cache)
        (self.home / ".bashrc").write_text(bashrc)
        (self.home / ".bash_profile").write_text(". ~/.bashrc\n")
        guard = self.guard / "ray"
        guard.write_text(GUARD.format(python=sys.executable, ray=str(VENV_BIN / "ray"), marker=str(self.ray_temp),
                                      kill_matching=inspect.getsource(kill_matching)))
        no_pty = self.no_pty / "ssh"
        no_pty.write_text(NO_PTY_SSH.format(ssh=shutil.which("ssh")))
        for script in (session, guard, no_pty):
            script.chmod(0o755)

        serve = yaml.safe_load((REPO / "deploy" / "local.yaml").read_text())
        for pool in ("draft", "target"):          # the pair the head builds offline (the demo pair is not synced)
            serve[pool]["model"] = f"builtin:random-pair/{pool}"
        serve["router"].update(host="127.0.0.1", port=self.router_port, admin_port=-1, ready_timeout_s=150.0)
        serve["ray"] = {"address": f"127.0.0.1:{self.gcs_port}", "namespace": "specpool-cluster-test"}
        (self.dir / "serve.yaml").write_text(yaml.safe_dump(serve, sort_keys=False))

        proxy = f"{sys.executable} {self.dir / 'proxy.py'} {self.ssh_port}"
        self.file.write_text(string.Template(LOCAL_TEMPLATE.read_text()).substitute(
            cluster_name=self.name, ssh_user=getpass.getuser(), ssh_private_key=str(key),
            ssh_proxy_command=proxy, serve_config=str(self.dir / "serve.yaml"), gcs_port=self.gcs_port,
            client_port=self.client_port, agent_port=self.agent_port, temp_dir=str(self.ray_temp)))

    def start_sshd(self) -> None:
        try:
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)   # sshd's privilege-separation dir
        except PermissionError:
            pytest.skip("sshd needs /run/sshd, which this user cannot create")
        log = open(self.dir / "sshd.log", "w")
        self.sshd = subprocess.Popen([SSHD, "-D", "-e", "-f", str(self.dir / "sshd_config")],
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            assert self.sshd.poll() is None, (self.dir / "sshd.log").read_text()
            try:
                socket.create_connection(("127.0.0.1", self.ssh_port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.2)
        raise AssertionError("sshd did not listen within 20 s")

    def ray(self, *args: str, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run([str(VENV_BIN / "ray"), *args], env=self.env(), cwd=self.dir,
                              capture_output=True, text=True, timeout=timeout)

    def start_serve(self) -> None:
        env = dict(self.env(), RAY_ADDRESS=f"127.0.0.1:{self.gcs_port}", SPECPOOL_CACHE=str(self.cache),
                   HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        self.serve_log = open(self.dir / "serve.log", "w")
        # The serve config as `ray up` mounted it on the head (this machine).
        self.serve = subprocess.Popen([str(VENV_BIN / "specpool"), "serve", "--config",
                                       str(self.home / "serve-cluster-local.yaml")],
                                      env=env, cwd=self.dir, stdout=self.serve_log, stderr=subprocess.STDOUT,
                                      start_new_session=True)

    def log(self, name: str) -> str:
        path = self.dir / name
        return path.read_text()[-4000:] if path.exists() else ""

    def stop_serve(self) -> None:
        if self.serve and self.serve.poll() is None:
            self.serve.send_signal(signal.SIGTERM)
            try:
                self.serve.wait(30)
            except subprocess.TimeoutExpired:
                self.serve.kill()
                self.serve.wait(10)

    def cleanup(self) -> None:
        """Whatever is left, by PID: serve, Ray processes of this cluster, ssh masters, sshd."""
        self.stop_serve()
        kill_matching([str(self.ray_temp)])
        pid_file = self.dir / "sshd.pid"
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text().split()[0]), signal.SIGTERM)
            except (ProcessLookupError, ValueError):
                pass
        if self.sshd:
            try:
                self.sshd.wait(10)
            except subprocess.TimeoutExpired:
                self.sshd.kill()
        kill_matching([f"{self.dir}/"])    # sshd sessions, ssh control masters, proxies
        # Ray's per-cluster leftover outside the temp dir: its ssh control-path dir.
        user = hashlib.sha256(getpass.getuser().encode()).hexdigest()[:10]
        shutil.rmtree(f"/tmp/ray_ssh_{user}/{hashlib.sha256(self.name.encode()).hexdigest()[:10]}",
                      ignore_errors=True)
        shutil.rmtree(self.dir, ignore_errors=True)


def test_local_template_passes_ray_schema(no_network):
    text = string.Template(LOCAL_TEMPLATE.read_text()).substitute(
        cluster_name="specpool-test", ssh_user="root", ssh_private_key="/tmp/key",
        ssh_proxy_command="python proxy.py 2222", serve_config="/tmp/serve.yaml", gcs_port=6380,
        client_port=10002, agent_port=52366, temp_dir="/tmp/sp-x/raytmp")
    config = prepared(yaml.safe_load(text))
    (start,) = config["head_start_ray_commands"]
    assert "ray stop" not in start and "--port=6380" in start
    assert '--resources=\'{"draft_pool": 4, "target_pool": 8}\'' in start
    assert not config["setup_commands"] and not config["head_setup_commands"]


def wait_serving(address: str, serve: subprocess.Popen, timeout: float) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            assert serve.poll() is None, f"specpool serve exited with {serve.returncode}"
            try:
                status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(1)
    raise AssertionError(f"not SERVING within {timeout:.0f} s")


def cluster_resources(address: str) -> dict:
    code = textwrap.dedent("""
        import json, ray
        ray.init(address=%r, logging_level="ERROR", log_to_driver=False)
        print(json.dumps(ray.cluster_resources()))
    """ % address)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_slow_ray_up_local_provider_serves_greedy_identical():
    """The slow test of the suite (deselect with -k "not slow"): ray up, specpool serve on the
    cluster, one greedy request, ray down."""
    ensure_ssh_tools()
    cluster = LocalCluster()
    steps = []
    try:
        cluster.write_files()
        cluster.start_sshd()
        up = cluster.ray("up", "-y", "--no-config-cache", "--disable-usage-stats", "--log-color", "false",
                         str(cluster.file), timeout=180)
        steps.append("ray up")
        assert up.returncode == 0, f"ray up failed:\n{up.stdout[-4000:]}\n{up.stderr[-4000:]}"
        assert (cluster.home / "serve-cluster-local.yaml").exists(), "file_mounts did not reach the head"

        address = f"127.0.0.1:{cluster.gcs_port}"
        resources = cluster_resources(address)
        assert resources.get("draft_pool") == 4 and resources.get("target_pool") == 8, resources

        cluster.start_serve()
        router = f"127.0.0.1:{cluster.router_port}"
        wait_serving(router, cluster.serve, timeout=150)
        steps.append("serve")

        import grpc
        import torch
        from transformers import AutoModelForCausalLM
        from protos.specpool.v1 import generation_pb2, generation_pb2_grpc
        prompt, max_new = [72, 101, 108, 108, 111, 44, 32], 20
        request = generation_pb2.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=max_new)
        request.speculation.k = 3
        with grpc.insecure_channel(router) as channel:
            response = generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60)
        model = AutoModelForCausalLM.from_pretrained(cluster.cache / "random-pair" / "target").eval()
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False)
        expected = out[0, len(prompt):].tolist()
        eos = model.generation_config.eos_token_id
        expected = expected[:expected.index(eos) + 1] if eos in expected else expected
        assert list(response.token_ids) == expected
        assert response.stats.draft_tokens > 0 and response.stats.target_passes <= len(expected)

        cluster.stop_serve()
        assert cluster.serve.returncode == 0, cluster.log("serve.log")
        down = cluster.ray("down", "-y", "--log-color", "false", str(cluster.file), timeout=120)
        assert down.returncode == 0, f"ray down failed:\n{down.stdout[-4000:]}\n{down.stderr[-4000:]}"
        assert "processes of this cluster" in down.stdout + down.stderr   # the guarded `ray stop` ran
        assert not running_with(str(cluster.ray_temp)), "Ray processes left after ray down"
    except BaseException:
        print(f"--- after {steps}; sshd.log:\n{cluster.log('sshd.log')}\n--- serve.log:\n{cluster.log('serve.log')}")
        raise
    finally:
        cluster.cleanup()
