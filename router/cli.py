"""specpool's command line.

    specpool serve --config deploy/local.yaml          # place the pools on Ray, serve gRPC
    specpool generate "The meaning of life is"        # ask a running server
    specpool demo --config deploy/local.yaml "Hello"  # serve, answer one request, stop
    specpool reload --config deploy/local.yaml         # hot-reload the speculation section
    specpool status --config deploy/local.yaml         # active config and live K statistics
    echo "def f(" | specpool generate -                # the prompt from stdin (or --prompt-file PATH)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")   # Ray forks while gRPC threads run; keep that quiet

import grpc  # noqa: E402
import yaml  # noqa: E402

from protos.specpool.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc  # noqa: E402
from engine.gc_pauses import settle  # noqa: E402
from router.oplog import say  # noqa: E402
from router.reload import not_empty, with_overrides  # noqa: E402
from router.service import Service, reload_from_file  # noqa: E402
from router import status_summary  # noqa: E402
from router.addresses import dial  # noqa: E402
from router.bearer import ADMIN_KEY_ENV  # noqa: E402
from settings.schema import (ConfigError, RouterConfig, SpecpoolConfig, config_from_dict, load_config,  # noqa: E402
                             read_yaml)
from settings.yaml_doc import parse_yaml  # noqa: E402

DEFAULT_ADDRESS = "127.0.0.1:50051"         # router.port's default
DEFAULT_ADMIN_ADDRESS = "127.0.0.1:50052"   # router.admin_host and admin_port's defaults
FINISH_NAMES = {generation_pb2.FINISH_REASON_LENGTH: "length", generation_pb2.FINISH_REASON_STOP: "stop",
                generation_pb2.FINISH_REASON_EOS: "eos"}


class StartFailed(Exception):
    """Ray or the pools did not come up; the message is one line (the cause's first)."""


async def start_service(config: SpecpoolConfig, quiet: bool = False, overrides: dict | None = None) -> Service:
    try:
        return await Service(config, quiet, overrides=overrides).start()
    except Exception as exc:  # noqa: BLE001 - Ray raises bare Exception when its processes start too slowly
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise StartFailed(f"{type(exc).__name__}: {first}") from exc


async def _serve(config: SpecpoolConfig, path: str, overrides: dict) -> None:
    """Serve until SIGINT / SIGTERM, then drain and stop. A signal while the service starts cancels the start,
    which stops what it had started (Service.start): it used to kill serve outright, leaving its Ray processes."""
    stop, loop = asyncio.Event(), asyncio.get_running_loop()
    starting = asyncio.ensure_future(start_service(config, overrides=overrides))

    def on_stop() -> None:
        stop.set()
        starting.cancel()                 # nothing once the service has started
    on_stop_signals(loop, on_stop)
    try:
        service = await starting
    except asyncio.CancelledError:
        if not stop.is_set():
            raise
        say("stopped while starting")
        return
    on_stop_signals(loop, on_stop)        # again: starting Ray may have put its own SIGTERM handler in place
    service.gc_watch = settle()           # a full collection of what the process holds now would stall rounds
    reloads = set()

    def on_sighup():
        task = loop.create_task(reload_from_file(service, path))
        reloads.add(task)
        task.add_done_callback(reloads.discard)
    loop.add_signal_handler(signal.SIGHUP, on_sighup)
    try:
        await stop.wait()
        say("shutting down")
    finally:
        await service.stop(config.router.shutdown_grace_s)


def on_stop_signals(loop: asyncio.AbstractEventLoop, handler) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, handler)


def port_overrides(port: int | None, http_port: int | None, admin_port: int | None = None) -> dict:
    """serve --port / --http-port / --admin-port as overrides of router.port / http.port / router.admin_port: the
    Service applies them over the file at start and over every reloaded config (Admin.Reload, SIGHUP)."""
    overrides: dict = {}
    for section, key, value in (("router", "port", port), ("http", "port", http_port),
                                ("router", "admin_port", admin_port)):
        if value is not None:
            overrides.setdefault(section, {})[key] = value
    return overrides


def make_request(args) -> generation_pb2.GenerateRequest:
    request = generation_pb2.GenerateRequest(prompt=args.prompt, max_new_tokens=args.max_new_tokens, stop=args.stop,
                                             ignore_eos=args.ignore_eos, min_new_tokens=args.min_new_tokens)
    request.sampling.temperature, request.sampling.top_k = args.temperature, args.top_k
    request.sampling.min_p = args.min_p
    if args.top_p is not None:
        request.sampling.top_p = args.top_p
    if args.seed is not None:
        request.sampling.seed = args.seed
    request.sampling.frequency_penalty = args.frequency_penalty
    request.sampling.presence_penalty = args.presence_penalty
    if args.repetition_penalty is not None:
        request.sampling.repetition_penalty = args.repetition_penalty
    if args.k is not None:
        request.speculation.k = args.k
    structure = structured_output(args)
    if structure is not None:
        request.structured_output.CopyFrom(structure)
    return request


def structured_output(args) -> generation_pb2.StructuredOutput | None:
    """--json-schema, --json, --regex, --choice or --grammar (at most one) as the request's structured_output."""
    if args.json_schema or args.grammar:
        path = args.json_schema or args.grammar
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise SystemExit(f"specpool generate: cannot read {path}: {exc}") from None
        return generation_pb2.StructuredOutput(**{"json_schema" if args.json_schema else "grammar": text})
    if args.json:
        return generation_pb2.StructuredOutput(json_object=True)
    if args.regex is not None:
        return generation_pb2.StructuredOutput(regex=args.regex)
    if args.choice:
        return generation_pb2.StructuredOutput(choice=generation_pb2.Choices(options=args.choice))
    return None


def summary(response: generation_pb2.GenerateResponse, tokens: int, seconds: float) -> str:
    """The line after the completion; acceptance is n/a when nothing was drafted (K = 0 throughout). The mean
    accepted length is the tokens each target pass committed (its accepted drafts + 1), from the stats: a stop
    string can drop tokens of passes the target had already run (GenerationStats.target_passes)."""
    stats = response.stats
    acceptance = f"{stats.accepted_tokens / stats.draft_tokens:.2f}" if stats.draft_tokens else "n/a"
    per_pass = 1 + stats.accepted_tokens / stats.target_passes if stats.target_passes else 0.0
    return (f"[{tokens} tokens, finish={FINISH_NAMES.get(response.finish_reason, '?')}, "
            f"target passes={stats.target_passes}, acceptance={acceptance}, "
            f"mean accepted length={per_pass:.2f} tokens/pass, {tokens / seconds:.1f} tokens/s, "
            f"prompt tokens cached={stats.cached_prompt_tokens}, wire={stats.wire_bytes} B]")


def open_channel(args) -> grpc.Channel:
    """Plaintext, or TLS when --tls-ca is given (mutual TLS with --tls-cert/--tls-key; --tls-server-name: the
    name the server's certificate must carry, where it does not name the address dialled, as 127.0.0.1 for the
    admin port on loopback)."""
    if not getattr(args, "tls_ca", None):
        return grpc.insecure_channel(args.address)
    def read(path):
        return open(path, "rb").read() if path else None
    credentials = grpc.ssl_channel_credentials(read(args.tls_ca), read(args.tls_key), read(args.tls_cert))
    options = [("grpc.ssl_target_name_override", args.tls_server_name)] if args.tls_server_name else []
    return grpc.secure_channel(args.address, credentials, options=options)


class CancelOnInterrupt:
    """While in force (on the main thread; elsewhere it does nothing): Ctrl-C (SIGINT) cancels the watched call and
    is remembered, instead of raising KeyboardInterrupt wherever the main thread happens to be. The cancel runs on
    a thread of its own, not inside the handler (which may have interrupted gRPC holding the call's lock); a second
    Ctrl-C does nothing more. It stays in force until the channel is closed: a KeyboardInterrupt raised inside
    channel.close() once left `generate` hung for good (in _ChannelCallState.__del__). After an interrupt SIGINT
    stays ignored: the process is on its way out, with exit status 130."""

    def __init__(self):
        self.call = None
        self.interrupted = False
        self._previous = None

    def __enter__(self) -> "CancelOnInterrupt":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc_info) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, signal.SIG_IGN if self.interrupted else self._previous)

    def watch(self, call):
        """The call (a grpc.Future), to cancel on Ctrl-C; cancelled at once if Ctrl-C came before it started."""
        self.call = call
        if self.interrupted:
            call.cancel()
        return call

    def _on_sigint(self, signum, frame) -> None:
        if self.call is not None and not self.interrupted:
            threading.Thread(target=self.call.cancel, name="cancel-on-sigint", daemon=True).start()
        self.interrupted = True


def responses(stub: generation_pb2_grpc.GenerationStub, request, stream: bool, interrupts: CancelOnInterrupt):
    """The call's responses as they come (Generate: the one), the call watched by `interrupts`."""
    if stream:
        yield from interrupts.watch(stub.GenerateStream(request))
    else:
        yield interrupts.watch(stub.Generate.future(request)).result()


def run_generate(args, out=None) -> int:
    """Send the request; print the prompt, then the completion (streamed as it comes with --stream). Ctrl-C cancels
    the call, closes the channel and prints one line: exit status 130."""
    out = out or sys.stdout
    request, started = make_request(args), time.monotonic()
    tokens, response = 0, None
    with CancelOnInterrupt() as interrupts, open_channel(args) as channel:
        try:
            stub = generation_pb2_grpc.GenerationStub(channel)
            for i, response in enumerate(responses(stub, request, args.stream, interrupts)):
                out.write((args.prompt if i == 0 else "") + response.text)
                out.flush()
                tokens += len(response.token_ids)
        except (grpc.RpcError, grpc.FutureCancelledError) as exc:
            if not interrupts.interrupted:
                if response is not None:
                    print(file=out)           # end the line of the completion so far
                hint = tls_hint(exc, args.address) if response is None else ""
                print(f"error: {exc.code().name}: {exc.details()}{hint}", file=sys.stderr)
                return 1
    if interrupts.interrupted:
        if response is not None:
            print(file=out)               # end the line of the completion so far
        print("interrupted", file=sys.stderr)
        return 130
    print("\n" + summary(response, tokens, time.monotonic() - started), file=out)
    return 0


async def _demo(config: SpecpoolConfig, args, overrides: dict) -> int:
    service = await start_service(config, quiet=True, overrides=overrides)
    try:
        await service.drafts_loaded()          # the one request shows speculation with the draft model
        args.address = f"127.0.0.1:{service.port}"
        return await asyncio.to_thread(run_generate, args)
    finally:
        await service.stop()


def run_admin(args) -> int:
    """`specpool reload` / `specpool status` against a running server's Admin service."""
    key = admin_key(args)
    metadata = (("authorization", f"Bearer {key}"),) if key else None
    with open_channel(args) as channel:
        stub = admin_pb2_grpc.AdminStub(channel)
        try:
            if args.command == "reload":
                text = Path(args.config).read_text()
                not_empty(parse_yaml(text, args.config), args.config)   # refused here, naming the file
                response = stub.Reload(admin_pb2.ReloadRequest(config_yaml=text,
                                                               config_dir=str(Path(args.config).resolve().parent)),
                                       metadata=metadata)
                print(f"reloaded: {', '.join(response.changes) or 'no change'}\n"
                      f"speculation now:\n{response.speculation_yaml}")
            else:
                print(status_text(stub.GetStatus(admin_pb2.GetStatusRequest(), metadata=metadata), args.full,
                                  args.json))
        except grpc.RpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}{admin_hint(exc, args)}", file=sys.stderr)
            return 1
    return 0


def status_text(response: admin_pb2.GetStatusResponse, full: bool, as_json: bool) -> str:
    """`specpool status`: the summary (router/status_summary.py); --full: the running config as YAML, then the
    statistics as indented JSON; --json: the statistics alone (for jq and scripts)."""
    stats = json.loads(response.stats_json)
    if as_json:
        return json.dumps(stats, indent=2)
    if full:
        return response.config_yaml + "\n" + json.dumps(stats, indent=2)
    return status_summary.summary(yaml.safe_load(response.config_yaml) or {}, stats)


TLS_FAILURES = ("socket closed", "handshake", "ssl", "certificate", "hostname verification")


def admin_hint(exc: grpc.RpcError, args) -> str:
    """What an admin command's failure to reach Admin at args.address likely means: Admin is not on that port (the
    public one, say), nothing listens there, or the TLS handshake failed. An error the server itself sent needs
    none."""
    details, address = (exc.details() or "").lower(), args.address
    if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
        return (f" (no Admin service at {address}: it listens on router.admin_host:admin_port, 127.0.0.1:50052 by "
                f"default, not on the public port)")
    if exc.code() != grpc.StatusCode.UNAVAILABLE:
        return ""
    if "connection refused" in details:
        source = ("--address" if args.address_given else
                  "--config's router.admin_host:admin_port" if getattr(args, "config", None) else "the default")
        return (f" (nothing listens at {address}, from {source}: is specpool serve running, with Admin there? serve "
                f"--admin-port moves it)")
    return tls_hint(exc, address)


def tls_hint(exc: grpc.RpcError, address: str) -> str:
    """What a client command's failure to reach a server at `address` likely means when it reads as a failed TLS
    handshake."""
    details = (exc.details() or "").lower()
    if exc.code() != grpc.StatusCode.UNAVAILABLE or not any(failure in details for failure in TLS_FAILURES):
        return ""
    return (f" (the TLS handshake with {address} failed: where the server's tls.cert is set give --tls-ca, under "
            f"tls.client_auth --tls-cert and --tls-key too, and --tls-server-name if the certificate does not name "
            f"{address})")


def int_in(low: int, high: int):
    """An argparse type: an integer in [low, high], else a one-line usage error naming the option."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer (got {text!r})") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}] (got {value})")
        return value
    return parse


GRPC_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:")   # targets gRPC resolves itself


def grpc_address(text: str) -> str:
    """An argparse type: host:port, a port in [1, 65535] and an IPv6 host in brackets ([::1]:50052), or a gRPC
    target with a scheme (unix:/path) as it is. gRPC dialled 127.0.0.1:99999 as port 34463, ::1:50052 not at all,
    and a missing port as 443."""
    if text.startswith(GRPC_SCHEMES):
        return text
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"must be host:port, the port in [1, 65535] (got {text!r})")
    if ":" in host and not host.startswith("["):
        raise argparse.ArgumentTypeError(f"must be host:port, an IPv6 host in brackets: [{host}]:{port} (got "
                                         f"{text!r})")
    return text


UINT32, UINT64 = 2 ** 32 - 1, 2 ** 64 - 1


def _add_generate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", help="the prompt; - reads it from stdin")
    parser.add_argument("--prompt-file", help="read the prompt from this file")
    parser.add_argument("--max-new-tokens", type=int_in(1, UINT32), default=64, help="default: 64")
    parser.add_argument("--min-new-tokens", type=int_in(0, UINT32), default=0,
                        help="no EOS, stop token or stop string before this many tokens (default 0)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int_in(0, 2 ** 31 - 1), default=0)
    parser.add_argument("--min-p", type=float, default=0.0, help="0 to 1 (default 0: off)")
    parser.add_argument("--seed", type=int_in(0, UINT64), default=None)
    parser.add_argument("--frequency-penalty", type=float, default=0.0, help="-2 to 2 (OpenAI's)")
    parser.add_argument("--presence-penalty", type=float, default=0.0, help="-2 to 2 (OpenAI's)")
    parser.add_argument("--repetition-penalty", type=float, default=None, help="0.01 to 100 (vLLM's; default 1: off)")
    parser.add_argument("--k", type=int_in(0, UINT32), default=None, help="fix K for this request (0: no speculation)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--ignore-eos", action="store_true", help="go on past the model's EOS token")
    structure = parser.add_mutually_exclusive_group()
    structure.add_argument("--json-schema", metavar="FILE", help="the output is JSON this schema (a file) accepts")
    structure.add_argument("--json", action="store_true", help="the output is a JSON object")
    structure.add_argument("--regex", help="the output matches this regular expression")
    structure.add_argument("--choice", action="append", help="the output is one of these (repeatable)")
    structure.add_argument("--grammar", metavar="FILE", help="the output follows this Lark or GBNF grammar (a file)")


def read_prompt(parser: argparse.ArgumentParser, args) -> None:
    """args.prompt from the argument, stdin (`-`) or --prompt-file; exactly one of them."""
    if (args.prompt is None) == (args.prompt_file is None):
        parser.error("give the prompt as an argument, - (stdin) or --prompt-file, exactly one of them")
    if args.prompt_file is not None:
        try:
            args.prompt = Path(args.prompt_file).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            parser.error(f"argument --prompt-file: cannot read {args.prompt_file}: {exc}")
    elif args.prompt == "-":
        args.prompt = without_final_newline(sys.stdin.read())


def without_final_newline(text: str) -> str:
    """A prompt from stdin without the one line end that `echo` (or a here-string) adds after it."""
    for end in ("\r\n", "\n"):
        if text.endswith(end):
            return text[:-len(end)]
    return text


def admin_address(args) -> str:
    """--address, else where --config puts Admin (router.admin_host:admin_port; router.host:port at admin_port
    -1), else the default. A wildcard host is reached on loopback; admin_port 0 (any free port) cannot be found."""
    if args.address:
        return args.address
    if not getattr(args, "config", None):
        return DEFAULT_ADMIN_ADDRESS
    router = router_section(args.config)
    on_public = router.admin_port < 0
    host, port = (router.host, router.port) if on_public else (router.admin_host, router.admin_port)
    if port == 0:
        key = "router.port" if on_public else "router.admin_port"
        raise ConfigError(f"{key} is 0 (any free port): give --address (serve's log says which port it took)")
    return dial(host, port)


def admin_key(args) -> str | None:
    """The key an admin command sends: $SPECPOOL_ADMIN_KEY, else the first of --config's router.admin_keys."""
    if os.environ.get(ADMIN_KEY_ENV) or not getattr(args, "config", None):
        return os.environ.get(ADMIN_KEY_ENV)
    return next(iter(router_section(args.config).admin_keys), None)


def router_section(path: str) -> RouterConfig:
    """The config file's router addresses and Admin's keys (host, port, admin_host, admin_port, admin_keys: a
    RouterConfig), checked, and nothing else of it: an admin command only needs to reach the server, and a copy of a
    config away from its model folders must still do that (the server checks the document that `reload` sends, and
    names a bad key itself)."""
    data = read_yaml(path)
    router = data.get("router") if isinstance(data, dict) else None
    router = router if isinstance(router, dict) else {}
    keys = ("host", "port", "admin_host", "admin_port", "admin_keys")
    return config_from_dict({"router": {key: router[key] for key in keys if key in router}}).router


class Parser(argparse.ArgumentParser):
    """Argument errors are one line naming the option (no usage block); --help still shows it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    """The parser, and its subcommands' parsers by name."""
    parser = Parser(prog="specpool", description="distributed speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="place the pools on Ray and serve gRPC (and HTTP)")
    serve.add_argument("--config", required=True)
    serve.add_argument("--port", type=int_in(0, 65535), help="public gRPC port (overrides router.port)")
    serve.add_argument("--http-port", type=int_in(-1, 65535),
                       help="OpenAI-compatible HTTP port (overrides http.port; -1: off)")
    serve.add_argument("--admin-port", type=int_in(-1, 65535),
                       help="Admin (reload, status) port (overrides router.admin_port; -1: on the public port)")
    gen = sub.add_parser("generate", help="send one request to a running server")
    gen.add_argument("--address", type=grpc_address, default=DEFAULT_ADDRESS)
    _add_generate_args(gen)
    demo = sub.add_parser("demo", help="serve the config, answer one request, stop")
    demo.add_argument("--config", default="deploy/local.yaml")
    _add_generate_args(demo)
    reload = sub.add_parser("reload", help="hot-reload a running server's config (speculation, draft.method and "
                                           "ngram keys, more replicas)")
    reload.add_argument("--config", required=True, help="the new config (its router section says where Admin is)")
    status = sub.add_parser("status", help="a running server's state in a few lines (--full: the config and every "
                                           "statistic)")
    status.add_argument("--config", help="the server's config (its router section says where Admin is)")
    shown = status.add_mutually_exclusive_group()
    shown.add_argument("--full", action="store_true", help="the running config, then every statistic (long)")
    shown.add_argument("--json", action="store_true", help="the statistics alone, as JSON")
    for admin in (reload, status):
        admin.add_argument("--address", type=grpc_address,
                           help=f"the server's Admin address (default: from --config, else {DEFAULT_ADMIN_ADDRESS})")
    for client in (gen, reload, status):
        client.add_argument("--tls-ca", help="CA bundle: connect with TLS")
        client.add_argument("--tls-cert", help="client certificate (mutual TLS)")
        client.add_argument("--tls-key", help="client private key (mutual TLS)")
        client.add_argument("--tls-server-name", help="the name the server's certificate carries, if not the "
                                                      "address's host (as tls.server_name)")
    return parser, sub.choices


def server_overrides(args) -> dict:
    """`serve`: its --port / --http-port / --admin-port over the config; `demo`: gRPC (Admin on it) on any free
    port, no HTTP and no metrics endpoint: it is its own client, and a `specpool serve` already on the config's
    ports must not stop it."""
    if args.command == "serve":
        return port_overrides(args.port, args.http_port, args.admin_port)
    overrides = port_overrides(0, -1, -1)
    overrides["router"]["metrics_port"] = -1
    return overrides


def run_server(args, config: SpecpoolConfig, overrides: dict) -> int:
    """`serve` or `demo`, with `overrides` (server_overrides) over the config."""
    try:
        if args.command == "serve":
            asyncio.run(_serve(config, args.config, overrides))
            return 0
        return asyncio.run(_demo(config, args, overrides))
    except StartFailed as exc:
        print(f"specpool: could not start: {exc}", file=sys.stderr)
        return 1


def quietly_on_closed_pipe(command, args) -> int:
    """command(args) for a client command (generate, reload, status): a reader that goes away (`specpool status |
    head`) ends it quietly, with the status a process killed by SIGPIPE has (141), not a BrokenPipeError traceback.
    Not for serve or demo: their shutdown must run whatever happens to stdout (the log never raises: router.oplog)."""
    try:
        return command(args)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)      # the interpreter's last flush of stdout must not fail too
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status."""
    parser, commands = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("generate", "demo"):
        try:
            read_prompt(commands[args.command], args)
        except KeyboardInterrupt:         # Ctrl-C while the prompt is being typed on stdin
            print("interrupted", file=sys.stderr)
            return 130
    if args.command == "generate":
        return quietly_on_closed_pipe(run_generate, args)
    try:
        if args.command in ("reload", "status"):
            args.address_given, args.address = bool(args.address), admin_address(args)
            return quietly_on_closed_pipe(run_admin, args)
        config, overrides = load_config(args.config), server_overrides(args)
        with_overrides(config, overrides)       # checked before anything starts: `--port 50052` is a config error
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    return run_server(args, config, overrides)


def entry() -> None:
    """The `specpool` command. Once `serve` has stopped (its requests drained, its pools removed, a local Ray
    instance it started ended), the process leaves at once, without the interpreter's teardown: there Ray's exit
    handler, for a driver joined to a cluster, crashed it with SIGSEGV after a clean stop (`ray up`'s test, once in
    five runs in session 25), turning the stop's status 0 into -11."""
    code = main()
    if sys.argv[1:2] == ["serve"]:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
