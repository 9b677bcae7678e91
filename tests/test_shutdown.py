"""SIGTERM to `specpool serve`: health goes NOT_SERVING, the in-flight request finishes, new ones are
refused, and the process exits soon after, with every process its Ray instance started."""
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.specpool.v1 import generation_pb2, generation_pb2_grpc
from tests.conftest import service_config, wait_gone


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def health(channel) -> int:
    try:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
    except grpc.RpcError:
        return -1


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def start_serve(path, log_path, channel, ray_tmp: str, attempts: int = 2, own_group: bool = False) -> subprocess.Popen:
    """`specpool serve` in its own process, once health says SERVING. A serve that dies while its
    local Ray instance starts (seen on an overloaded 2-core machine) is started once more."""
    env = {**os.environ, "RAY_ADDRESS": "", "RAY_TMPDIR": ray_tmp, "RAY_gcs_server_port_wait_time_s": "120"}
    for attempt in range(attempts):
        with open(log_path, "w") as log:
            server = subprocess.Popen([sys.executable, "-m", "router.cli", "serve", "--config", str(path)],
                                      env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=own_group)
        if wait_for(lambda: server.poll() is not None or health(channel) == health_pb2.HealthCheckResponse.SERVING,
                    240) and server.poll() is None:
            return server
        server.kill()
        server.wait()
    raise AssertionError(f"serve never became SERVING:\n{log_path.read_text()[-3000:]}")


def test_sigterm_drains_in_flight_requests(tmp_path, byte_pair, reference_generate, ray_tmp):
    """... and exits soon after its last request, leaving no process it started (Ray's agents included)."""
    port = free_port()
    config = service_config(byte_pair, router={"port": port, "shutdown_grace_s": 60.0},
                            ray={"node_ip": "127.0.0.1", "num_cpus": 8,
                                 "resources": {"draft_pool": 2, "target_pool": 2}})
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.initial_reconnect_backoff_ms", 200),
                                                                  ("grpc.max_reconnect_backoff_ms", 1000)])
    server = start_serve(path, tmp_path / "serve.log", channel, ray_tmp)
    try:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = generation_pb2.GenerateRequest(prompt_token_ids=[3, 1, 4, 1, 5], max_new_tokens=400)
        request.speculation.k = 1
        chunks, first = [], threading.Event()

        def consume():
            for chunk in stub.GenerateStream(request, timeout=120):
                chunks.append(chunk)
                first.set()
        reader = threading.Thread(target=consume)
        reader.start()
        assert first.wait(60)
        server.send_signal(signal.SIGTERM)
        assert wait_for(lambda: health(channel) != health_pb2.HealthCheckResponse.SERVING, 10)
        late = generation_pb2.GenerateRequest(prompt_token_ids=[3], max_new_tokens=2)
        try:
            stub.Generate(late, timeout=10)
            refused = None
        except grpc.RpcError as exc:
            refused = exc.code()
        assert refused in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)   # refused, not served
        reader.join(120)
        finished = time.monotonic()
        assert server.wait(60) == 0
        exited = time.monotonic()
        assert wait_gone(ray_tmp, 10) == [], "processes serve started outlived it by 10 s"
        print(f"serve exited {exited - finished:.2f}s after its last request; its processes "
              f"{time.monotonic() - finished:.2f}s after")
        # Measured here: 2.0 s (it was 13.2 s, in Ray's driver shutdown at exit). A bound far above the
        # measure, for a loaded machine; the old 13 s fails it.
        assert exited - finished < 10, f"serve took {exited - finished:.1f}s to exit after its last request"
        assert [t for c in chunks for t in c.token_ids] == reference_generate([3, 1, 4, 1, 5], 400)
        assert chunks[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH
        assert "SIGTERM handler is not set" not in (tmp_path / "serve.log").read_text()   # it is: serve drains
    finally:
        channel.close()
        if server.poll() is None:
            server.kill()
            server.wait()


def test_sigterm_to_the_whole_process_group_does_not_hang(tmp_path, byte_pair, ray_tmp):
    """systemd (KillMode=control-group), `timeout` and `kill -- -PGID` signal serve's Ray processes too. Ray's
    agents die at once, and every later call into Ray blocked for good: serve never exited. Now it ends them by
    PID and exits."""
    port = free_port()
    config = service_config(byte_pair, router={"port": port},
                            ray={"node_ip": "127.0.0.1", "num_cpus": 8,
                                 "resources": {"draft_pool": 2, "target_pool": 2}})
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    server = start_serve(path, tmp_path / "serve.log", channel, ray_tmp, own_group=True)
    try:
        signalled = time.monotonic()
        os.killpg(server.pid, signal.SIGTERM)
        assert server.wait(60) == 0, (tmp_path / "serve.log").read_text()[-2000:]
        assert wait_gone(ray_tmp, 10) == [], "processes serve started outlived it by 10 s"
        print(f"serve exited {time.monotonic() - signalled:.1f}s after its process group's SIGTERM")
    finally:
        channel.close()
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def test_sigterm_while_serve_starts_stops_it_and_everything_its_ray_started(tmp_path, byte_pair, ray_tmp):
    """A SIGTERM while Ray comes up (before serve is SERVING) killed serve outright (no handler was in place yet;
    Ray's printed 'SIGTERM received'), leaving Ray's agents and workers running. Now it cancels the start, which
    stops what had started: exit status 0, no process left."""
    from tests.conftest import processes_under

    config = service_config(byte_pair, router={"port": free_port()},
                            ray={"node_ip": "127.0.0.1", "num_cpus": 8,
                                 "resources": {"draft_pool": 2, "target_pool": 2}})
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "RAY_ADDRESS": "", "RAY_TMPDIR": ray_tmp, "RAY_gcs_server_port_wait_time_s": "120"}
    with open(tmp_path / "serve.log", "w") as log:
        server = subprocess.Popen([sys.executable, "-m", "router.cli", "serve", "--config", str(path)],
                                  env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        assert wait_for(lambda: processes_under(ray_tmp), 120), "Ray never started"
        server.send_signal(signal.SIGTERM)
        status = server.wait(90)
        output = (tmp_path / "serve.log").read_text()
        assert status == 0 and "stopped while starting" in output, output[-3000:]
        assert wait_gone(ray_tmp, 10) == [], "processes serve started outlived it by 10 s"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
