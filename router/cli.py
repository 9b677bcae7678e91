"""specpool's command line.

    specpool serve --config deploy/local.yaml          # place the pools on Ray, serve gRPC
    specpool generate "The meaning of life is"        # ask a running server
    specpool demo --config deploy/local.yaml "Hello"  # serve, answer one request, stop
    specpool reload --config deploy/local.yaml         # hot-reload the speculation section
    specpool status                                    # active config and live K statistics
"""
from __future__ import annotations

import argparse
import asyncio
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

FINISH_NAMES = {generation_pb2.FINISH_REASON_LENGTH: "length", generation_pb2.FINISH_REASON_STOP: "stop",
                generation_pb2.FINISH_REASON_EOS: "eos"}


class StartFailed(Exception):
    """Ray or the pools did not come up; the message is one line (the cause's first)."""


async def start_service(config: SpecpoolConfig) -> Service:
    try:
        return await Service(config).start()
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


def make_request(args) -> generation_pb2.GenerateRequest:
    request = generation_pb2.GenerateRequest(prompt=args.prompt, max_new_tokens=args.max_new_tokens)
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


def run_generate(args, out=sys.stdout) -> int:
    request = make_request(args)
    started = time.monotonic()
    with open_channel(args) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            if args.stream:
                tokens, last = 0, None
                for last in stub.GenerateStream(request):
                    out.write(last.text)
                    out.flush()
                    tokens += len(last.token_ids)
                response = last
            else:
                response = stub.Generate(request)
                tokens = len(response.token_ids)
                out.write(response.text)
        except grpc.RpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print("\n" + summary(response, tokens, time.monotonic() - started), file=out)
    return 0


async def _demo(config: SpecpoolConfig, args) -> int:
    service = await start_service(config)
    try:
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


def _add_generate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--k", type=int, default=None, help="fix K for this request (0: no speculation)")
    parser.add_argument("--stream", action="store_true")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specpool", description="distributed speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="place the pools on Ray and serve gRPC")
    serve.add_argument("--config", required=True)
    gen = sub.add_parser("generate", help="send one request to a running server")
    gen.add_argument("--address", default="127.0.0.1:50051")
    _add_generate_args(gen)
    demo = sub.add_parser("demo", help="serve the config, answer one request, stop")
    demo.add_argument("--config", default="deploy/local.yaml")
    _add_generate_args(demo)
    reload = sub.add_parser("reload", help="hot-reload the speculation section of a running server")
    reload.add_argument("--config", required=True)
    status = sub.add_parser("status", help="print the active config and live statistics")
    for admin in (reload, status):
        admin.add_argument("--address", default="127.0.0.1:50051")
    for client in (gen, reload, status):
        client.add_argument("--tls-ca", help="CA bundle: connect with TLS")
        client.add_argument("--tls-cert", help="client certificate (mutual TLS)")
        client.add_argument("--tls-key", help="client private key (mutual TLS)")
    args = parser.parse_args(argv)
    if args.command == "generate":
        return run_generate(args)
    if args.command in ("reload", "status"):
        return run_admin(args)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    try:
        if args.command == "serve":
            asyncio.run(_serve(config, args.config))
            return 0
        return asyncio.run(_demo(config, args))
    except StartFailed as exc:
        print(f"specpool: could not start: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
