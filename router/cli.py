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
import dataclasses
import os
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")   # Ray forks while gRPC threads run; keep that quiet

import grpc  # noqa: E402

from protos.specpool.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc  # noqa: E402
from router.service import Service, reload_from_file  # noqa: E402
from settings.schema import ConfigError, SpecpoolConfig, load_config  # noqa: E402

DEFAULT_ADDRESS = "127.0.0.1:50051"
FINISH_NAMES = {generation_pb2.FINISH_REASON_LENGTH: "length", generation_pb2.FINISH_REASON_STOP: "stop",
                generation_pb2.FINISH_REASON_EOS: "eos"}


class StartFailed(Exception):
    """Ray or the pools did not come up; the message is one line (the cause's first)."""


async def start_service(config: SpecpoolConfig, quiet: bool = False) -> Service:
    try:
        return await Service(config, quiet).start()
    except Exception as exc:  # noqa: BLE001 - Ray raises bare Exception when its processes start too slowly
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise StartFailed(f"{type(exc).__name__}: {first}") from exc


async def _serve(config: SpecpoolConfig, path: str) -> None:
    service = await start_service(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    reloads = set()

    def on_sighup():
        task = loop.create_task(reload_from_file(service, path))
        reloads.add(task)
        task.add_done_callback(reloads.discard)
    loop.add_signal_handler(signal.SIGHUP, on_sighup)
    await stop.wait()
    print(f"[specpool] shutting down (grace {config.router.shutdown_grace_s:.0f}s)", flush=True)
    await service.stop(config.router.shutdown_grace_s)


def with_ports(config: SpecpoolConfig, port: int | None, http_port: int | None) -> SpecpoolConfig:
    """serve --port / --http-port over the config's router.port / http.port."""
    if port is not None:
        config = dataclasses.replace(config, router=dataclasses.replace(config.router, port=port))
    if http_port is not None:
        config = dataclasses.replace(config, http=dataclasses.replace(config.http, port=http_port))
    return config


def make_request(args) -> generation_pb2.GenerateRequest:
    request = generation_pb2.GenerateRequest(prompt=args.prompt, max_new_tokens=args.max_new_tokens, stop=args.stop)
    request.sampling.temperature = args.temperature
    request.sampling.top_k = args.top_k
    if args.top_p is not None:
        request.sampling.top_p = args.top_p
    if args.seed is not None:
        request.sampling.seed = args.seed
    if args.k is not None:
        request.speculation.k = args.k
    return request


def summary(response: generation_pb2.GenerateResponse, tokens: int, seconds: float) -> str:
    stats = response.stats
    acceptance = stats.accepted_tokens / stats.draft_tokens if stats.draft_tokens else 0.0
    per_pass = tokens / stats.target_passes if stats.target_passes else 0.0
    return (f"[{tokens} tokens, finish={FINISH_NAMES.get(response.finish_reason, '?')}, "
            f"target passes={stats.target_passes}, acceptance={acceptance:.2f}, "
            f"mean accepted length={per_pass:.2f} tokens/pass, {tokens / seconds:.1f} tokens/s, "
            f"wire={stats.wire_bytes} B]")


def open_channel(args) -> grpc.Channel:
    """Plaintext, or TLS when --tls-ca is given (mutual TLS with --tls-cert/--tls-key)."""
    if not getattr(args, "tls_ca", None):
        return grpc.insecure_channel(args.address)
    def read(path):
        return open(path, "rb").read() if path else None
    credentials = grpc.ssl_channel_credentials(read(args.tls_ca), read(args.tls_key), read(args.tls_cert))
    return grpc.secure_channel(args.address, credentials)


def run_generate(args, out=None) -> int:
    """Send the request; print the prompt, then the completion (streamed as it comes with --stream)."""
    out = out or sys.stdout
    request = make_request(args)
    started = time.monotonic()
    with open_channel(args) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            responses = stub.GenerateStream(request) if args.stream else [stub.Generate(request)]
            tokens, response = 0, None
            for i, response in enumerate(responses):
                out.write((args.prompt if i == 0 else "") + response.text)
                out.flush()
                tokens += len(response.token_ids)
        except grpc.RpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print("\n" + summary(response, tokens, time.monotonic() - started), file=out)
    return 0


async def _demo(config: SpecpoolConfig, args) -> int:
    service = await start_service(config, quiet=True)
    try:
        await service.drafts_loaded()          # the one request shows speculation with the draft model
        args.address = f"127.0.0.1:{service.port}"
        return await asyncio.to_thread(run_generate, args)
    finally:
        await service.stop()


def run_admin(args) -> int:
    """`specpool reload` / `specpool status` against a running server's Admin service."""
    with open_channel(args) as channel:
        stub = admin_pb2_grpc.AdminStub(channel)
        try:
            if args.command == "reload":
                response = stub.Reload(admin_pb2.ReloadRequest(
                    config_yaml=open(args.config).read(), config_dir=str(Path(args.config).resolve().parent)))
                print("reloaded; speculation now:\n" + response.speculation_yaml)
            else:
                response = stub.GetStatus(admin_pb2.GetStatusRequest())
                print(response.config_yaml + "\n" + response.stats_json)
        except grpc.RpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    return 0


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


UINT32, UINT64 = 2 ** 32 - 1, 2 ** 64 - 1


def _add_generate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", help="the prompt; - reads it from stdin")
    parser.add_argument("--prompt-file", help="read the prompt from this file")
    parser.add_argument("--max-new-tokens", type=int_in(1, UINT32), default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int_in(0, 2 ** 31 - 1), default=0)
    parser.add_argument("--seed", type=int_in(0, UINT64), default=None)
    parser.add_argument("--k", type=int_in(0, UINT32), default=None, help="fix K for this request (0: no speculation)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--stream", action="store_true")


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
        args.prompt = sys.stdin.read()


def admin_address(args) -> str:
    """--address, else the router address in --config, else the default."""
    if args.address:
        return args.address
    if getattr(args, "config", None):
        router = load_config(args.config).router
        return f"{'127.0.0.1' if router.host in ('0.0.0.0', '') else router.host}:{router.port}"
    return DEFAULT_ADDRESS


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
    gen = sub.add_parser("generate", help="send one request to a running server")
    gen.add_argument("--address", default=DEFAULT_ADDRESS)
    _add_generate_args(gen)
    demo = sub.add_parser("demo", help="serve the config, answer one request, stop")
    demo.add_argument("--config", default="deploy/local.yaml")
    _add_generate_args(demo)
    reload = sub.add_parser("reload", help="hot-reload the speculation section of a running server")
    reload.add_argument("--config", required=True, help="the new config (its router.port is the address)")
    status = sub.add_parser("status", help="print the active config and live statistics")
    status.add_argument("--config", help="the server's config (its router.port is the address)")
    for admin in (reload, status):
        admin.add_argument("--address", help=f"the server (default: from --config, else {DEFAULT_ADDRESS})")
    for client in (gen, reload, status):
        client.add_argument("--tls-ca", help="CA bundle: connect with TLS")
        client.add_argument("--tls-cert", help="client certificate (mutual TLS)")
        client.add_argument("--tls-key", help="client private key (mutual TLS)")
    return parser, sub.choices


def run_server(args, config: SpecpoolConfig) -> int:
    """`serve` (its --port / --http-port over the config) or `demo` (gRPC only, on any free port: it is its own
    client, and a `specpool serve` already on the config's port must not stop it)."""
    try:
        if args.command == "serve":
            asyncio.run(_serve(with_ports(config, args.port, args.http_port), args.config))
            return 0
        return asyncio.run(_demo(with_ports(config, 0, -1), args))
    except StartFailed as exc:
        print(f"specpool: could not start: {exc}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    parser, commands = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("generate", "demo"):
        read_prompt(commands[args.command], args)
    if args.command == "generate":
        return run_generate(args)
    try:
        if args.command in ("reload", "status"):
            args.address = admin_address(args)
            return run_admin(args)
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    return run_server(args, config)


if __name__ == "__main__":
    sys.exit(main())
