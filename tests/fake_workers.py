"""A router with no Ray and no model: fake target workers (real grpc.aio servers on 127.0.0.1 that answer every
step with the same token), the real Router, TargetClient and public gRPC server in front of them. A fake target can
stall (as a SIGSTOPped worker does: calls wait forever), die (its server stops: its streams break, as a SIGKILLed
worker's do) and come back at a new address when the test lets its recovery finish."""
from __future__ import annotations

import asyncio
import threading

import grpc
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from protos.specpool.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from settings.schema import config_from_dict

TOKEN = 1                 # every step's token ("b"); EOS is 0 and never comes
STEP_S = 0.001            # a fake forward
VOCAB = {c: i for i, c in enumerate("abcdefgh")}


class FakeTarget(worker_pb2_grpc.TargetWorkerServicer):
    """A target worker on 127.0.0.1 with no model: every step answers TOKEN after STEP_S. A call carrying more than
    `memory_tokens` new tokens runs out of device memory, as a real engine's forward would."""

    def __init__(self):
        self.stalled = False
        self.memory_tokens: int | None = None
        self.token = TOKEN                     # what every step answers
        self.stop_token_ids: list[list[int]] = []   # each call's, as sent
        self.server: grpc.aio.Server | None = None
        self.address = ""

    async def start(self) -> str:
        from engine.worker_server import serve_stream
        self._serve_stream = serve_stream
        self.server = grpc.aio.server()
        worker_pb2_grpc.add_TargetWorkerServicer_to_server(self, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.address = f"127.0.0.1:{port}"
        return self.address

    async def kill(self) -> None:
        """As SIGKILL would: the server is gone, its streams break."""
        await self.server.stop(0)

    async def submit(self, request, emit):
        if self.memory_tokens is not None and len(request.new_token_ids) > self.memory_tokens:
            import torch
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        self.stop_token_ids.append(list(request.stop_token_ids))
        for _ in range(max(request.decode_steps, 1) - 1):
            await self._step()
            emit(worker_pb2.VerifyResponse(next_token_id=self.token, more=True))
        await self._step()
        return worker_pb2.VerifyResponse(next_token_id=self.token)

    async def _step(self) -> None:
        await asyncio.sleep(STEP_S)
        if self.stalled:                       # as SIGSTOP would: no answer, ever
            await asyncio.Event().wait()

    async def VerifyStream(self, requests, context):
        async for response in self._serve_stream(requests, self.submit, worker_pb2.VerifyResponse):
            yield response

    async def Release(self, request, context):
        return worker_pb2.ReleaseResponse()


class Restarter:
    """A TargetClient's `recover` for a fake target: blocks (on the recovery's thread, as Ray's restart does) until
    the test calls `allow()`, then starts a new FakeTarget on the router's loop and returns its address."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.allowed, self.started = loop, threading.Event(), []

    def allow(self) -> None:
        self.allowed.set()

    def __call__(self) -> str:
        self.allowed.wait()
        target = FakeTarget()
        self.started.append(target)
        return asyncio.run_coroutine_threadsafe(target.start(), self.loop).result(10)


class ClosedPipe:
    """A stdout whose reader has gone away (serve's output piped into a process that ended): every write raises."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def tokenizer() -> Tokenizer:
    return Tokenizer(WordLevel(VOCAB, unk_token="a"))


def fake_config(speculation: dict | None = None, **router) -> object:
    return config_from_dict({"router": {"host": "127.0.0.1", "port": 0, "worker_timeout_s": 30.0, **router},
                             "draft": {"method": "ngram"}, "speculation": speculation or {}})


class FakeService:
    """The public server and a Router over one FakeTarget ("target 0"), on the running loop: `stub` is a
    grpc.aio Generation stub, `health` the health servicer."""

    async def start(self, speculation: dict | None = None, **router) -> "FakeService":
        from router.server import Router, mark_ready, start_public_server
        from router.worker_client import TargetClient
        self.target = FakeTarget()
        address = await self.target.start()
        self.restarter = Restarter(asyncio.get_running_loop())
        config = fake_config(speculation, **router)
        self.client = TargetClient(address, config.router.worker_timeout_s, self.restarter, name="target 0")
        info = {"eos_token_ids": [0], "vocab_size": len(VOCAB), "max_context": 4096, "model_path": "fake"}
        self.router = Router(config, [], [self.client], info, tokenizer())
        self.server, port, servicer, self.health = await start_public_server("127.0.0.1", 0)
        await mark_ready(servicer, self.health, self.router)
        self.address = f"127.0.0.1:{port}"
        self.channel = grpc.aio.insecure_channel(self.address)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        return self

    async def stop(self) -> None:
        await self.channel.close()
        await self.server.stop(0)
        await self.router.close()
        for target in [self.target, *self.restarter.started]:
            await target.server.stop(0)

    def requests_counted(self) -> dict:
        """specpool_requests_total by code."""
        return {s.labels["code"]: s.value for m in self.router.metrics.requests.collect() for s in m.samples
                if s.name.endswith("_total")}


def plain(max_new_tokens: int = 50) -> generation_pb2.GenerateRequest:
    request = generation_pb2.GenerateRequest(prompt_token_ids=[2, 3, 4], max_new_tokens=max_new_tokens)
    request.speculation.disable = True
    return request


def run(body, **router):
    """asyncio.run(body(service)) with a started FakeService, stopped after."""
    async def main():
        service = await FakeService().start(**router)
        try:
            return await body(service)
        finally:
            await service.stop()
    return asyncio.run(main())
