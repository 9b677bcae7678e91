"""The router's public gRPC server: specpool.v1.Generation, grpc.health.v1 and server reflection.

Health for service "" is NOT_SERVING until every pool has loaded (`Router` attached), then SERVING.
"""
from __future__ import annotations

import contextlib
import random
import uuid

import grpc
from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos.specpool.v1 import generation_pb2, generation_pb2_grpc
from router.config import SpecpoolConfig
from router.speculation import DRAFT_MODES, RequestState, generate
from router.text import IncrementalDetokenizer
from router.validation import ModelLimits, RequestError, validate
from router.worker_client import DraftClient, TargetClient, least_loaded

MAX_MESSAGE_BYTES = 4 * 1024 * 1024


class Router:
    """Live serving state: worker replicas, tokenizer, model limits, and the RNG for ids and seeds."""

    def __init__(self, config: SpecpoolConfig, drafts: list[DraftClient], targets: list[TargetClient],
                 model_info: dict, tokenizer, rng: random.Random | None = None):
        self.config = config
        self.drafts, self.targets = drafts, targets
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(model_info["eos_token_ids"])
        self.limits = ModelLimits(model_info["vocab_size"], model_info["max_context"], config.speculation.k_max)
        self._rng = rng or random.Random()

    def admit(self, request: generation_pb2.GenerateRequest) -> RequestState:
        """Validate and normalise a request into the router's state for it (raises RequestError)."""
        prompt_ids = (self.tokenizer.encode(request.prompt).ids if request.prompt and not request.prompt_token_ids
                      else list(request.prompt_token_ids))
        validate(request, prompt_ids, self.limits)
        sampling = generation_pb2.SamplingParams()
        sampling.CopyFrom(request.sampling)
        sampling.top_p = request.sampling.top_p if request.sampling.HasField("top_p") else 1.0
        if not sampling.HasField("seed"):
            sampling.seed = self._rng.getrandbits(63)
        spec = request.speculation
        fixed_k = 0 if spec.disable else (spec.k if spec.HasField("k") else None)
        mode = "greedy" if sampling.temperature == 0 else self.config.speculation.draft_sampling
        return RequestState(session_id=self._rng.getrandbits(63), tokens=list(prompt_ids),
                            prompt_len=len(prompt_ids), max_new_tokens=request.max_new_tokens, sampling=sampling,
                            fixed_k=fixed_k, draft_mode=DRAFT_MODES[mode], max_context=self.limits.max_context,
                            stop_ids=frozenset(request.stop_token_ids), eos_ids=self.eos_ids)

    def choose_k(self, state: RequestState) -> int:
        return self.config.speculation.k

    async def run(self, state: RequestState):
        """The request's rounds on the least-loaded draft and target replicas (sticky for the request)."""
        draft = least_loaded(self.drafts) if self.drafts else None
        target = least_loaded(self.targets)
        for worker in (draft, target):
            if worker:
                worker.outstanding += 1
        try:
            async with contextlib.aclosing(generate(state, draft, target, self.choose_k)) as rounds:
                async for tokens in rounds:
                    yield tokens
        finally:
            for worker in (draft, target):
                if worker:
                    worker.outstanding -= 1


def _response(state: RequestState, request_id: str, tokens: list[int], text: str) -> generation_pb2.GenerateResponse:
    response = generation_pb2.GenerateResponse(token_ids=tokens, text=text, request_id=request_id)
    if state.finish_reason:
        response.finish_reason = state.finish_reason
        response.stats.CopyFrom(state.stats)
    return response


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self):
        self.router: Router | None = None

    async def _admit(self, request, context) -> tuple[Router, RequestState, str]:
        router = self.router
        if router is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "specpool is still loading its worker pools")
        try:
            state = router.admit(request)
        except RequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return router, state, request.request_id or uuid.uuid4().hex

    async def GenerateStream(self, request, context):
        router, state, request_id = await self._admit(request, context)
        detokenizer = IncrementalDetokenizer(router.tokenizer)
        try:
            async for tokens in router.run(state):
                text = detokenizer.push(tokens, final=bool(state.finish_reason))
                yield _response(state, request_id, tokens, text)
        except grpc.aio.AioRpcError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"a worker failed: {exc.code().name}: {exc.details()}")

    async def Generate(self, request, context):
        router, state, request_id = await self._admit(request, context)
        try:
            async for _ in router.run(state):
                pass
        except grpc.aio.AioRpcError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"a worker failed: {exc.code().name}: {exc.details()}")
        output = state.tokens[state.prompt_len:]
        return _response(state, request_id, output, router.tokenizer.decode(output, skip_special_tokens=True))


async def start_public_server(host: str, port: int) -> tuple[grpc.aio.Server, int, GenerationServicer,
                                                              health_async.HealthServicer]:
    """Start Generation + health (NOT_SERVING) + reflection; attach a Router to the servicer later."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.so_reuseport", 0)])
    servicer = GenerationServicer()
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    health = health_async.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    services = (generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(services, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    return server, bound, servicer, health


async def mark_ready(servicer: GenerationServicer, health: health_async.HealthServicer, router: Router) -> None:
    servicer.router = router
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
