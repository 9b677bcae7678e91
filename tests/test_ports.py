"""The router's ports: a busy one (router.metrics_port, router.admin_port, router.port) fails the start at once, in
one line naming the key and the port, before Ray starts (so nothing is left behind: Ray is made to fail the test if
it is reached); Admin answers on the public port only at router.admin_port -1."""
import gc
import socket

import pytest
import yaml

from router import cli, launch


def serve_with_a_busy_port(key: str, tmp_path, monkeypatch, capfd) -> tuple[int, str]:
    """`specpool serve` of a config whose `key` ("router.port", "http.port") is a port held by a listening socket:
    (the port, stderr), after checking that serve exited 1 without reaching Ray."""
    def no_ray(config, quiet=False):
        raise AssertionError(f"Ray was started before {key} was bound")
    monkeypatch.setattr(launch, "connect", no_ray)
    section, name = key.split(".")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        data = {"router": {"host": "127.0.0.1", "port": 0, "admin_port": 0}, "http": {"port": -1}}
        data[section][name] = port
        path = tmp_path / "specpool.yaml"
        path.write_text(yaml.safe_dump(data))
        assert cli.main(["serve", "--config", str(path)]) == 1
    gc.collect()                                    # a server left running would complain here, its loop closed
    return port, capfd.readouterr().err.strip()      # capfd: gRPC's core writes to the file descriptor


def test_a_busy_metrics_port_fails_at_once_naming_the_key_and_the_port(tmp_path, monkeypatch, capfd):
    """router.metrics_port is bound with the public ports, before Ray starts: a busy one fails the start at once
    (it failed after Ray had started and the pools had loaded, with 'OSError: [Errno 98] Address already in use',
    and left Ray's agents running)."""
    port, err = serve_with_a_busy_port("router.metrics_port", tmp_path, monkeypatch, capfd)
    assert err == (f"specpool: could not start: MetricsPortBusy: router.metrics_port = {port}: cannot listen "
                   f"on 127.0.0.1:{port}: Address already in use")


@pytest.mark.parametrize("key, error", [("router.admin_port", "PortBusy"), ("router.port", "PortBusy"),
                                        ("http.port", "OSError")])
def test_a_busy_grpc_or_http_port_fails_at_once_naming_the_key_and_the_port(key, error, tmp_path, monkeypatch,
                                                                            capfd):
    """router.admin_port, router.port and http.port: a busy one is named in one line and nothing else, before Ray
    starts (router.port's said 'RuntimeError: Failed to bind to address ...; set GRPC_VERBOSITY=debug environment
    variable to see detailed error message', http.port's 'HTTP server did not start on ... (port in use?)', naming
    no key; later the gRPC ports' line came after one of gRPC's core, 'E1126 ... add_port.cc:83] Failed to add port
    to server')."""
    port, err = serve_with_a_busy_port(key, tmp_path, monkeypatch, capfd)
    assert err == (f"specpool: could not start: {error}: {key} = {port}: cannot listen on "
                                    f"127.0.0.1:{port} (in use, not allowed, or not an address of this host)")


@pytest.mark.parametrize("with_admin", [True, False])
def test_admin_is_on_the_public_port_only_at_admin_port_minus_one(with_admin):
    """router.admin_port -1 (`with_admin`) serves Admin beside Generation, as `specpool demo` and the benchmarks
    run; any other value leaves it off the public port (UNIMPLEMENTED there), on a port of its own."""
    import asyncio

    import grpc

    from protos.specpool.v1 import admin_pb2, admin_pb2_grpc
    from router.server import start_admin_server, start_public_server

    async def status_codes() -> list:
        server, port, servicer, _ = await start_public_server("127.0.0.1", 0, with_admin=with_admin)
        admin, admin_port = await start_admin_server(servicer, "127.0.0.1", 0)
        codes = []
        try:
            for bound in (port, admin_port):
                async with grpc.aio.insecure_channel(f"127.0.0.1:{bound}") as channel:
                    try:
                        await admin_pb2_grpc.AdminStub(channel).GetStatus(admin_pb2.GetStatusRequest(), timeout=10)
                    except grpc.aio.AioRpcError as exc:
                        codes.append(exc.code())
        finally:
            await asyncio.gather(server.stop(0), admin.stop(0))
        return codes
    loading = grpc.StatusCode.UNAVAILABLE              # Admin is there: no router attached yet ("still loading")
    assert asyncio.run(status_codes()) == [loading if with_admin else grpc.StatusCode.UNIMPLEMENTED, loading]


@pytest.mark.parametrize("host, bound, dialled", [
    ("127.0.0.1", "127.0.0.1:5", "127.0.0.1:5"), ("router.internal", "router.internal:5", "router.internal:5"),
    ("::1", "[::1]:5", "[::1]:5"), ("[::1]", "[::1]:5", "[::1]:5"),
    ("0.0.0.0", "0.0.0.0:5", "127.0.0.1:5"), ("::", "[::]:5", "127.0.0.1:5"), ("[::]", "[::]:5", "127.0.0.1:5")])
def test_addresses_bracket_ipv6_and_a_client_dials_a_wildcard_on_loopback(host, bound, dialled):
    """router.host / admin_host as gRPC reads them: `::1:50052` did not parse, so an IPv6 admin host could neither
    bind nor be dialled; `[::]`, which binds every interface, was dialled as itself."""
    from router.addresses import dial, host_port
    assert (host_port(host, 5), dial(host, 5)) == (bound, dialled)


@pytest.mark.parametrize("data, refused", [
    ({"router": {"port": 8000}, "http": {"port": 8000}}, "http.port: 8000 is router.port too (serve --http-port"),
    ({"router": {"admin_port": 8000}, "http": {"port": 8000}}, "http.port: 8000 is router.admin_port too"),
    ({"router": {"metrics_port": 50051}}, "router.metrics_port: 50051 is router.port too (-1 turns"),
    ({"router": {"host": "0.0.0.0", "admin_host": "127.0.0.1", "admin_port": 50051}},
     "router.admin_port: 50051 is router.port too"),
    ({"router": {"admin_host": "127.0.0.2", "admin_port": 50051}}, None),     # another interface: no clash
    ({"router": {"port": 0, "admin_port": 0, "metrics_port": 0}, "http": {"port": 0}}, None),   # any free ones
])
def test_two_listeners_on_one_port_are_a_config_error_naming_both(data, refused):
    """router.port, router.admin_port, router.metrics_port and http.port: a clash on one host is refused at load
    (the second listener failed only after the first had bound, as 'HTTP server did not start ... (port in
    use?)', on serve's own port)."""
    from settings.schema import ConfigError, config_from_dict
    if refused is None:
        config_from_dict(data)
        return
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    assert str(info.value).startswith(refused), info.value


def test_a_call_before_the_pools_have_loaded_says_for_how_long_and_the_bound():
    """Generate, Admin and the HTTP API answer UNAVAILABLE / 503 while the pools load, saying for how long they have
    been loading and router.ready_timeout_s (a big model's first load can take most of an hour; the message said
    only 'still loading')."""
    import asyncio

    import grpc
    import httpx

    from openai_api.app import create_app
    from protos.specpool.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc
    from router.server import start_public_server
    from settings.schema import HttpConfig
    said = ("specpool is still loading its worker pools (42 s so far of router.ready_timeout_s = 600 s; serve's log "
            "shows each worker's progress)")

    async def answers() -> list:
        server, port, servicer, _ = await start_public_server("127.0.0.1", 0, with_admin=True)
        servicer._since, servicer._clock, servicer.ready_timeout_s = 0.0, lambda: 42.2, 600.0
        details = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                for call in (generation_pb2_grpc.GenerationStub(channel).Generate(
                        generation_pb2.GenerateRequest(prompt="x", max_new_tokens=1), timeout=10),
                             admin_pb2_grpc.AdminStub(channel).GetStatus(admin_pb2.GetStatusRequest(), timeout=10)):
                    try:
                        await call
                    except grpc.aio.AioRpcError as exc:
                        details.append((exc.code(), exc.details()))
            app = create_app(HttpConfig(), lambda: servicer.router, servicer.loading_message)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as client:
                response = await client.get("/v1/models")
                details.append((response.status_code, response.json()["error"]["message"]))
        finally:
            await server.stop(0)
        return details
    assert asyncio.run(answers()) == [(grpc.StatusCode.UNAVAILABLE, said)] * 2 + [(503, said)]


def test_a_tensor_parallel_rendezvous_port_stays_bound_until_the_group_forms():
    """Rank 0's rendezvous binds the group's store and holds it: another process cannot take the port before the
    ranks join (a port chosen by binding and closing a socket was taken in CI by another test's group, and that
    group's start failed with 'EADDRINUSE'). A rank joins it by (host, port)."""
    import torch.distributed as dist

    from target_worker.tensor_parallel import host_store

    store = host_store("127.0.0.1")
    with socket.socket() as other, pytest.raises(OSError, match="in use"):
        other.bind(("127.0.0.1", store.port))
    joined = dist.TCPStore("127.0.0.1", store.port, is_master=False)
    joined.set("rank1", "ready")
    assert store.get("rank1") == b"ready"
