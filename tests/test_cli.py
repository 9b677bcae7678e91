"""The CLI as a new user meets it: argument errors are one line naming the option, the admin commands
find the server through --config, serve takes --port / --http-port, the prompt can come from stdin or a
file, and Ctrl-C ends `generate` in one line. (Generating through a running server is in
tests/test_openai_http.py.)"""
import argparse
import io
import os
import queue
import re
import select
import signal
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import yaml

from protos.specpool.v1 import generation_pb2, generation_pb2_grpc
from router import cli
from settings.schema import ConfigError, config_from_dict

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("argv, option", [
    (["generate", "--k", "-1", "x"], "--k"), (["generate", "--seed", "-1", "x"], "--seed"),
    (["generate", "--max-new-tokens", "-5", "x"], "--max-new-tokens"), (["generate", "--top-k", "x", "y"], "--top-k"),
    (["generate", "--seed", str(2 ** 64), "x"], "--seed"), (["serve", "--config", "c", "--port", "-3"], "--port"),
    (["demo", "--max-new-tokens", "0", "x"], "--max-new-tokens"),
    (["status", "--address", "127.0.0.1:99999"], "--address"), (["status", "--address", "127.0.0.1"], "--address"),
    (["reload", "--config", "c", "--address", "::1:50052"], "--address"), (["generate", "--address", "h:x", "y"],
                                                                           "--address"),
])
def test_argument_errors_are_one_line_naming_the_option(argv, option, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and f"argument {option}: must be" in err
    assert "Traceback" not in err


def test_prompt_from_stdin_file_or_argument(tmp_path, monkeypatch):
    parser, commands = cli.build_parser()
    monkeypatch.setattr("sys.stdin", io.StringIO("from stdin("))
    args = parser.parse_args(["generate", "-"])
    cli.read_prompt(commands["generate"], args)
    assert args.prompt == "from stdin("
    (tmp_path / "p.txt").write_text("from a file(")
    args = parser.parse_args(["generate", "--prompt-file", str(tmp_path / "p.txt")])
    cli.read_prompt(commands["generate"], args)
    assert args.prompt == "from a file("
    for argv in (["generate"], ["generate", "x", "--prompt-file", str(tmp_path / "p.txt")],
                 ["generate", "--prompt-file", str(tmp_path / "missing.txt")]):
        with pytest.raises(SystemExit):
            cli.read_prompt(commands["generate"], parser.parse_args(argv))


def test_generate_options_reach_the_request():
    """The sampling options of `specpool generate` become the GenerateRequest's fields (the router validates them)."""
    parser, _ = cli.build_parser()
    args = parser.parse_args(["generate", "x", "--max-new-tokens", "9", "--min-new-tokens", "4", "--min-p", "0.2",
                              "--temperature", "0.7", "--repetition-penalty", "1.1", "--ignore-eos", "--k", "3"])
    request = cli.make_request(args)
    assert (request.max_new_tokens, request.min_new_tokens, request.ignore_eos) == (9, 4, True)
    assert request.speculation.k == 3
    assert request.sampling.min_p == pytest.approx(0.2) and request.sampling.temperature == pytest.approx(0.7)
    assert request.sampling.repetition_penalty == pytest.approx(1.1)
    assert not request.HasField("structured_output")


def test_generate_structure_options_become_the_structured_output(tmp_path):
    parser, _ = cli.build_parser()
    (tmp_path / "point.json").write_text('{"type": "object"}')
    cases = {("--json-schema", str(tmp_path / "point.json")): ("json_schema", '{"type": "object"}'),
             ("--json",): ("json_object", True), ("--regex", "[0-9]+"): ("regex", "[0-9]+"),
             ("--choice", "yes", "--choice", "no"): ("choice", ["yes", "no"])}
    for options, (kind, value) in cases.items():
        structure = cli.make_request(parser.parse_args(["generate", "x", *options])).structured_output
        assert structure.WhichOneof("kind") == kind
        assert (list(structure.choice.options) if kind == "choice" else getattr(structure, kind)) == value
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "x", "--json", "--regex", "a"])
    with pytest.raises(SystemExit, match="cannot read"):
        cli.make_request(parser.parse_args(["generate", "x", "--grammar", str(tmp_path / "missing.lark")]))


def test_admin_address_comes_from_config(tmp_path):
    """reload / status dial Admin where the config puts it: router.admin_host:admin_port (a wildcard host on
    loopback), router.host:port at admin_port -1; --address wins; admin_port 0 cannot be found, and says so."""
    path = tmp_path / "c.yaml"
    parser, _ = cli.build_parser()

    def address(router: dict, *extra: str) -> str:
        path.write_text(yaml.safe_dump({"router": router}))
        return cli.admin_address(parser.parse_args(["status", "--config", str(path), *extra]))
    assert address({"host": "0.0.0.0", "port": 50123}) == "127.0.0.1:50052"
    assert address({"port": 50123, "admin_host": "0.0.0.0", "admin_port": 50124}) == "127.0.0.1:50124"
    assert address({"admin_host": "10.1.2.3", "admin_port": 50124}) == "10.1.2.3:50124"
    assert address({"host": "0.0.0.0", "port": 50123, "admin_port": -1}) == "127.0.0.1:50123"
    assert address({"admin_port": 50124}, "--address", "h:1") == "h:1"
    with pytest.raises(ConfigError, match=r"^router.admin_port is 0 \(any free port\): give --address"):
        address({"admin_port": 0})
    assert cli.admin_address(parser.parse_args(["reload", "--config", str(path), "--address", "h:1"])) == "h:1"
    assert cli.admin_address(parser.parse_args(["status"])) == cli.DEFAULT_ADMIN_ADDRESS == "127.0.0.1:50052"


def served_config(monkeypatch, args, document: dict):
    """The config of the Service that `run_server` would start for `document`."""
    from router.service import Service
    seen = {}

    async def start(config, _, overrides):
        seen["config"] = Service(config, overrides=overrides).config
        return 0
    monkeypatch.setattr(cli, "_serve" if args.command == "serve" else "_demo", start)
    assert cli.run_server(args, config_from_dict(document), cli.server_overrides(args)) == 0
    return seen["config"]


def served_ports(monkeypatch, args) -> tuple[int, int, int]:
    """The (gRPC, HTTP, admin) ports of the Service that `run_server` would start, for a config naming 50051 and
    8000 (and the default admin port, 50052)."""
    config = served_config(monkeypatch, args, {"router": {"port": 50051}, "http": {"port": 8000}})
    return config.router.port, config.http.port, config.router.admin_port


def test_serve_ports_override_the_config(monkeypatch):
    """--port / --http-port reach the Service as overrides, which it applies over the file (and its Router over
    every reloaded file: tests/test_e2e_admin.py)."""
    def serve(port, http_port, admin_port=None):
        return argparse.Namespace(command="serve", config="c.yaml", port=port, http_port=http_port,
                                  admin_port=admin_port)
    assert served_ports(monkeypatch, serve(50999, 8123, 50998)) == (50999, 8123, 50998)
    assert served_ports(monkeypatch, serve(None, None)) == (50051, 8000, 50052)


def test_a_port_override_that_clashes_is_a_config_error_naming_both(capsys):
    """`serve --port 50052` beside the default router.admin_port: refused before anything starts, as the file's own
    clash is (it failed after binding, as 'PortBusy: router.admin_port = 50052 ... (in use ...)', serve's own port)."""
    assert cli.main(["serve", "--config", str(ROOT / "deploy" / "local.yaml"), "--port", "50052"]) == 2
    assert capsys.readouterr().err == ("config error: router.admin_port: 50052 is router.port too (serve --admin-port "
                                       "picks another; -1 serves Admin on the public port)\n")


def test_demo_serves_on_any_free_port_so_a_running_serve_does_not_stop_it(monkeypatch):
    """gRPC on any free port, no HTTP, Admin on that gRPC port (-1): a running serve's ports are left alone."""
    assert served_ports(monkeypatch, argparse.Namespace(command="demo")) == (0, -1, -1)


def test_demo_serves_no_metrics_endpoint_so_a_running_serve_on_the_same_config_does_not_stop_it(monkeypatch):
    config = served_config(monkeypatch, argparse.Namespace(command="demo"), {"router": {"metrics_port": 9171}})
    assert config.router.metrics_port == -1


@pytest.mark.parametrize("piped, prompt", [("def f(\n", "def f("), ("def f(\r\n", "def f("), ("def f(", "def f("),
                                           ("def f(\n\n", "def f(\n")])
def test_a_prompt_from_stdin_loses_exactly_one_final_newline(piped, prompt, monkeypatch):
    """`echo "def f(" | specpool generate -` asks for what `specpool generate "def f("` asks for."""
    parser, commands = cli.build_parser()
    monkeypatch.setattr("sys.stdin", io.StringIO(piped))
    args = parser.parse_args(["generate", "-"])
    cli.read_prompt(commands["generate"], args)
    assert args.prompt == prompt


def test_a_prompt_file_is_taken_as_it_is(tmp_path):
    parser, commands = cli.build_parser()
    (tmp_path / "p.txt").write_text("def f(\n")
    args = parser.parse_args(["generate", "--prompt-file", str(tmp_path / "p.txt")])
    cli.read_prompt(commands["generate"], args)
    assert args.prompt == "def f(\n"


def test_acceptance_is_n_a_when_nothing_was_drafted():
    response = generation_pb2.GenerateResponse(finish_reason=generation_pb2.FINISH_REASON_LENGTH)
    response.stats.target_passes = 8
    assert "acceptance=n/a, mean accepted length=1.00 tokens/pass" in cli.summary(response, 8, 1.0)
    response.stats.draft_tokens, response.stats.accepted_tokens = 4, 3
    assert "acceptance=0.75," in cli.summary(response, 8, 1.0)


def test_mean_accepted_length_counts_each_pass_s_committed_tokens_even_past_a_stop_string():
    """A stop string can drop tokens of passes the target had already run (24 tokens returned from 26 passes):
    the summary's mean accepted length stays tokens committed per pass, never below 1."""
    response = generation_pb2.GenerateResponse(finish_reason=generation_pb2.FINISH_REASON_STOP)
    response.stats.target_passes, response.stats.draft_tokens, response.stats.accepted_tokens = 26, 8, 4
    assert "mean accepted length=1.15 tokens/pass" in cli.summary(response, 24, 1.0)


def test_admin_address_of_a_copied_config_needs_no_model_folders(tmp_path):
    """`cp deploy/local.yaml /tmp/x/my.yaml` (admin port edited): status and reload read only the address from it
    (they said 'config error: draft.model: no model folder ...'); a bad address is still named."""
    copied = tmp_path / "x" / "my.yaml"
    copied.parent.mkdir()
    local = (ROOT / "deploy" / "local.yaml").read_text()
    assert "admin_port: 50052" in local
    copied.write_text(local.replace("admin_port: 50052", "admin_port: 50072"))
    parser, _ = cli.build_parser()
    for command in ("status", "reload"):
        assert cli.admin_address(parser.parse_args([command, "--config", str(copied)])) == "127.0.0.1:50072"
    copied.write_text(yaml.safe_dump({"router": {"port": "fifty"}, "draft": {"model": "nowhere/to/be/found"}}))
    with pytest.raises(ConfigError, match="^router.port: must be int"):
        cli.admin_address(parser.parse_args(["status", "--config", str(copied)]))


class EndlessGeneration(generation_pb2_grpc.GenerationServicer):
    """Answers until its client cancels: one-token chunks of "x" (GenerateStream), or nothing (Generate). Each call
    is announced on `calls` as it starts."""

    def __init__(self):
        self.calls = queue.Queue()

    def GenerateStream(self, request, context):
        self.calls.put(request)
        while context.is_active():
            yield generation_pb2.GenerateResponse(token_ids=[120], text="x")
            time.sleep(0.02)

    def Generate(self, request, context):
        self.calls.put(request)
        while context.is_active():
            time.sleep(0.02)
        return generation_pb2.GenerateResponse()


@pytest.fixture(scope="module")
def endless():
    """An EndlessGeneration served on 127.0.0.1: (its address, the servicer)."""
    servicer, server = EndlessGeneration(), grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(0)


def interrupted_generate(address: str, calls: queue.Queue, stream: bool) -> tuple[int, str, float]:
    """`specpool generate` against `address`, sent SIGINT twice (10 ms apart) mid-call, once its call has reached
    the server (and, streamed, once it has printed output): its exit status, stderr and seconds from the first
    SIGINT to its exit."""
    process = subprocess.Popen([sys.executable, "-m", "router.cli", "generate", "--address", address,
                                "--max-new-tokens", "900", *(["--stream"] if stream else []), "def f("],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        calls.get(timeout=60)
        if stream:
            assert select.select([process.stdout], [], [], 30)[0], "no output streamed"
            assert os.read(process.stdout.fileno(), 1024).startswith(b"def f(x")
        interrupted = time.monotonic()
        process.send_signal(signal.SIGINT)
        time.sleep(0.01)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=10)
        return process.returncode, err.decode(), time.monotonic() - interrupted
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "unary"])
def test_ctrl_c_cancels_generate_in_one_line_with_exit_status_130(endless, stream):
    """Ctrl-C mid-call (a second one close behind) cancels the call and ends `generate` at once with one line,
    every time: it printed two chained KeyboardInterrupt tracebacks, and once in six tries hung for good in
    channel.close()."""
    address, servicer = endless
    for _ in range(3):
        code, err, seconds = interrupted_generate(address, servicer.calls, stream)
        assert (code, err) == (130, "interrupted\n"), err
        assert seconds < 5


def test_an_admin_command_with_nothing_at_its_address_says_what_to_check(tmp_path, capsys):
    """`specpool status` where nothing listens (serve not running, or a config whose admin port is not the running
    server's): the transport's error, then what to check; it printed gRPC's 'failed to connect to all addresses'
    alone."""
    import socket
    with socket.socket() as probe:                 # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"router": {"admin_port": port}}))
    assert cli.main(["status", "--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: UNAVAILABLE: ") and err.endswith(
        f" (nothing listens at 127.0.0.1:{port}, from --config's router.admin_host:admin_port: is specpool serve "
        f"running, with Admin there? serve --admin-port moves it)\n"), err
    assert cli.main(["status", "--address", f"127.0.0.1:{port}"]) == 1
    assert f"(nothing listens at 127.0.0.1:{port}, from --address: " in capsys.readouterr().err


def test_addresses_the_client_commands_take():
    """host:port, a bracketed IPv6 host, and gRPC's own targets; a port out of range, none, or a bare IPv6 host is an
    argument error (gRPC dialled 127.0.0.1:99999 as port 34463 and 127.0.0.1 as port 443)."""
    for address in ("127.0.0.1:50052", "router.internal:1", "[::1]:50052", "unix:/tmp/specpool.sock",
                    "dns:///router.internal:50052"):
        assert cli.grpc_address(address) == address
    for address, says in (("127.0.0.1:99999", "the port in [1, 65535]"), ("127.0.0.1", "must be host:port"),
                          ("::1:50052", "an IPv6 host in brackets: [::1]:50052")):
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(says)):
            cli.grpc_address(address)


def test_reload_of_an_empty_file_is_refused_naming_the_file(tmp_path, capsys):
    """Refused before it is sent (it said `INVALID_ARGUMENT: config_yaml: empty`, naming the request's field), with
    no server to ask: the file is read and checked here."""
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing yet\n")
    assert cli.main(["reload", "--config", str(path), "--address", "127.0.0.1:9"]) == 2
    assert capsys.readouterr().err == f"config error: {path}: empty\n"
