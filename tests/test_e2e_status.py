"""The router stays responsive and counts every request under its true final status.

- A text prompt's size is checked on its length before it is encoded, and encoding runs off the event loop:
  a prompt being tokenized stalls no other request and no health check. (A 3.9 MB prompt used to stall
  every stream for 5 s; the over-length error named max_new_tokens.)
- specpool_requests_total{code}: DEADLINE_EXCEEDED for an expired deadline (was CANCELLED), CANCELLED for a
  client cancel, also one before the request was read (was not counted), INVALID_ARGUMENT for a message that
  does not parse (was UNKNOWN with a Python exception text, not counted), RESOURCE_EXHAUSTED for an oversized one.
"""
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.specpool.v1 import generation_pb2
from router.text import INLINE_CHARS
from tests.conftest import service_config

GENERATE = "/specpool.v1.Generation/Generate"


@pytest.fixture(scope="module")
def service(start_service, byte_pair):
    return start_service(service_config(byte_pair, speculation={"policy": "fixed", "k": 1}))


class WatchedTokenizer:
    """The router's tokenizer, with its encode calls counted and, while `gate` is clear, held."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.encodes, self.entered, self.gate = 0, threading.Event(), threading.Event()
        self.gate.set()

    def encode(self, text):
        self.encodes += 1
        self.entered.set()
        assert self.gate.wait(60)
        return self._tokenizer.encode(text)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


@pytest.fixture
def tokenizer(service):
    router = service.service.router
    original, router.tokenizer = router.tokenizer, WatchedTokenizer(router.tokenizer)
    yield router.tokenizer
    router.tokenizer.gate.set()
    router.tokenizer = original


def requests_total(service, code: str) -> float:
    return service.service.router.metrics.registry.get_sample_value("specpool_requests_total", {"code": code}) or 0


def expect_counts(service, before: dict, **added) -> None:
    """Wait (the count is taken as the handler ends, just after the client sees its status) for the counts."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(requests_total(service, c) != before[c] + n for c, n in added.items()):
        time.sleep(0.05)
    assert {c: requests_total(service, c) - before[c] for c in added} == added


def counts(service) -> dict:
    return {code: requests_total(service, code) for code in
            ("OK", "CANCELLED", "DEADLINE_EXCEEDED", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNKNOWN")}


def test_a_huge_prompt_is_refused_on_its_length_without_being_encoded(service, tokenizer):
    before = counts(service)
    with pytest.raises(grpc.RpcError) as info:
        service.stub.Generate(generation_pb2.GenerateRequest(prompt="x" * 4_000_000, max_new_tokens=4), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("prompt: 4000000 characters is over the limit of "), info.value.details()
    assert tokenizer.encodes == 0
    expect_counts(service, before, INVALID_ARGUMENT=1)


def test_an_over_long_prompt_error_names_prompt(service):
    with pytest.raises(grpc.RpcError) as info:
        service.stub.Generate(generation_pb2.GenerateRequest(prompt_token_ids=[7] * 5000, max_new_tokens=4))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("prompt: 5000 tokens is over the limit of 1023"), info.value.details()


def test_a_prompt_being_encoded_stalls_no_other_request(service, tokenizer):
    """The encode of a prompt longer than router.text.INLINE_CHARS (a short one is encoded on the event loop, in
    ~0.1 ms) is held mid-way: health checks and another client's stream are answered meanwhile (with the encode
    on the event loop, the health check timed out)."""
    tokenizer.gate.clear()
    outcome = {}
    prompt = "abc " * (INLINE_CHARS // 4 + 1)
    held = threading.Thread(target=lambda: outcome.setdefault("response", service.stub.Generate(
        generation_pb2.GenerateRequest(prompt=prompt, max_new_tokens=3), timeout=60)))
    held.start()
    assert tokenizer.entered.wait(30)
    health = health_pb2_grpc.HealthStub(service.channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    chunks = list(service.stub.GenerateStream(generation_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3],
                                                                              max_new_tokens=8), timeout=30))
    assert sum(len(c.token_ids) for c in chunks) == 8 and held.is_alive()
    tokenizer.gate.set()
    held.join(60)
    assert len(outcome["response"].token_ids) == 3


def test_deadline_is_counted_as_deadline_exceeded(service):
    before = counts(service)
    with pytest.raises(grpc.RpcError) as info:
        service.stub.Generate(generation_pb2.GenerateRequest(prompt_token_ids=[3, 1, 4], max_new_tokens=900),
                              timeout=0.5)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    expect_counts(service, before, DEADLINE_EXCEEDED=1, CANCELLED=0, UNKNOWN=0)


def test_client_cancel_mid_stream_is_counted_as_cancelled(service):
    before = counts(service)
    for _ in range(3):
        call = service.stub.GenerateStream(generation_pb2.GenerateRequest(prompt_token_ids=[3, 1], max_new_tokens=900))
        next(call)
        call.cancel()
    expect_counts(service, before, CANCELLED=3, UNKNOWN=0, DEADLINE_EXCEEDED=0)


def test_cancel_before_the_request_is_read_is_counted(service):
    """The client opens the call and cancels it before its message arrives."""
    before = counts(service)
    sent = threading.Event()

    def never():
        sent.wait(30)
        yield b""
    call = service.channel.stream_unary(GENERATE).future(never())
    time.sleep(0.5)
    call.cancel()
    sent.set()
    expect_counts(service, before, CANCELLED=1, UNKNOWN=0, INVALID_ARGUMENT=0)


@pytest.mark.parametrize("payload, code, details", [
    (b"\xff\xff\xff", grpc.StatusCode.INVALID_ARGUMENT, "request: not a specpool.v1.GenerateRequest"),
    (b"\x0a" + b"\xff" * 10, grpc.StatusCode.INVALID_ARGUMENT, "request: not a specpool.v1.GenerateRequest"),
    (bytes(generation_pb2.GenerateRequest(prompt="x" * (5 << 20)).SerializeToString()),
     grpc.StatusCode.RESOURCE_EXHAUSTED, "request: "),
])
def test_corrupt_and_oversized_messages_are_answered_and_counted(service, payload, code, details):
    before = counts(service)
    with pytest.raises(grpc.RpcError) as info:
        service.channel.unary_unary(GENERATE)(payload, timeout=30)      # raw bytes, no serializer
    assert info.value.code() == code and info.value.details().startswith(details), info.value.details()
    expect_counts(service, before, **{code.name: 1, "UNKNOWN": 0})
    assert len(service.stub.Generate(generation_pb2.GenerateRequest(prompt_token_ids=[5], max_new_tokens=2)).token_ids) == 2
