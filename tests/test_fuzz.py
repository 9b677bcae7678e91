"""Fuzz the public API: 500+ random and edge-case requests each get OK or a clean status, and the
server stays healthy. An INVALID_ARGUMENT names the offending field of GenerateRequest first, as its
path ("sampling.top_p: ...", "stop_token_ids[2]: ...")."""
import re

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from protos.specpool.v1 import generation_pb2
from tests.conftest import service_config

CLEAN = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
INT32 = st.one_of(st.integers(-5, 300), st.sampled_from([-2**31, 2**31 - 1, 256, 257]))
FIELD_PATH = re.compile(r"([a-z_]+(?:\.[a-z_]+)*)(?:\[(\d+)\])?: \S")
SOMETIMES = st.integers(0, 3).map(lambda n: n == 0)
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, 1.0, 1e-30]))
# Valid requests but for one field each, so that every check the assertions below name is reached whatever the
# generator draws (which examples it draws shifted with unrelated changes to the process).
ALL_RIGHT = generation_pb2.GenerateRequest(prompt_token_ids=[1, 2], max_new_tokens=2)     # an OK whatever is drawn
ONE_WRONG = [generation_pb2.GenerateRequest(**{"prompt_token_ids": [1, 2], "max_new_tokens": 2, **wrong}) for wrong in
             ({"max_new_tokens": 0}, {"sampling": {"temperature": -1.0}}, {"sampling": {"top_p": 1.5}},
              {"speculation": {"k": 9}})]


@st.composite
def requests(draw):
    request = generation_pb2.GenerateRequest(
        max_new_tokens=draw(st.sampled_from([0, 1, 2, 3, 4, 1025, 5000, 2**32 - 1])),
        stop_token_ids=draw(st.lists(INT32, max_size=3)),
        request_id=draw(st.text(max_size=300)))
    if draw(st.booleans()):
        request.prompt = draw(st.text(max_size=40))
    if draw(st.booleans()):
        request.prompt_token_ids.extend(draw(st.lists(INT32, max_size=12)))
    request.sampling.temperature = draw(FLOATS)
    if draw(st.booleans()):
        request.sampling.top_p = draw(FLOATS)
    request.sampling.top_k = draw(st.sampled_from([-1, 0, 1, 5, 2**31 - 1]))
    if draw(st.booleans()):
        request.sampling.seed = draw(st.integers(0, 2**64 - 1))
    if draw(st.booleans()):
        request.sampling.frequency_penalty, request.sampling.presence_penalty = draw(FLOATS), draw(FLOATS)
    if draw(st.booleans()):
        request.sampling.repetition_penalty = draw(FLOATS)
    if draw(st.booleans()):
        request.sampling.logit_bias[draw(INT32)] = draw(FLOATS)
    if draw(SOMETIMES):           # fields added since, drawn less often, so that some requests stay valid
        request.sampling.min_p = draw(st.one_of(FLOATS, st.sampled_from([0.05, 0.5])))
    if draw(SOMETIMES):
        request.min_new_tokens = draw(st.sampled_from([0, 1, 4, 2**32 - 1]))
    if draw(SOMETIMES):
        request.structured_output.regex = draw(st.sampled_from(["[0-9]+", "a[b", r"[^\s\S]", "", "(x|y)*"]))
    if draw(SOMETIMES):
        request.sampling.allowed_token_ids.extend(draw(st.lists(INT32, max_size=3)))
    if draw(SOMETIMES):
        request.bad_words.extend(draw(st.lists(st.text(max_size=5), max_size=3)))
    if draw(SOMETIMES):
        request.prompt_logprobs = draw(st.sampled_from([0, 2, 21]))
    if draw(st.booleans()):
        request.speculation.k = draw(st.sampled_from([0, 1, 3, 8, 9, 2**32 - 1]))
    request.speculation.disable = draw(st.booleans())
    return request


def named_field(request: generation_pb2.GenerateRequest, details: str, vocab_size: int) -> str:
    """The field path an INVALID_ARGUMENT message starts with; asserts that it is a field of the request
    (and, for "name[i]: ", an element that is there: a token ID outside the vocabulary, or a string of a length
    refused)."""
    match = FIELD_PATH.match(details)
    assert match, f"does not start with a field path: {details!r}"
    path, index = match.groups()
    message, value, field = request, None, None
    for part in path.split("."):
        assert message is not None and part in message.DESCRIPTOR.fields_by_name, (path, details)
        field, value = message.DESCRIPTOR.fields_by_name[part], getattr(message, part)
        message = value if hasattr(value, "DESCRIPTOR") else None
    if index is not None:
        assert field.is_repeated and int(index) < len(value), (path, index, details)
        element = value[int(index)]
        assert (not 1 <= len(element) <= 256) if isinstance(element, str) else not 0 <= element < vocab_size, \
            (path, index, list(value))
    return path


@pytest.fixture(scope="module")
def service(start_service, byte_pair):
    return start_service(service_config(byte_pair, speculation={"k": 2, "k_max": 8}))


def test_fuzzed_requests_get_ok_or_a_clean_status(service):
    seen, fields = {}, set()
    vocab_size = service.service.router.model_info["vocab_size"]

    @settings(max_examples=520, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(requests())
    @example(ALL_RIGHT)
    @example(ONE_WRONG[0])
    @example(ONE_WRONG[1])
    @example(ONE_WRONG[2])
    @example(ONE_WRONG[3])
    def check(request):
        try:
            response = service.stub.Generate(request, timeout=60)
            code = grpc.StatusCode.OK
            assert 1 <= len(response.token_ids) <= request.max_new_tokens
        except grpc.RpcError as exc:
            code = exc.code()
            assert code in CLEAN, (code, exc.details(), request)
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                fields.add(named_field(request, exc.details(), vocab_size))
        seen[code] = seen.get(code, 0) + 1
    check()
    assert sum(seen.values()) >= 500
    assert seen.get(grpc.StatusCode.OK, 0) > 0 and seen.get(grpc.StatusCode.INVALID_ARGUMENT, 0) > 0
    # the fuzzed requests break several fields, and each refusal named the one it was about
    assert {"max_new_tokens", "sampling.temperature", "sampling.top_p", "speculation.k"} <= fields, fields
    channel = grpc.insecure_channel(service.address)
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="")).status
    channel.close()
    assert status == health_pb2.HealthCheckResponse.SERVING
