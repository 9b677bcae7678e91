"""Bad input gets INVALID_ARGUMENT naming the field, and the server keeps serving."""
import grpc
import pytest

from protos.specpool.v1 import generation_pb2
from tests.conftest import service_config

VALID = dict(prompt_token_ids=[5, 6, 7], max_new_tokens=4)


@pytest.fixture(scope="module")
def service(start_service, byte_pair):
    return start_service(service_config(byte_pair, speculation={"k": 2, "k_max": 8}))


def request(**fields):
    sampling = fields.pop("sampling", {})
    speculation = fields.pop("speculation", {})
    req = generation_pb2.GenerateRequest(**{**VALID, **fields})
    for key, value in sampling.items():
        if isinstance(value, dict):
            getattr(req.sampling, key).update(value)        # a map field: updated, never assigned
        elif isinstance(value, list):
            getattr(req.sampling, key).extend(value)        # a repeated field: extended
        else:
            setattr(req.sampling, key, value)
    for key, value in speculation.items():
        setattr(req.speculation, key, value)
    return req


BAD = {
    "empty prompt": (dict(prompt_token_ids=[]), "prompt"),
    "empty text prompt": (dict(prompt_token_ids=[], prompt=""), "prompt"),
    "prompt and ids": (dict(prompt="hi"), "prompt"),
    "id above vocab": (dict(prompt_token_ids=[5, 257]), "prompt_token_ids[1]"),
    "negative id": (dict(prompt_token_ids=[-1]), "prompt_token_ids[0]"),
    "max_new_tokens 0": (dict(max_new_tokens=0), "max_new_tokens"),
    "over context": (dict(max_new_tokens=5000), "max_new_tokens"),
    "negative temperature": (dict(sampling={"temperature": -0.5}), "sampling.temperature"),
    "nan temperature": (dict(sampling={"temperature": float("nan")}), "sampling.temperature"),
    "top_p zero": (dict(sampling={"top_p": 0.0}), "sampling.top_p"),
    "top_p above one": (dict(sampling={"top_p": 1.5}), "sampling.top_p"),
    "negative top_k": (dict(sampling={"top_k": -1}), "sampling.top_k"),
    "frequency_penalty above 2": (dict(sampling={"frequency_penalty": 2.5}), "sampling.frequency_penalty"),
    "nan presence_penalty": (dict(sampling={"presence_penalty": float("nan")}), "sampling.presence_penalty"),
    "presence_penalty below -2": (dict(sampling={"presence_penalty": -2.5}), "sampling.presence_penalty"),
    "repetition_penalty zero": (dict(sampling={"repetition_penalty": 0.0}), "sampling.repetition_penalty"),
    "infinite repetition_penalty": (dict(sampling={"repetition_penalty": float("inf")}),
                                    "sampling.repetition_penalty"),
    "logit_bias token outside vocab": (dict(sampling={"logit_bias": {257: 1.0}}), "sampling.logit_bias"),
    "logit_bias above 100": (dict(sampling={"logit_bias": {5: 101.0}}), "sampling.logit_bias"),
    "min_p above one": (dict(sampling={"min_p": 1.5}), "sampling.min_p"),
    "nan min_p": (dict(sampling={"min_p": float("nan")}), "sampling.min_p"),
    "min_new_tokens above max_new_tokens": (dict(min_new_tokens=5), "min_new_tokens"),
    "malformed regex": (dict(structured_output=generation_pb2.StructuredOutput(regex="a[b")),
                        "structured_output.regex"),
    "schema not JSON": (dict(structured_output=generation_pb2.StructuredOutput(json_schema="{")),
                        "structured_output.json_schema"),
    "structured output ignoring EOS": (dict(structured_output=generation_pb2.StructuredOutput(json_object=True),
                                            ignore_eos=True), "ignore_eos"),
    "allowed token outside vocab": (dict(sampling={"allowed_token_ids": [5, 300]}), "sampling.allowed_token_ids[1]"),
    "allowed tokens beside a structure": (dict(sampling={"allowed_token_ids": [5]}, structured_output=
                                               generation_pb2.StructuredOutput(regex="a")), "sampling.allowed_token_ids"),
    "only stop tokens allowed before min_new_tokens": (dict(sampling={"allowed_token_ids": [5]}, stop_token_ids=[5],
                                                            min_new_tokens=2), "sampling.allowed_token_ids"),
    "empty bad word": (dict(bad_words=["fine", ""]), "bad_words[1]"),
    "k above k_max": (dict(speculation={"k": 9}), "speculation.k"),
    "stop id outside vocab": (dict(stop_token_ids=[300]), "stop_token_ids[0]"),
}


@pytest.mark.parametrize("mode", ["unary", "stream"])
@pytest.mark.parametrize("case", list(BAD))
def test_invalid_argument_names_the_field(service, case, mode):
    fields, field_name = BAD[case]
    call = service.stub.Generate if mode == "unary" else lambda r: list(service.stub.GenerateStream(r))
    with pytest.raises(grpc.RpcError) as info:
        call(request(**fields))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(field_name + ":"), info.value.details()
    assert len(service.stub.Generate(request()).token_ids) == 4        # still serving


def test_oversized_message_is_refused(service):
    with pytest.raises(grpc.RpcError) as info:
        service.stub.Generate(request(prompt="x" * (5 * 1024 * 1024), prompt_token_ids=[]))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(service.stub.Generate(request()).token_ids) == 4
