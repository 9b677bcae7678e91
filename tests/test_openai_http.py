"""The OpenAI-compatible HTTP API against a served demo pair, with the real `openai` SDK (sync, async,
streaming) and raw HTTP: greedy text identical to gRPC and to the target alone, usage, SSE framing and
[DONE], stop strings across token boundaries, logprobs equal to the target's own forward, every error
status, and a client that disconnects mid-stream freeing the workers' sessions."""
import asyncio
import contextlib
import itertools
import json
import logging
import time
import types
from pathlib import Path
from typing import Iterator

import grpc
import httpx
import openai
import pytest
import torch

from protos.specpool.v1 import generation_pb2
from tests import penalized_reference
from tests.conftest import service_config
from tests.test_e2e_sessions import active_sessions, wait_for_no_sessions

DEMO = Path(__file__).resolve().parent.parent / "deploy" / "models" / "demo-pair"
PROMPT = "def __init__(self"


def served_over_http(start_service, http: dict | None = None, **overrides):
    """The demo pair served with HTTP on (the hermes tool-call parser, and `http`) at K = 3, and an OpenAI client of
    it."""
    pair = (str(DEMO / "draft"), str(DEMO / "target"))
    http = {"port": 0, "tool_call_parser": "hermes", **(http or {})}
    running = start_service(service_config(pair, http=http, speculation={"k": 3}, **overrides))
    running.base_url = f"http://127.0.0.1:{running.service.http_port}/v1"
    running.client = openai.OpenAI(base_url=running.base_url, api_key="unused", max_retries=0)
    running.model = running.client.models.list().data[0].id
    return running


def demo_target() -> tuple:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    return (AutoModelForCausalLM.from_pretrained(DEMO / "target").eval(), AutoTokenizer.from_pretrained(DEMO / "target"))


@pytest.fixture(scope="module")
def served(start_service):
    return served_over_http(start_service, http={"store_responses": 0},       # no Responses API store
                            router={"max_active_requests": 2, "max_queued_requests": 0})


@pytest.fixture(scope="module")
def target():
    return demo_target()


def greedy_alone(target, prompt: str, max_new_tokens: int) -> list[int]:
    model, tokenizer = target
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)[0, ids.shape[1]:].tolist()
    eos = tokenizer.eos_token_id
    return out[:out.index(eos) + 1] if eos in out else out


def requests_counted(served, code: str) -> float:
    return served.service.router.metrics.requests.labels(code)._value.get()


def test_models_and_health(served, target):
    assert served.model == "target"
    card = httpx.get(served.base_url + "/models").json()["data"][0]
    assert card["root"] == str(DEMO / "target") and card["max_model_len"] == target[0].config.max_position_embeddings
    assert served.client.models.retrieve("target").model_dump(exclude_unset=True) == card   # GET /v1/models/{id}
    other = httpx.get(served.base_url + "/models/org/other-model")
    assert (other.status_code, other.json()["error"]["code"]) == (404, "model_not_found")
    assert httpx.get(served.base_url.removesuffix("/v1") + "/health").status_code == 200


def test_sdk_completion_greedy_matches_grpc_and_target_alone(served, target):
    tokens = greedy_alone(target, PROMPT, 24)
    ok = requests_counted(served, "OK")
    # K pinned for both: under the adaptive policy the second request may choose other K's (and passes) than the
    # first, since the pool's statistics moved in between
    answer = served.client.completions.create(model=served.model, prompt=PROMPT, max_tokens=24, temperature=0,
                                              extra_body={"speculation": {"k": 3}})
    assert requests_counted(served, "OK") == ok + 1                # the same metrics as gRPC
    grpc_request = generation_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=24)
    grpc_request.speculation.k = 3
    grpc_answer = served.stub.Generate(grpc_request)
    assert answer.choices[0].text == target[1].decode(tokens, skip_special_tokens=True) == grpc_answer.text
    prompt_len = len(target[1](PROMPT).input_ids)
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens, answer.usage.total_tokens) == (
        prompt_len, len(tokens), prompt_len + len(tokens))
    stats = answer.model_extra["specpool"]
    assert stats["target_passes"] == grpc_answer.stats.target_passes and stats["draft_tokens"] > 0
    assert answer.choices[0].finish_reason == "length"


def test_usage_counts_the_prompt_tokens_found_in_the_prefix_cache(served):
    """A prompt whose first blocks an earlier request left in the target's prefix cache: usage counts them in
    prompt_tokens_details.cached_tokens (whole blocks of 16, short of the prompt's last token), whole or streamed,
    and the text is what the first request got."""
    prompt = ("import os\nimport sys\n\n\nclass PrefixConfig:\n    def __init__(self, path, mode):\n"
              "        self.path = path\n        self.mode = mode\n\n    def read(self):\n"
              "        with open(self.path) as f:\n            return f.read()\n")
    body = dict(model=served.model, prompt=prompt, max_tokens=8, temperature=0, extra_body={"speculation": {"k": 3}})
    first, second = served.client.completions.create(**body), served.client.completions.create(**body)
    streamed = list(served.client.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    assert second.choices[0].text == first.choices[0].text == "".join(c.choices[0].text for c in streamed[:-1])
    blocks = (second.usage.prompt_tokens - 1) // 16 * 16
    assert blocks >= 32 and first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == blocks
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == blocks


def test_a_follow_up_that_repeats_the_last_answer_finds_it_cached(served):
    """As a chat's next turn does: a prompt that is the last prompt, its completion and more finds the blocks of the
    completion too (the target left all it committed in its prefix cache when the last request ended)."""
    prompt = "class FollowUp:\n    def __init__(self, first, second):\n        self.first = first\n"
    first = served.client.completions.create(model=served.model, prompt=prompt, max_tokens=48, temperature=0)
    assert wait_for_no_sessions(served) == [0, 0]             # released in the background as a request ends
    follow_up = prompt + first.choices[0].text + "\n\n# and then\n"
    second = served.client.completions.create(model=served.model, prompt=follow_up, max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens + 32, (
        first.usage, second.usage)


def test_a_completion_without_stream_is_read_whole_and_one_with_stream_is_streamed(served, target):
    """Without `stream` the client reads the output whole, so a K = 0 decode run holds its answers
    (unstreamed_answer_delay_ms, here longer than the run: its first token, then the rest); with `stream` each
    step goes at once (answer_delay_ms 0 here). The text is the same."""
    before = served.reload(speculation={"answer_delay_ms": 0, "unstreamed_answer_delay_ms": 10_000})
    body = dict(model=served.model, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"speculation": {"k": 0}})
    try:
        whole = served.client.completions.create(**body)
        chunks = list(served.client.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    finally:
        served.reload(**before)
    tokens = greedy_alone(target, PROMPT, 24)
    assert whole.choices[0].text == "".join(c.choices[0].text for c in chunks if c.choices)
    assert whole.model_extra["specpool"]["target_answers"] == 2
    assert chunks[-1].model_extra["specpool"]["target_answers"] == len(tokens)


def test_sdk_streaming_completion_and_n(served, target):
    expected = target[1].decode(greedy_alone(target, PROMPT, 20), skip_special_tokens=True)
    chunks = list(served.client.completions.create(model=served.model, prompt=PROMPT, max_tokens=20, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    two = served.client.completions.create(model=served.model, prompt=PROMPT, max_tokens=12, temperature=0.9,
                                           seed=7, n=2)
    again = served.client.completions.create(model=served.model, prompt=PROMPT, max_tokens=12, temperature=0.9,
                                             seed=7, n=2)
    assert [c.index for c in two.choices] == [0, 1] and two.usage.completion_tokens == 24
    assert [c.text for c in two.choices] == [c.text for c in again.choices]     # seed, seed + 1


def test_async_sdk_chat_streaming_and_unary(served, target):
    messages = [{"role": "user", "content": "a class with an init"}]
    prompt = target[1].apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = target[1].decode(greedy_alone(target, prompt, 16), skip_special_tokens=True)

    async def ask():
        client = openai.AsyncOpenAI(base_url=served.base_url, api_key="unused", max_retries=0)
        unary = await client.chat.completions.create(model=served.model, messages=messages, max_tokens=16,
                                                     temperature=0)
        stream = await client.chat.completions.create(model=served.model, messages=messages, max_tokens=16,
                                                      temperature=0, stream=True,
                                                      stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        await client.close()
        return unary, chunks
    unary, chunks = asyncio.run(ask())
    assert unary.choices[0].message.content == expected and unary.choices[0].message.role == "assistant"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.prompt_tokens == unary.usage.prompt_tokens == len(target[1](prompt).input_ids)


def sse_events(response: httpx.Response) -> list[str]:
    body = response.read().decode()
    assert body.endswith("\n\n")
    events = body.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    return [e.removeprefix("data: ") for e in events]


def test_raw_sse_framing(served):
    body = {"model": served.model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", served.base_url + "/completions", json=body) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    assert all(p["object"] == "text_completion" and "usage" not in p for p in payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    with httpx.stream("POST", served.base_url + "/chat/completions", json={
            **body, "prompt": None, "messages": [{"role": "user", "content": "x"}], "n": 2, "temperature": 0.7,
            "seed": 3, "stream_options": {"include_usage": True}}) as response:
        payloads = [json.loads(e) for e in sse_events(response)[:-1]]
    finished = [c["index"] for p in payloads for c in p["choices"] if c["finish_reason"] == "length"]
    assert sorted(finished) == [0, 1] and payloads[-1]["usage"]["completion_tokens"] == 16    # n=2 interleaved


@pytest.mark.parametrize("body, param", [
    ({"temperature": -1}, "temperature"), ({"top_p": 1.5}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10 ** 6}, "max_tokens"), ({"logprobs": 50}, "logprobs"), ({"stop": [""]}, "stop"),
    ({"n": 0}, "n"), ({"prompt": ""}, "prompt"), ({"speculation": {"k": 99}}, "speculation.k"),
    ({"prompt": [10 ** 6]}, "prompt"), ({"stop_token_ids": [10 ** 6]}, "stop_token_ids"),
    ({"speculation": {"kk": 3}}, "speculation.kk"), ({"echo": 1}, "echo"), ({"user": 5}, "user"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"), ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"), ({"prompt_logprobs": "2"}, "prompt_logprobs"),
])
def test_400_names_the_parameter(served, body, param):
    refused = requests_counted(served, "INVALID_ARGUMENT")
    response = httpx.post(served.base_url + "/completions",
                          json={"model": served.model, "prompt": PROMPT, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    assert "prompt_token_ids" not in error["message"] and "max_new_tokens" not in error["message"]   # gRPC's names
    assert requests_counted(served, "INVALID_ARGUMENT") == refused + 1


def test_every_refused_generation_request_is_counted_under_its_grpc_code(served):
    """specpool_requests_total counts HTTP requests as gRPC's: bad JSON and unknown or refused parameters as
    INVALID_ARGUMENT, an unknown model as NOT_FOUND; other routes' errors are not generation requests."""
    json_type = {"Content-Type": "application/json"}
    refusals = [("INVALID_ARGUMENT", "/completions", b"not json"), ("INVALID_ARGUMENT", "/chat/completions", b"{"),
                ("INVALID_ARGUMENT", "/completions", json.dumps({"model": served.model, "prompt": PROMPT,
                                                                 "suffix": "}"}).encode()),
                ("NOT_FOUND", "/completions", json.dumps({"model": "gpt-4", "prompt": PROMPT}).encode()),
                ("NOT_FOUND", "/chat/completions", json.dumps({"model": "gpt-4", "messages": [
                    {"role": "user", "content": "x"}]}).encode())]
    for code, path, content in refusals:
        before = requests_counted(served, code)
        assert httpx.post(served.base_url + path, content=content, headers=json_type).status_code >= 400
        assert requests_counted(served, code) == before + 1, (code, path, content)
    before = {code: requests_counted(served, code) for code in ("INVALID_ARGUMENT", "NOT_FOUND")}
    assert httpx.get(served.base_url + "/nowhere").status_code == 404
    assert httpx.post(served.base_url + "/models", content=b"{", headers=json_type).status_code == 405
    assert {code: requests_counted(served, code) for code in before} == before


BIG = 10 ** 11      # over every 32-bit field


@pytest.mark.parametrize("path, body, param", [
    ("/completions", {"max_tokens": BIG}, "max_tokens"), ("/completions", {"top_k": BIG}, "top_k"),
    ("/completions", {"top_k": -BIG}, "top_k"), ("/completions", {"prompt": [BIG]}, "prompt"),
    ("/completions", {"prompt": [-BIG]}, "prompt"), ("/completions", {"speculation": {"k": BIG}}, "speculation.k"),
    ("/completions", {"seed": 2 ** 64}, "seed"), ("/completions", {"seed": -1}, "seed"),
    ("/completions", {"logprobs": BIG}, "logprobs"), ("/completions", {"n": BIG}, "n"),
    ("/completions", {"prompt": "\ud800"}, "prompt"), ("/completions", {"stop": ["\udfff"]}, "stop"),
    ("/completions", {"model": "\ud800"}, "model"),
    ("/chat/completions", {"max_completion_tokens": BIG}, "max_completion_tokens"),
    ("/chat/completions", {"max_tokens": BIG}, "max_tokens"),
    ("/chat/completions", {"top_logprobs": BIG}, "top_logprobs"),
    ("/chat/completions", {"top_logprobs": 2}, "top_logprobs"),          # without logprobs: true, as OpenAI
    ("/chat/completions", {"top_logprobs": 0, "logprobs": False}, "top_logprobs"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    ("/completions", {"stop_token_ids": [BIG]}, "stop_token_ids"), ("/completions", {"n": 17}, "n"),
])
def test_out_of_range_values_are_400_naming_the_parameter(served, path, body, param):
    """Integers outside their protobuf field's range, and text that is not Unicode (a lone surrogate), are
    refused when the body is read, as any other invalid parameter (not a 500 from building the request)."""
    assert_refused_naming(served, path, body, param)


def assert_refused_naming(served, path: str, body: dict, param: str) -> dict:
    """`body` (over a valid one) is a 400 naming `param`, in `param` and at the start of the message; the
    valid one is served afterwards. The error."""
    base = {"model": served.model, "prompt": PROMPT, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    json_type = {"Content-Type": "application/json"}
    content = json.dumps({**base, **body})     # ASCII: a surrogate as its \u escape, inf as Infinity (not json=)
    refused = requests_counted(served, "INVALID_ARGUMENT")
    response = httpx.post(served.base_url + path, content=content, headers=json_type)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(param) and error["type"] == "invalid_request_error"
    assert requests_counted(served, "INVALID_ARGUMENT") == refused + 1       # counted once, as gRPC counts it
    assert httpx.post(served.base_url + path, content=json.dumps(base), headers=json_type).status_code == 200
    return error


@pytest.mark.parametrize("path, body, param", [
    ("/completions", {"max_tokens": "4"}, "max_tokens"), ("/completions", {"max_tokens": 4.0}, "max_tokens"),
    ("/completions", {"n": 1.0}, "n"), ("/completions", {"n": "1"}, "n"), ("/completions", {"seed": "7"}, "seed"),
    ("/completions", {"top_k": 40.0}, "top_k"), ("/completions", {"logprobs": True}, "logprobs"),
    ("/completions", {"prompt": [1.0]}, "prompt"), ("/completions", {"speculation": {"k": "3"}}, "speculation.k"),
    ("/completions", {"stop_token_ids": ["14"]}, "stop_token_ids"),
    ("/chat/completions", {"max_completion_tokens": 4.0}, "max_completion_tokens"),
    ("/chat/completions", {"top_logprobs": "2", "logprobs": True}, "top_logprobs"),
])
def test_integer_parameters_take_json_integers_only(served, path, body, param):
    """As OpenAI's API: "4", 4.0 or true is not an integer parameter (a float parameter, temperature, still
    takes an integer: the other tests send 0)."""
    assert_refused_naming(served, path, body, param)


@pytest.mark.parametrize("path, body, param", [
    ("/completions", {"temperature": "0.5"}, "temperature"), ("/completions", {"temperature": True}, "temperature"),
    ("/completions", {"top_p": "1"}, "top_p"), ("/completions", {"top_p": True}, "top_p"),
    ("/chat/completions", {"temperature": "1"}, "temperature"),
    ("/chat/completions", {"temperature": False}, "temperature"),
])
def test_float_parameters_refuse_strings_and_booleans(served, path, body, param):
    """As OpenAI's API: a float parameter takes a JSON number (an integer too: temperature 1, as the other tests
    send), never "0.5" or true."""
    assert_refused_naming(served, path, body, param)


@pytest.mark.parametrize("path, body, param", [
    ("/completions", {"temperature": float("inf")}, "temperature"), ("/completions", {"top_p": float("nan")}, "top_p"),
    ("/completions", {"top_p": float("inf")}, "top_p"), ("/chat/completions", {"top_p": -float("inf")}, "top_p"),
])
def test_non_finite_numbers_are_refused_when_the_body_is_read(served, path, body, param):
    """Python's JSON parser reads NaN, Infinity and -Infinity (and 1e400 as infinity): a float parameter
    refuses them as it reads the body (pydantic's finite-number check), before any request reaches the router."""
    assert "finite" in assert_refused_naming(served, path, body, param)["message"]


@pytest.mark.parametrize("path, body, param", [
    ("/completions", {"stream": "yes"}, "stream"), ("/completions", {"stream": 1}, "stream"),
    ("/completions", {"echo": 0}, "echo"), ("/chat/completions", {"logprobs": 1}, "logprobs"),
    ("/chat/completions", {"logprobs": "true"}, "logprobs"),
    ("/completions", {"stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ("/completions", {"speculation": {"disable": "no"}}, "speculation.disable"),
])
def test_boolean_parameters_take_json_booleans_only(served, path, body, param):
    """As OpenAI's API: 1, 0, "yes" or "true" is not a boolean parameter."""
    assert_refused_naming(served, path, body, param)


@pytest.mark.parametrize("path, body, param", [
    ("/completions", {"temperature": 2.5}, "temperature"), ("/chat/completions", {"temperature": 3}, "temperature"),
    ("/completions", {"temperature": 1e300}, "temperature"),
])
def test_temperature_above_two_is_refused_naming_it(served, path, body, param):
    """As OpenAI's API: temperature is 0 to 2 (2 itself is served), refused as the body is read (1e300 too,
    which the float32 field would make infinity)."""
    assert "Input should be" in assert_refused_naming(served, path, body, param)["message"]   # the body's check
    assert httpx.post(served.base_url + path, json={"model": served.model, "prompt": PROMPT, "max_tokens": 2,
                                                    "messages": [{"role": "user", "content": "x"}],
                                                    "temperature": 2}).status_code == 200


@pytest.mark.parametrize("path, top_p", [("/completions", 1.0000001), ("/chat/completions", 1.0000001),
                                         ("/completions", 0)])
def test_top_p_outside_zero_to_one_is_refused_as_the_body_is_read(served, path, top_p):
    """top_p is in (0, 1], checked on the JSON number: 1.0000001 would be 1.0 in the float32 field the router
    checks, and was served."""
    assert "Input should be" in assert_refused_naming(served, path, {"top_p": top_p}, "top_p")["message"]


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_stream_options_without_stream_is_refused(served, path):
    """As OpenAI's API: stream_options is only allowed with `stream: true` (not false, absent or null); an
    explicit `"stream_options": null` is absent, so allowed without it."""
    for stream in ({}, {"stream": False}, {"stream": None}):
        assert_refused_naming(served, path, {**stream, "stream_options": {"include_usage": True}}, "stream_options")
    body = {"model": served.model, "prompt": PROMPT, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    assert httpx.post(served.base_url + path, json={**body, "stream_options": None}).status_code == 200
    with httpx.stream("POST", served.base_url + path, json={**body, "stream": True, "stream_options": {
            "include_usage": True, "include_obfuscation": False}}) as response:
        assert response.status_code == 200
        assert 0 < json.loads(sse_events(response)[-2])["usage"]["completion_tokens"] <= 2
    with httpx.stream("POST", served.base_url + path, json={**body, "stream": True, "max_tokens": 8, "ignore_eos": True,
                                                            "stream_options": {
            "include_usage": True, "continuous_usage_stats": True}}) as response:       # vLLM's: usage on every chunk
        usages = [json.loads(e)["usage"] for e in sse_events(response)[:-1]]
    counts = [u["completion_tokens"] for u in usages]
    assert all(u is not None and u["prompt_tokens"] == usages[0]["prompt_tokens"] for u in usages)
    assert counts == sorted(counts) and counts[-1] == 8 and usages[-1]["total_tokens"] == usages[-1][
        "prompt_tokens"] + 8


@pytest.mark.parametrize("path, options, param", [
    ("/completions", {"bogus": 1}, "stream_options.bogus"),
    ("/chat/completions", {"include_usage": True, "includeUsage": True}, "stream_options.includeUsage"),
    ("/completions", {"bogus": None}, "stream_options.bogus"),
])
def test_an_unknown_stream_options_key_is_refused_naming_it(served, path, options, param):
    """stream_options takes OpenAI's include_usage and include_obfuscation only: a misspelt key (its null too)
    is a 400 naming it, not silently ignored."""
    assert_refused_naming(served, path, {"stream": True, "stream_options": options}, param)


def test_unknown_keys_of_messages_and_content_parts_are_accepted(served):
    """As OpenAI's API: a message's `name` (and any other key specpool does not use) is accepted, as is an
    unknown key of a content part; the reply is the same as without them."""
    plain = {"model": served.model, "max_tokens": 4, "temperature": 0,
             "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}
    extra = {**plain, "messages": [{"role": "user", "name": "ada", "refusal": None,
                                    "content": [{"type": "text", "text": "x", "cache_control": {}}]}]}
    answers = [httpx.post(served.base_url + "/chat/completions", json=body) for body in (plain, extra)]
    assert [a.status_code for a in answers] == [200, 200], answers[1].text
    assert answers[0].json()["choices"][0]["message"] == answers[1].json()["choices"][0]["message"]


def test_an_unknown_speculation_key_is_refused_even_when_null(served):
    """A null does not hide a misspelt key inside `speculation`; a known key's null is still absent."""
    assert_refused_naming(served, "/completions", {"speculation": {"kk": None}}, "speculation.kk")
    response = httpx.post(served.base_url + "/completions", json={
        "model": served.model, "prompt": PROMPT, "max_tokens": 2, "speculation": {"k": None, "disable": None}})
    assert response.status_code == 200, response.text


def test_unknown_keys_are_refused_inside_speculation_only(served):
    """Unknown top-level keys are ignored (OpenAI parameters that do not change the output, vendor
    extensions), but a key of specpool's own `speculation` object that it does not know is a misspelling,
    named in the 400."""
    body = {"model": served.model, "prompt": PROMPT, "max_tokens": 2, "metadata": {"team": "x"}, "vendor_key": 1}
    assert httpx.post(served.base_url + "/completions", json=body).status_code == 200
    response = httpx.post(served.base_url + "/completions", json={**body, "speculation": {"k": 1, "kk": 3}})
    error = openai_error(response, 400)
    assert (error["param"], error["message"]) == ("speculation.kk", "speculation.kk: unknown key")


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("path, body, param", [
    ("/completions", {"best_of": 2}, "best_of"),
    ("/completions", {"best_of": 3, "n": 2}, "best_of"), ("/completions", {"best_of": 1.0}, "best_of"),
    ("/completions", {"suffix": "\n}"}, "suffix"),
    ("/completions", {"tools": [TOOL]}, "tools"),          # chat's (openai_api/tools.py), as OpenAI has them
    ("/completions", {"functions": [TOOL["function"]]}, "functions"),     # chat's deprecated form is served
    ("/completions", {"function_call": "auto"}, "function_call"),
    ("/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("/chat/completions", {"verbosity": "high"}, "verbosity"),
    ("/chat/completions", {"web_search_options": {}}, "web_search_options"),
    ("/chat/completions", {"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
    ("/chat/completions", {"logits_processors": ["x"]}, "logits_processors"),
    ("/completions", {"truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
    ("/completions", {"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
    ("/completions", {"detokenize": False}, "detokenize"),
    ("/chat/completions", {"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
    ("/chat/completions", {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ("/chat/completions", {"chat_template": "{{ messages }}"}, "chat_template"),
    ("/chat/completions", {"documents": [{"title": "a", "text": "b"}]}, "documents"),
    ("/chat/completions", {"echo": True}, "echo"),
])
def test_output_changing_parameters_specpool_lacks_are_refused_naming_them(served, path, body, param):
    """An OpenAI parameter that would change the output and that specpool does not implement (best_of, suffix, tools
    in a completion, audio, reasoning, ...) is a 400 naming it and the
    value it takes, not silently ignored (a boolean is not 0, a float not n); the server keeps serving."""
    error = assert_refused_naming(served, path, body, param)
    assert error["message"].startswith(f"{param}: not supported by specpool (only ")


def test_reasoning_effort_is_refused_in_a_completion_and_where_the_chat_template_does_not_read_it(served):
    """Chat's reasoning_effort reaches a template that reads it (gpt-oss's; tests/test_chat_template.py); the demo
    pair's does not, so there it would change nothing: a 400 naming it, as in a completion."""
    error = assert_refused_naming(served, "/chat/completions", {"reasoning_effort": "low"}, "reasoning_effort")
    assert "chat template does not read it" in error["message"]
    error = assert_refused_naming(served, "/completions", {"reasoning_effort": "low"}, "reasoning_effort")
    assert error["message"].startswith("reasoning_effort: not supported by specpool (only ")


@pytest.mark.parametrize("path, body, param", [
    ("/completions", {"frequency_penalty": 2.5}, "frequency_penalty"),
    ("/completions", {"frequency_penalty": False}, "frequency_penalty"),
    ("/chat/completions", {"presence_penalty": -3}, "presence_penalty"),
    ("/chat/completions", {"presence_penalty": "0.5"}, "presence_penalty"),
    ("/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/chat/completions", {"repetition_penalty": -1.2}, "repetition_penalty"),
    ("/completions", {"logit_bias": {"x": 1}}, "logit_bias"), ("/completions", {"logit_bias": {"5": 101}}, "logit_bias.5"),
    ("/chat/completions", {"logit_bias": {"99999": 1}}, "logit_bias"),
    ("/completions", {"min_p": 1.5}, "min_p"), ("/chat/completions", {"min_p": "0.1"}, "min_p"),
    ("/completions", {"min_tokens": -1}, "min_tokens"), ("/completions", {"min_tokens": 2.0}, "min_tokens"),
    ("/completions", {"allowed_token_ids": []}, "allowed_token_ids"),
    ("/completions", {"allowed_token_ids": [5, 99999]}, "allowed_token_ids"),
    ("/completions", {"allowed_token_ids": ["5"]}, "allowed_token_ids"),
    ("/completions", {"allowed_token_ids": [5], "guided_regex": "a"}, "allowed_token_ids"),
    ("/completions", {"bad_words": ["ok", ""]}, "bad_words"), ("/completions", {"bad_words": "x"}, "bad_words"),
])
def test_penalties_out_of_range_or_of_another_type_are_refused_naming_them(served, path, body, param):
    """frequency_penalty and presence_penalty in OpenAI's [-2, 2], repetition_penalty > 0, each a JSON number;
    logit_bias's keys token IDs of the vocabulary, its values in [-100, 100]; min_p in [0, 1]; min_tokens a whole
    number >= 0."""
    assert_refused_naming(served, path, body, param)


def test_min_tokens_above_max_tokens_is_refused_naming_both_as_sent(served):
    error = assert_refused_naming(served, "/completions", {"min_tokens": 9, "max_tokens": 4}, "min_tokens")
    assert error["message"] == "min_tokens: must be <= max_tokens=4 (got 9)"
    error = assert_refused_naming(served, "/chat/completions", {"min_tokens": 9, "max_completion_tokens": 4},
                                  "min_tokens")
    assert error["message"] == "min_tokens: must be <= max_completion_tokens=4 (got 9)"


def test_sdk_completion_with_min_tokens_goes_on_past_the_stop_token_the_target_alone_writes(served, target):
    """vLLM's min_tokens (in the body), greedy at K = 3 through the whole stack: the stop token the target alone
    writes third is kept out of the first 8 tokens, so the output is the target alone's under that rule, and the
    gRPC request's (min_new_tokens)."""
    model, tokenizer = target
    prompt_ids = tokenizer(PROMPT).input_ids
    plain = penalized_reference.greedy(model, prompt_ids, 12)
    ends = (plain[2], model.generation_config.eos_token_id)
    expected = penalized_reference.greedy(model, prompt_ids, 12, min_tokens=8, ends=ends)
    expected = expected[:next(i for i, t in enumerate(expected) if t in ends or i == 11) + 1]   # to the stop
    assert len(expected) > 8 and expected[:3] != plain[:3]
    answer = served.client.completions.create(model=served.model, prompt=PROMPT, max_tokens=12, temperature=0,
                                              extra_body={"min_tokens": 8, "stop_token_ids": [plain[2]],
                                                          "speculation": {"k": 3}})
    grpc_request = generation_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=12, min_new_tokens=8,
                                                  stop_token_ids=[plain[2]])
    grpc_request.speculation.k = 3
    assert answer.usage.completion_tokens == len(expected)
    assert answer.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True) \
        == served.stub.Generate(grpc_request).text


def test_allowed_token_ids_give_the_target_alones_output_restricted_to_them(served, target):
    """vLLM's allowed_token_ids, greedy at K = 3 through the whole stack: the target alone's greedy output with every
    other token's logit -inf, which here differs from its plain output; gRPC's SamplingParams.allowed_token_ids alike."""
    model, tokenizer = target
    prompt_ids = tokenizer(PROMPT).input_ids
    plain = penalized_reference.greedy(model, prompt_ids, 12)
    allowed = tuple(sorted(set(plain[3:]) | {tokenizer.eos_token_id}))
    expected = penalized_reference.greedy(model, prompt_ids, 12, allowed=allowed)
    assert expected != plain and set(expected) <= set(allowed)
    answer = served.client.completions.create(model=served.model, prompt=PROMPT, max_tokens=12, temperature=0,
                                              extra_body={"allowed_token_ids": list(allowed), "speculation": {"k": 3}})
    grpc_request = generation_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=12)
    grpc_request.sampling.allowed_token_ids.extend(allowed)
    grpc_request.speculation.k = 3
    assert served.stub.Generate(grpc_request).token_ids == expected
    assert answer.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)


def test_bad_words_keep_a_word_the_target_alone_writes_out_of_the_output(served, target):
    """vLLM's bad_words, greedy at K = 3 through the whole stack: the output is the target alone's with the word's
    token sequences (router.text.word_sequences) banned as vLLM bans them, which here differs from its plain
    output; gRPC's GenerateRequest.bad_words alike."""
    from router.text import load_tokenizer, word_sequences
    model, tokenizer = target
    prompt_ids = tokenizer(PROMPT).input_ids
    plain = penalized_reference.greedy(model, prompt_ids, 16)
    word = next(text for i in range(len(plain) - 1) for text in [tokenizer.decode(plain[i:i + 2]).strip()] if text)
    words = tuple(word_sequences(load_tokenizer(str(DEMO / "target")), [word]))
    expected = penalized_reference.greedy(model, prompt_ids, 16, bad_words=words)
    assert expected != plain
    answer = served.client.completions.create(model=served.model, prompt=PROMPT, max_tokens=16, temperature=0,
                                              extra_body={"bad_words": [word], "speculation": {"k": 3}})
    assert answer.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    grpc_request = generation_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=16, bad_words=[word])
    assert served.stub.Generate(grpc_request).token_ids == expected


def test_sdk_completion_with_min_p_is_served_and_seeded_alike_on_both_apis(served):
    """vLLM's min_p (in the body) reaches the sampler: a seeded request's text is the gRPC request's with the same
    min_p (its distribution is tested on the engines, tests/test_min_p.py)."""
    answer = served.client.completions.create(model=served.model, prompt=PROMPT, max_tokens=8, temperature=1.0,
                                              seed=11, extra_body={"min_p": 0.3, "speculation": {"k": 3}})
    grpc_request = generation_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=8)
    grpc_request.sampling.temperature, grpc_request.sampling.seed, grpc_request.sampling.min_p = 1.0, 11, 0.3
    grpc_request.speculation.k = 3
    assert answer.choices[0].text == served.stub.Generate(grpc_request).text


def test_ignore_eos_is_a_json_boolean_that_reaches_the_generate_request(served):
    """vLLM's ignore_eos, which its serving benchmark sends: `true` or `false` only, passed on as
    GenerateRequest.ignore_eos (what it does is tested over a fake target, tests/test_ignore_eos.py)."""
    from openai_api.protocol import CompletionRequest, generate_request
    assert_refused_naming(served, "/completions", {"ignore_eos": 1}, "ignore_eos")
    body = CompletionRequest.model_validate({"model": "target", "prompt": PROMPT, "ignore_eos": True})
    assert generate_request(body, PROMPT, 4, None).ignore_eos
    answer = httpx.post(served.base_url + "/completions", json={"model": served.model, "prompt": PROMPT,
                                                                 "max_tokens": 4, "ignore_eos": True})
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4


def test_skip_special_tokens_false_keeps_the_special_tokens_text_on_both_apis(served, target):
    """vLLM's skip_special_tokens false (GenerateRequest.keep_special_tokens): EOS forced by logit_bias and gone past
    with ignore_eos is in the text as its tokenizer writes it, in a completion's text and logprob offsets and a
    chat message; by default it is left out. The token IDs are the same either way."""
    assert_refused_naming(served, "/completions", {"skip_special_tokens": 0}, "skip_special_tokens")
    tokenizer = target[1]
    eos = tokenizer.eos_token_id
    body = {"model": served.model, "prompt": PROMPT, "max_tokens": 3, "ignore_eos": True, "temperature": 0,
            "logit_bias": {str(eos): 100}, "logprobs": 0}
    kept = httpx.post(served.base_url + "/completions", json={**body, "skip_special_tokens": False}).json()
    left_out = httpx.post(served.base_url + "/completions", json=body).json()
    assert kept["choices"][0]["text"] == tokenizer.eos_token * 3 and left_out["choices"][0]["text"] == ""
    assert kept["choices"][0]["logprobs"]["text_offset"] == [0, len(tokenizer.eos_token), 2 * len(tokenizer.eos_token)]
    chat = served.client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=2, temperature=0,
                                                 logit_bias={str(eos): 100},
                                                 extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert chat.choices[0].message.content == tokenizer.eos_token * 2
    grpc_request = generation_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=3, ignore_eos=True,
                                                  keep_special_tokens=True)
    grpc_request.sampling.logit_bias[eos] = 100
    answer = served.stub.Generate(grpc_request)
    assert (list(answer.token_ids), answer.text) == ([eos] * 3, tokenizer.eos_token * 3)


def test_sdk_completion_with_penalties_and_logit_bias_matches_the_target_alone_with_them(served, target):
    """OpenAI's penalties and logit_bias (SDK parameters) and vLLM's repetition_penalty (in the body), greedy at K = 3
    through the whole stack, give the target alone's greedy output with the same ones, and the gRPC request's."""
    model, tokenizer = target
    plain = penalized_reference.greedy(model, tokenizer(PROMPT).input_ids, 24)
    bias = {plain[2]: -100.0, plain[5]: -2.5}                # bans the third token the target alone writes
    penalties = dict(frequency=0.5, presence=0.25, repetition=1.25, bias=bias)
    tokens = penalized_reference.greedy(model, tokenizer(PROMPT).input_ids, 24, **penalties)
    assert tokens != plain
    answer = served.client.completions.create(model=served.model, prompt=PROMPT, max_tokens=24, temperature=0,
                                              frequency_penalty=0.5, presence_penalty=0.25,
                                              logit_bias={str(token): value for token, value in bias.items()},
                                              extra_body={"repetition_penalty": 1.25, "speculation": {"k": 3}})
    grpc_request = generation_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=24)
    grpc_request.sampling.frequency_penalty, grpc_request.sampling.presence_penalty = 0.5, 0.25
    grpc_request.sampling.repetition_penalty = 1.25
    grpc_request.sampling.logit_bias.update(bias)
    grpc_request.speculation.k = 3
    assert answer.choices[0].text == tokenizer.decode(tokens, skip_special_tokens=True) \
        == served.stub.Generate(grpc_request).text


def test_response_format_json_schema_is_the_target_alones_output_under_the_schema_on_both_apis(served, target):
    """OpenAI's response_format json_schema (in a completion's body, as vLLM takes it), greedy at K = 3 through the
    whole stack: JSON the schema accepts, the target alone's output under the schema token for token, ended by EOS
    (finish reason `stop`), and gRPC's structured_output.json_schema."""
    from tests.test_structured_output import POINT, constrained_greedy, grammar_of
    model, tokenizer = target
    grammar = grammar_of(frozenset({tokenizer.eos_token_id}), json_schema=json.dumps(POINT))
    expected = constrained_greedy(model, str(DEMO / "target"), grammar, tokenizer("x = ").input_ids, 48)
    response_format = {"type": "json_schema", "json_schema": {"name": "point", "schema": POINT, "strict": True}}
    answer = served.client.completions.create(model=served.model, prompt="x = ", max_tokens=48, temperature=0,
                                              extra_body={"response_format": response_format})
    value = json.loads(answer.choices[0].text)
    assert set(value) == {"name", "n"} and isinstance(value["n"], int) and answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    assert answer.usage.completion_tokens == len(expected)
    grpc_request = generation_pb2.GenerateRequest(prompt="x = ", max_new_tokens=48, structured_output=
                                                  generation_pb2.StructuredOutput(json_schema=json.dumps(POINT)))
    assert served.stub.Generate(grpc_request).token_ids == expected


@pytest.mark.parametrize("body, check", [
    ({"guided_choice": ["yes", "no", "maybe not"]}, lambda text: text in ("yes", "no", "maybe not")),
    ({"structured_outputs": {"choice": ["left", "right"]}}, lambda text: text in ("left", "right")),
    ({"guided_regex": "[0-9]{2}-[a-z]{3}"}, lambda text: len(text) == 6 and text[2] == "-" and text[:2].isdigit()),
    ({"regex": "(True|False)"}, lambda text: text in ("True", "False")),
    ({"response_format": {"type": "json_object"}}, lambda text: isinstance(json.loads(text), dict)),
    ({"guided_grammar": 'root ::= "def " [a-z]+ "():"'}, lambda text: text.startswith("def ") and text.endswith("():")),
])
def test_vllm_and_sglang_structured_output_parameters_shape_a_sampled_output(served, body, check):
    """Sampled (temperature 1, seeded) at K = 3: the output has the structure asked for, whatever the draws."""
    for seed in range(3):
        response = httpx.post(served.base_url + "/completions", json={
            "model": served.model, "prompt": "x = ", "max_tokens": 64, "temperature": 1.0, "seed": seed, **body})
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and check(choice["text"]), choice


@pytest.mark.parametrize("body, param", [
    ({"guided_regex": "a[b"}, "guided_regex"),
    ({"response_format": {"type": "text"}, "guided_regex": "a[b"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace": "x"}}, "structured_outputs.whitespace"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos"),
])
def test_a_malformed_or_conflicting_structured_output_is_refused_naming_its_parameter(served, body, param):
    assert_refused_naming(served, "/completions", body, param)


POINT_TOOL = {"type": "function", "function": {"name": "make_point", "parameters": None}}
UNIT_TOOL = {"type": "function", "function": {"name": "set_unit", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["unit"],
    "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time"}}
CHAT = [{"role": "user", "content": "a point"}]


def stream_assembled(chunks) -> tuple[str, list, str]:
    """(content, [(name, arguments)], finish reason) of a streamed choice, assembled as OpenAI clients do."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, ["", ""])
            entry[0] += call.function.name or ""
            entry[1] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [tuple(entry) for _, entry in sorted(calls.items())], finish


def answered_calls(message) -> list:
    return [(call.function.name, call.function.arguments) for call in message.tool_calls or []]


def test_a_named_tool_choice_calls_it_with_the_target_alones_arguments_under_its_schema(served, target):
    """tool_choice naming a function, greedy at K = 3: one call of it whose arguments are the target alone's
    output under the function's parameters schema (the prompt rendered by transformers with the tools), token for
    token, whole and streamed (the call's id and name in its first delta, the arguments as they come)."""
    from tests.test_structured_output import POINT, constrained_greedy, grammar_of
    model, tokenizer = target
    from openai_api.tools import AS_DUMPED
    point = {**POINT, "properties": {**POINT["properties"], "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
    tools = [{**POINT_TOOL, "function": {**POINT_TOOL["function"], "parameters": point}}, TIME_TOOL]
    prompt = tokenizer.apply_chat_template(CHAT, tools=tools, add_generation_prompt=True, tokenize=False)
    grammar = grammar_of(frozenset({tokenizer.eos_token_id}),
                         json_schema=json.dumps({**point, "x-guidance": AS_DUMPED}))
    expected = tokenizer.decode(constrained_greedy(model, str(DEMO / "target"), grammar, tokenizer(prompt).input_ids,
                                                   48), skip_special_tokens=True)
    body = dict(model=served.model, messages=CHAT, tools=tools, max_tokens=48, temperature=0,
                tool_choice={"type": "function", "function": {"name": "make_point"}},
                extra_body={"speculation": {"k": 3}})
    answer = served.client.chat.completions.create(**body)
    assert answered_calls(answer.choices[0].message) == [("make_point", expected)]
    assert set(json.loads(expected)) == {"name", "n"} and answer.choices[0].message.content is None
    assert answer.choices[0].finish_reason == "stop" and answer.choices[0].message.tool_calls[0].id.startswith("call_")
    assert stream_assembled(served.client.chat.completions.create(**body, stream=True)) == (
        "", [("make_point", expected)], "stop")


def test_required_tool_calls_are_calls_of_the_given_tools_whole_and_streamed(served):
    """tool_choice "required", sampled (seeded) at K = 3, parallel_tool_calls false: one call of a given tool with
    arguments its schema accepts, finish reason `tool_calls`, and the stream with the same seed carries the same call.
    With parallel calls this model goes on adding calls to max_tokens: the array cut short is the content, finish
    reason `length`, in both."""
    for seed in (0, 1):
        body = dict(model=served.model, messages=CHAT, tools=[UNIT_TOOL, TIME_TOOL], tool_choice="required",
                    max_tokens=64, temperature=1.0, seed=seed, parallel_tool_calls=False)
        answer = served.client.chat.completions.create(**body)
        calls, choice = answered_calls(answer.choices[0].message), answer.choices[0]
        assert choice.finish_reason == "tool_calls" and len(calls) == 1 and choice.message.content is None, choice
        (name, arguments), = calls
        assert (json.loads(arguments) == {}) if name == "get_time" else (
            name == "set_unit" and json.loads(arguments) in ({"unit": "celsius"}, {"unit": "fahrenheit"}))
        assert stream_assembled(served.client.chat.completions.create(**body, stream=True)) == (
            "", calls, "tool_calls")
    body = {**body, "parallel_tool_calls": True, "max_tokens": 32}
    cut = served.client.chat.completions.create(**body).choices[0]
    assert (cut.finish_reason, cut.message.tool_calls) == ("length", None)
    assert cut.message.content.startswith('[{"name": "')
    assert stream_assembled(served.client.chat.completions.create(**body, stream=True)) == (
        cut.message.content, [], "length")


def test_auto_reads_the_hermes_calls_the_model_writes(served):
    """tool_choice "auto" with the hermes parser: output that holds `<tool_call>` blocks (here forced by a regex,
    which the demo model would not write) is answered as those calls, with the text before them as content; in a
    stream no piece of the markup reaches the content."""
    regex = r'Checking\.<tool_call>\{"name": "get_time", "arguments": \{\}\}</tool_call>'
    body = dict(model=served.model, messages=CHAT, tools=[UNIT_TOOL, TIME_TOOL], max_tokens=64, temperature=0,
                extra_body={"guided_regex": regex})
    answer = served.client.chat.completions.create(**body)
    assert answered_calls(answer.choices[0].message) == [("get_time", "{}")]
    assert (answer.choices[0].message.content, answer.choices[0].finish_reason) == ("Checking.", "tool_calls")
    assert stream_assembled(served.client.chat.completions.create(**body, stream=True)) == (
        "Checking.", [("get_time", "{}")], "tool_calls")
    plain = served.client.chat.completions.create(**{**body, "extra_body": {}, "max_tokens": 8})
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "length"


def test_the_eos_that_ends_an_answer_is_not_in_its_text_even_with_special_tokens_kept(served):
    """As vLLM: the EOS that stops generation is the answer's last token but not in its text, also with
    `skip_special_tokens: false` (as the kimi_k2, DSML and gemma4 parsers ask), whole and streamed; with
    `include_stop_str_in_output` it is (the output here forced by a regex, after which the grammar ends it with EOS)."""
    body = dict(model=served.model, messages=CHAT, max_tokens=32, temperature=0,
                extra_body={"guided_regex": r"Checking\.", "skip_special_tokens": False})
    answer = served.client.chat.completions.create(**body)
    assert (answer.choices[0].message.content, answer.choices[0].finish_reason) == ("Checking.", "stop")
    streamed = served.client.chat.completions.create(**body, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices) == "Checking."
    kept = served.client.chat.completions.create(**{**body, "extra_body": {**body["extra_body"],
                                                                         "include_stop_str_in_output": True}})
    assert kept.choices[0].message.content == "Checking.<|endoftext|>"


def test_deprecated_functions_answer_what_the_tools_they_stand_for_answer(served):
    """`functions` with a named `function_call`, greedy: `message.function_call` holds the arguments a named
    tool_choice gets (tested against the target alone above), whole and streamed; "auto" reads a call as tools'
    auto does, finish reason `function_call`; an earlier turn's function_call and function message are the tool
    call and tool message they stand for (the same reply and prompt); a completion's `functions` is a 400."""
    point = {**POINT_TOOL["function"], "parameters": {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"], "additionalProperties": False}}
    base = dict(model=served.model, messages=CHAT, max_tokens=24, temperature=0, extra_body={"speculation": {"k": 3}})
    tools = served.client.chat.completions.create(**base, tools=[{"type": "function", "function": point}],
                                                  tool_choice={"type": "function", "function": {"name": "make_point"}})
    body = dict(base, functions=[point], function_call={"name": "make_point"})
    answer = served.client.chat.completions.create(**body).choices[0]
    expected = tools.choices[0].message.tool_calls[0].function
    assert (answer.message.function_call.name, answer.message.function_call.arguments) == (
        "make_point", expected.arguments)
    assert answer.message.tool_calls is None and answer.finish_reason == "stop"
    name, arguments = "", ""
    for chunk in served.client.chat.completions.create(**body, stream=True):
        call = chunk.choices[0].delta.function_call
        name, arguments = name + (call.name or "" if call else ""), arguments + (call.arguments or "" if call else "")
    assert (name, arguments) == ("make_point", expected.arguments)
    regex = r'<tool_call>\{"name": "get_time", "arguments": \{\}\}</tool_call>'
    auto = served.client.chat.completions.create(**{**base, "max_tokens": 64, "extra_body": {"guided_regex": regex}},
                                                 functions=[TIME_TOOL["function"]]).choices[0]
    assert (auto.message.function_call.name, auto.finish_reason) == ("get_time", "function_call")
    called = {"name": "set_unit", "arguments": '{"unit": "celsius"}'}
    old = [*CHAT, {"role": "assistant", "content": None, "function_call": called},
           {"role": "function", "name": "set_unit", "content": "ok"}]
    new = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                                                                          "function": called}]},
           {"role": "tool", "tool_call_id": "call_1", "name": "set_unit", "content": "ok"}]
    replies = [served.client.chat.completions.create(**{**base, "messages": messages}) for messages in (old, new)]
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
    assert replies[0].usage.prompt_tokens == replies[1].usage.prompt_tokens
    refused = httpx.post(served.base_url + "/chat/completions", json={"model": served.model, "messages": CHAT,
                                                                      "function_call": "auto"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "function_call"


def test_a_continued_final_message_is_the_target_alones_continuation(served, target):
    """vLLM's continue_final_message (with add_generation_prompt false): the answer continues the final assistant
    message's text, as the target alone continues transformers' rendering with the same option."""
    model, tokenizer = target
    messages = [*CHAT, {"role": "assistant", "content": "def point("}]
    prompt = tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=False)
    assert prompt.endswith("def point(")
    answer = served.client.chat.completions.create(
        model=served.model, messages=messages, max_tokens=16, temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert answer.choices[0].message.content == tokenizer.decode(greedy_alone(target, prompt, 16),
                                                                 skip_special_tokens=True)
    assert answer.usage.prompt_tokens == len(tokenizer(prompt).input_ids)
    refused = httpx.post(served.base_url + "/chat/completions", json={
        "model": served.model, "messages": messages, "continue_final_message": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "continue_final_message"


def test_a_conversation_with_calls_and_their_results_is_the_target_alones_continuation(served, target):
    """An assistant's earlier calls (content null) and a tool's result, tool_choice "none": the reply is the target
    alone's greedy continuation of transformers' rendering of the same conversation and tools, as text."""
    model, tokenizer = target
    messages = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "set_unit", "arguments": '{"unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]
    rendered = [*CHAT, {**messages[1], "content": "", "tool_calls": [{**messages[1]["tool_calls"][0], "function": {
        "name": "set_unit", "arguments": {"unit": "celsius"}}}]}, messages[2]]
    prompt = tokenizer.apply_chat_template(rendered, tools=[UNIT_TOOL], add_generation_prompt=True, tokenize=False)
    assert '# assistant:  set_unit{"unit": "celsius"}' in prompt
    answer = served.client.chat.completions.create(model=served.model, messages=messages, tools=[UNIT_TOOL],
                                                   tool_choice="none", max_tokens=16, temperature=0)
    assert answer.choices[0].message.content == tokenizer.decode(greedy_alone(target, prompt, 16),
                                                                 skip_special_tokens=True)
    assert answer.choices[0].message.tool_calls is None
    assert answer.usage.prompt_tokens == len(tokenizer(prompt).input_ids)       # the prompt rendered as transformers'



@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),                                     # no tools
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [TOOL, TOOL]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools"),                                          # the router's schema check
    ({"tools": [TOOL], "tool_choice": "required", "guided_json": {"type": "object"}}, "guided_json"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": 3}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "assistant"}]}, "messages[0].content"),
])
def test_a_tool_request_that_cannot_be_served_is_refused_naming_its_parameter(served, body, param):
    assert_refused_naming(served, "/chat/completions", body, param)


def served_choices(served, path: str, extra: dict) -> tuple[list, dict]:
    """The choices (text or message, finish reason) and usage of a seeded sampled request with `extra`."""
    body = {"model": served.model, "prompt": PROMPT, "messages": [{"role": "user", "content": "x"}], "max_tokens": 8,
            "temperature": 0.8, "seed": 5, "speculation": {"k": 3}, **extra}
    response = httpx.post(served.base_url + path, json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    return [(c.get("text"), c.get("message"), c["finish_reason"]) for c in answer["choices"]], answer["usage"]


@pytest.mark.parametrize("path, neutral", [
    ("/completions", {"frequency_penalty": 0, "presence_penalty": 0.0}), ("/completions", {"logit_bias": {}}),
    ("/completions", {"best_of": 1}), ("/completions", {"best_of": 2, "n": 2}), ("/completions", {"suffix": ""}),
    ("/chat/completions", {"frequency_penalty": 0.0, "presence_penalty": 0}), ("/chat/completions", {"logit_bias": {}}),
    ("/chat/completions", {"response_format": {"type": "text"}}),
    ("/chat/completions", {"tools": [], "tool_choice": "none"}),
    ("/chat/completions", {"functions": [], "function_call": "none"}),
    ("/chat/completions", {"modalities": ["text"]}), ("/chat/completions", {"verbosity": "medium"}),
    ("/chat/completions", {"audio": None, "reasoning_effort": None, "web_search_options": None, "moderation": None}),
    ("/completions", {"ignore_eos": False, "min_tokens": 0, "repetition_penalty": 1.0, "min_p": 0}),
    ("/chat/completions", {"skip_special_tokens": True, "spaces_between_special_tokens": True, "detokenize": True,
                           "return_tokens_as_token_ids": False, "echo": False, "truncate_prompt_tokens": None}),
])
def test_their_neutral_values_are_accepted(served, path, neutral):
    """Each of them at the value that changes nothing (0, {}, best_of equal to n, "text", no tools, ...; null
    is absent) is served with the same output as a request without it."""
    same_n = {"n": neutral["n"]} if "n" in neutral else {}
    assert served_choices(served, path, neutral) == served_choices(served, path, same_n)


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_parameters_that_do_not_change_the_output_are_accepted_and_ignored(served, path):
    """OpenAI's parameters about storing, billing and caching, and a vendor extension specpool does not know, are
    served with the same output as without them (`prediction`, which changes no output either, is served and
    counted in the usage: tests/test_prediction.py)."""
    ignored = {"user": "ada", "metadata": {"team": "x"}, "store": False, "service_tier": "auto",
               "parallel_tool_calls": True, "prompt_cache_key": "k", "safety_identifier": "s",
               "vendor_extension": {"any": 1}}
    assert served_choices(served, path, ignored) == served_choices(served, path, {})


def test_null_is_the_same_as_an_absent_parameter(served):
    """As in OpenAI's API: `"max_tokens": null` is the default (16 for completions), not max_tokens 0."""
    nulls = dict.fromkeys(["max_tokens", "top_p", "n", "stop", "seed", "top_k", "speculation", "stream", "user",
                           "stream_options", "logprobs", "frequency_penalty", "logit_bias", "best_of", "suffix",
                           "response_format", "tools", "tool_choice"])
    completion = httpx.post(served.base_url + "/completions", json={
        "model": served.model, "prompt": PROMPT, **nulls, "temperature": 0})
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["completion_tokens"] == 16
    chat = {"model": served.model, "messages": [{"role": "user", "content": "x"}], **nulls, "temperature": None,
            "top_logprobs": None}
    for limit in ({"max_tokens": 3, "max_completion_tokens": None}, {"max_tokens": None, "max_completion_tokens": 3}):
        answer = httpx.post(served.base_url + "/chat/completions", json={**chat, **limit})
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] <= 3


@pytest.mark.parametrize("path, body, param", [
    ("/completions", {"max_tokens": 10 ** 6}, "max_tokens"), ("/completions", {"max_tokens": 1020}, "max_tokens"),
    ("/chat/completions", {"max_completion_tokens": 10 ** 6}, "max_completion_tokens"),
    ("/chat/completions", {"max_tokens": 1020}, "max_tokens"),
])
def test_length_errors_name_the_parameter_sent(served, path, body, param):
    """The router's limits (router.max_new_tokens, the model's context) are reported under the HTTP
    parameter the request set, never the gRPC field max_new_tokens."""
    response = httpx.post(served.base_url + path, json={
        "model": served.model, "prompt": PROMPT, "messages": [{"role": "user", "content": "x"}], **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: ")
    assert "max_new_tokens" not in error["message"].replace("router.max_new_tokens", "")


def test_more_choices_than_the_server_runs_at_once_are_answered_in_waves(served):
    """n choices are n router requests: more than router.max_active_requests (2 here, with no queue) run in waves,
    each starting as one before it ends (never a 429 for a request alone), whole and streamed, each the choice it
    would be on a larger server (seeded: choice i samples with seed + i, as it would anyway)."""
    refused = requests_counted(served, "RESOURCE_EXHAUSTED")
    body = {"model": served.model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0.8, "seed": 11, "n": 5}
    whole = httpx.post(served.base_url + "/completions", json=body)
    assert whole.status_code == 200, whole.text
    texts = [choice["text"] for choice in whole.json()["choices"]]
    alone = [httpx.post(served.base_url + "/completions", json={**body, "n": 1, "seed": 11 + i}).json()
             for i in range(5)]
    assert texts == [a["choices"][0]["text"] for a in alone] and len(set(texts)) > 1
    streamed = {}
    for chunk in served.client.completions.create(**{**body, "stream": True}):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(5)] == texts
    assert requests_counted(served, "RESOURCE_EXHAUSTED") == refused


def test_a_server_that_stores_no_responses_says_so(served):
    """http.store_responses 0: a response is answered `store: false`, and one that continues another is a 400."""
    answer = served.client.responses.create(model=served.model, input="x", max_output_tokens=4)
    assert answer.store is False and httpx.get(f"{served.base_url}/responses/{answer.id}").status_code == 404
    refused = httpx.post(served.base_url + "/responses", json={"model": served.model, "input": "x",
                                                               "previous_response_id": answer.id})
    error = refused.json()["error"]
    assert (refused.status_code, error["param"]) == (400, "previous_response_id")
    assert "http.store_responses is 0" in error["message"]


def test_acceptance_rate_is_null_when_nothing_was_drafted(served):
    def stats(k: int) -> dict:
        return served.client.completions.create(model=served.model, prompt=PROMPT, max_tokens=8, temperature=0,
                                                extra_body={"speculation": {"k": k}}).model_extra["specpool"]
    undrafted, drafted = stats(0), stats(3)
    assert (undrafted["draft_tokens"], undrafted["acceptance_rate"]) == (0, None)
    assert drafted["draft_tokens"] > 0 and drafted["acceptance_rate"] == drafted["accepted_tokens"] / drafted[
        "draft_tokens"]


def test_404_unknown_model_and_sdk_errors(served):
    with pytest.raises(openai.NotFoundError):
        served.client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        served.client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": "x"}],
                                              temperature=-2)


def test_429_when_overloaded_and_disconnect_frees_sessions(served):
    body = {"model": served.model, "prompt": PROMPT, "max_tokens": 900, "temperature": 0, "stream": True,
            "speculation": {"k": 1}}
    with httpx.Client(timeout=60) as first, httpx.Client(timeout=60) as second:
        with first.stream("POST", served.base_url + "/completions", json=body) as a, \
                second.stream("POST", served.base_url + "/completions", json=body) as b:
            lines = [a.iter_lines(), b.iter_lines()]   # kept: a dropped line iterator closes its connection
            assert [next(line).startswith("data: ") for line in lines] == [True, True]   # both slots taken
            refused = requests_counted(served, "RESOURCE_EXHAUSTED")
            third = httpx.post(served.base_url + "/completions", json={**body, "stream": False}, timeout=60)
            assert third.status_code == 429 and third.json()["error"]["type"] == "rate_limit_exceeded"
            assert requests_counted(served, "RESOURCE_EXHAUSTED") == refused + 1
            assert active_sessions(served) == [2, 2]
    assert wait_for_no_sessions(served, timeout=20) == [0, 0]     # both clients went away mid-stream


@contextlib.contextmanager
def logged(logger: str) -> Iterator[list[logging.LogRecord]]:
    """The records `logger` emits meanwhile (uvicorn's loggers do not propagate to pytest's caplog)."""
    handler = logging.Handler()
    records: list[logging.LogRecord] = []
    handler.emit = records.append
    logging.getLogger(logger).addHandler(handler)
    try:
        yield records
    finally:
        logging.getLogger(logger).removeHandler(handler)


def test_plain_request_disconnect_frees_sessions_quietly(served):
    """The request is cancelled and its sessions freed, and the server logs no traceback for it."""
    body = {"model": served.model, "prompt": PROMPT, "max_tokens": 900, "temperature": 0, "speculation": {"k": 1}}
    cancelled = requests_counted(served, "CANCELLED")
    with logged("uvicorn.error") as records:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(served.base_url + "/completions", json=body, timeout=1.0)
        assert wait_for_no_sessions(served, timeout=20) == [0, 0]
        deadline = time.monotonic() + 10
        while requests_counted(served, "CANCELLED") == cancelled and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)                     # the handler's exit, after the request is counted
    assert requests_counted(served, "CANCELLED") == cancelled + 1
    assert [r.getMessage() for r in records] == []


def boundary_stop(tokenizer, tokens: list[int]) -> tuple[str, int]:
    """A stop string that spans a token boundary (its first occurrence in the output), and how many tokens
    the output keeps (up to the one that completes it)."""
    text = tokenizer.decode(tokens)
    for i in range(2, len(tokens) - 1):
        before = tokenizer.decode(tokens[:i])
        if len(tokenizer.decode(tokens[i - 1:i])) >= 1 and len(tokenizer.decode(tokens[i:i + 1])) >= 2:
            stop = before[-1] + text[len(before):len(before) + 2]
            if text.find(stop) == len(before) - 1 and text.startswith(before):
                return stop, i + 1
    raise AssertionError("no boundary-spanning stop string found")


def test_stop_strings_across_token_boundaries(served, target):
    tokens = greedy_alone(target, PROMPT, 40)
    text = target[1].decode(tokens)
    stop, kept = boundary_stop(target[1], tokens)
    expected = text[:text.find(stop)]
    grpc_request = generation_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=40, stop=[stop, "never-seen"])
    unary = served.stub.Generate(grpc_request)
    assert (unary.text, list(unary.token_ids)) == (expected, tokens[:kept])
    assert unary.finish_reason == generation_pb2.FINISH_REASON_STOP
    streamed = list(served.stub.GenerateStream(grpc_request))
    assert "".join(m.text for m in streamed) == expected and sum(len(m.token_ids) for m in streamed) == kept
    http = served.client.completions.create(model=served.model, prompt=PROMPT, max_tokens=40, temperature=0,
                                            stop=stop)
    assert (http.choices[0].text, http.choices[0].finish_reason, http.usage.completion_tokens) == (expected, "stop",
                                                                                                    kept)
    chunks = served.client.completions.create(model=served.model, prompt=PROMPT, max_tokens=40, temperature=0,
                                              stop=[stop], stream=True)
    pieces = [c.choices[0].text for c in chunks]
    assert "".join(pieces) == expected and all(stop not in p for p in pieces)
    assert wait_for_no_sessions(served) == [0, 0]
    grpc_request.include_stop_str_in_output = True          # vLLM's: the text keeps the stop string
    assert served.stub.Generate(grpc_request).text == expected + stop
    kept_in = served.client.completions.create(model=served.model, prompt=PROMPT, max_tokens=40, temperature=0,
                                               stop=stop, extra_body={"include_stop_str_in_output": True})
    assert (kept_in.choices[0].text, kept_in.usage.completion_tokens) == (expected + stop, kept)


@pytest.mark.parametrize("chat", [False, True])
def test_stop_token_ids_stop_http_where_grpc_stops(served, target, chat):
    """`stop_token_ids` in the body (as vLLM takes it) is GenerateRequest.stop_token_ids: greedy, HTTP keeps
    the tokens gRPC keeps (up to the stop token) and finishes with `stop`."""
    messages = [{"role": "user", "content": "a class with an init"}]
    prompt = target[1].apply_chat_template(messages, add_generation_prompt=True, tokenize=False) if chat else PROMPT
    tokens = greedy_alone(target, prompt, 10)
    stop = next(token for i, token in enumerate(tokens) if i >= 1 and token not in tokens[:i])
    grpc_answer = served.stub.Generate(generation_pb2.GenerateRequest(prompt=prompt, max_new_tokens=10,
                                                                      stop_token_ids=[stop]))
    assert list(grpc_answer.token_ids) == tokens[:tokens.index(stop) + 1]
    assert grpc_answer.finish_reason == generation_pb2.FINISH_REASON_STOP
    body = dict(model=served.model, max_tokens=10, temperature=0, extra_body={"stop_token_ids": [stop]})
    if chat:
        answer = served.client.chat.completions.create(messages=messages, **body)
        text = answer.choices[0].message.content
    else:
        answer = served.client.completions.create(prompt=PROMPT, **body)
        text = answer.choices[0].text
    assert (text, answer.choices[0].finish_reason, answer.usage.completion_tokens) == (
        grpc_answer.text, "stop", len(grpc_answer.token_ids))


def test_streamed_text_offsets_count_from_the_completion_start(served):
    """As OpenAI and vLLM: a stream's text_offset is the token's offset in the whole completion, so its chunks'
    offsets together are the unstreamed response's (for each of n choices)."""
    body = dict(model=served.model, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=1, n=2,
                extra_body={"speculation": {"k": 1}})
    whole = served.client.completions.create(**body)
    chunks = [c.choices[0] for c in served.client.completions.create(**body, stream=True)]
    for index in (0, 1):
        streamed = [c.logprobs.text_offset for c in chunks if c.index == index and c.logprobs.tokens]
        assert len(streamed) > 1                           # more than one chunk, or the offsets prove nothing
        assert sum(streamed, []) == whole.choices[index].logprobs.text_offset
    assert whole.choices[0].logprobs.text_offset[:3] == [0, *itertools.accumulate(
        len(t) for t in whole.choices[0].logprobs.tokens[:2])]


def reference_logprobs(target, prompt_ids: list[int], output: list[int], sampling) -> torch.Tensor:
    """The target alone: log of the distribution each output token was sampled from ([n, vocab])."""
    from engine.sampling import logits_to_probs
    with torch.inference_mode():
        logits = target[0](torch.tensor([prompt_ids + output])).logits[0, len(prompt_ids) - 1:-1].float()
    return torch.log_softmax(logits, -1) if sampling.greedy else logits_to_probs(logits, sampling).log()


@pytest.mark.parametrize("temperature, top_k, top_p, k", [(0.0, 0, 1.0, 3), (0.8, 0, 1.0, 3), (1.3, 40, 0.9, 3),
                                                           (0.8, 0, 1.0, 0)])
def test_logprobs_equal_the_target_alone(served, target, temperature, top_k, top_p, k):
    """With speculation (K = 3: the committing verify pass) and at K = 0 (a decode run's steps)."""
    from engine.sampling import Sampling
    request = generation_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=30, logprobs=5)
    request.sampling.temperature, request.sampling.top_k, request.sampling.top_p = temperature, top_k, top_p
    request.sampling.seed = 11
    request.speculation.k = k
    answer = served.stub.Generate(request)
    assert (answer.stats.draft_tokens > 0) == (k > 0)         # speculation stayed on, or decode runs
    output = list(answer.token_ids)
    assert [e.token_id for e in answer.logprobs] == output
    expected = reference_logprobs(target, target[1](PROMPT).input_ids, output,
                                  Sampling(temperature, top_p, top_k))
    got = torch.tensor([e.logprob for e in answer.logprobs])
    chosen = expected.gather(-1, torch.tensor(output).view(-1, 1)).squeeze(-1)
    assert torch.allclose(got, chosen, atol=1e-4)
    top = expected.topk(5, -1)
    for entry, values in zip(answer.logprobs, top.values):
        assert torch.allclose(torch.tensor([t.logprob for t in entry.top]), values, atol=1e-4)
    http = served.client.completions.create(model=served.model, prompt=PROMPT, max_tokens=30, temperature=temperature,
                                            top_p=top_p, seed=11, logprobs=5,
                                            extra_body={"top_k": top_k, "speculation": {"k": k}})
    finite = torch.where(torch.isfinite(chosen), chosen, torch.tensor(-9999.0))
    assert torch.allclose(torch.tensor(http.choices[0].logprobs.token_logprobs), finite, atol=1e-4)


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(served, target):
    """lm-eval's loglikelihood request (token IDs, max_tokens 1, greedy, logprobs 1, echo): the text is the prompt's
    and the output's, and the logprobs list every prompt token (the first's null) with the target alone's logprob
    (to 1e-4) and its most likely alternative, then the output's; streamed, the first chunk carries the prompt. Over
    gRPC, GenerateRequest.prompt_logprobs answers the same on the unary response and on a stream's first message."""
    model, tokenizer = target
    ids = tokenizer(PROMPT + "):\n        self.x = x\n").input_ids
    with torch.inference_mode():
        alone = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
    chosen = alone.gather(-1, torch.tensor(ids[1:]).view(-1, 1)).squeeze(-1)
    body = dict(model=served.model, prompt=[ids], max_tokens=1, temperature=0, logprobs=1, echo=True)   # lm-eval's
    answer = served.client.completions.create(**body).choices[0]
    output = answer.logprobs.tokens[len(ids):]
    assert answer.text == tokenizer.decode(ids) + "".join(output) and len(output) == 1
    assert answer.logprobs.tokens[:len(ids)] == [tokenizer.decode([i]) for i in ids]
    assert answer.logprobs.token_logprobs[0] is None and answer.logprobs.top_logprobs[0] is None
    assert torch.allclose(torch.tensor(answer.logprobs.token_logprobs[1:len(ids)]), chosen, atol=1e-4)
    assert [list(top) for top in answer.logprobs.top_logprobs[1:len(ids)]] == [
        [tokenizer.decode([i])] for i in alone.argmax(-1).tolist()]
    offsets = answer.logprobs.text_offset
    assert offsets[0] == 0 and offsets[len(ids)] == len(tokenizer.decode(ids))
    chunks = list(served.client.completions.create(**body, stream=True))
    assert chunks[0].choices[0].text.startswith(tokenizer.decode(ids))
    assert "".join(c.choices[0].text for c in chunks) == answer.text
    assert sum((c.choices[0].logprobs.token_logprobs for c in chunks), []) == answer.logprobs.token_logprobs
    plain = served.client.completions.create(**{**body, "logprobs": None, "max_tokens": 4}).choices[0]
    assert plain.text.startswith(tokenizer.decode(ids)) and plain.logprobs is None
    one = served.client.completions.create(**{**body, "prompt": ids[:1]}).choices[0]      # a one-token prompt
    assert one.logprobs.token_logprobs[0] is None and len(one.logprobs.token_logprobs) == 2
    request = generation_pb2.GenerateRequest(prompt_token_ids=ids, max_new_tokens=8, prompt_logprobs=2)
    for messages in ([served.stub.Generate(request)], list(served.stub.GenerateStream(request))):
        assert [e.token_id for e in messages[0].prompt_logprobs] == ids[1:]
        assert torch.allclose(torch.tensor([e.logprob for e in messages[0].prompt_logprobs]), chosen, atol=1e-4)
        assert [[t.token_id for t in e.top] for e in messages[0].prompt_logprobs] == alone.topk(2, -1).indices.tolist()
        assert not any(m.prompt_logprobs for m in messages[1:])


def test_a_batch_of_prompts_answers_each_with_its_n_choices_prompt_by_prompt(served, target):
    """`prompt` as a list of texts or of token-ID lists (lm-eval's batches): choice p * n + i is prompt p's choice
    i, the same as that prompt sent alone (greedy), with its own echo and prompt logprobs; usage counts every
    prompt; a stream's chunks assemble to the same choices."""
    _, tokenizer = target
    texts = [PROMPT, "import os\n"]
    body = {"model": served.model, "prompt": texts, "max_tokens": 6, "temperature": 0.8, "seed": 4}
    whole = httpx.post(served.base_url + "/completions", json=body).json()
    alone = [httpx.post(served.base_url + "/completions", json={**body, "prompt": text}).json() for text in texts]
    assert [c["index"] for c in whole["choices"]] == [0, 1]
    assert [c["text"] for c in whole["choices"]] == [a["choices"][0]["text"] for a in alone]       # seeded: alike
    for key in ("prompt_tokens", "completion_tokens"):
        assert whole["usage"][key] == sum(a["usage"][key] for a in alone)
    texts_streamed = {}
    for chunk in served.client.completions.create(**{**body, "stream": True}):
        for choice in chunk.choices:
            texts_streamed[choice.index] = texts_streamed.get(choice.index, "") + choice.text
    assert [texts_streamed[i] for i in range(2)] == [c["text"] for c in whole["choices"]]
    two = httpx.post(served.base_url + "/completions", json={**body, "prompt": texts[:1], "n": 2}).json()
    assert [c["index"] for c in two["choices"]] == [0, 1]        # a batch of one, n = 2: its choices 0 and 1
    waves = httpx.post(served.base_url + "/completions", json={**body, "prompt": texts * 2, "n": 2}).json()
    assert [c["text"] for c in waves["choices"][:4]] == [c["text"] for c in waves["choices"][4:]]  # 8 on 2 slots
    assert [c["text"] for c in waves["choices"][0::2]] == [c["text"] for c in whole["choices"]] * 2
    bad = httpx.post(served.base_url + "/completions", json={**body, "prompt": [[5, 6], [7, 10 ** 6]]}).json()
    assert bad["error"]["param"] == "prompt" and bad["error"]["message"].startswith("prompt[1][1]: 1000000 is")
    ids = [tokenizer(text).input_ids for text in texts[:2]]
    scored = httpx.post(served.base_url + "/completions", json={
        "model": served.model, "prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True,
        "prompt_logprobs": 1}).json()
    for choice, prompt in zip(scored["choices"], ids):
        assert choice["text"].startswith(tokenizer.decode(prompt))
        assert len(choice["logprobs"]["tokens"]) == len(prompt) + 1 and len(choice["prompt_logprobs"]) == len(prompt)
        assert [int(next(iter(entry))) for entry in choice["prompt_logprobs"][1:]] == prompt[1:]


def test_tokenize_gives_the_tokens_a_request_is_given_and_detokenize_their_text(served, target):
    """vLLM's /tokenize and /detokenize: a prompt's tokens (with or without special ones), a chat's the ones its
    chat request is given (its usage's prompt_tokens), the context length, each token's string if asked; the text
    of token IDs, special tokens written out; bad bodies a 400 naming the parameter."""
    _, tokenizer = target
    post = lambda path, body: httpx.post(served.base_url.removesuffix("/v1") + path,     # noqa: E731
                                         json={"model": served.model, **body})
    got = post("/tokenize", {"prompt": PROMPT, "return_token_strs": True}).json()
    assert got["tokens"] == tokenizer(PROMPT).input_ids and got["count"] == len(got["tokens"])
    assert got["max_model_len"] > 0 and got["token_strs"] == tokenizer.convert_ids_to_tokens(got["tokens"])
    bare = post("/tokenize", {"prompt": PROMPT, "add_special_tokens": False}).json()["tokens"]
    assert bare == tokenizer(PROMPT, add_special_tokens=False).input_ids
    chat = post("/tokenize", {"messages": CHAT, "tools": [UNIT_TOOL], "add_special_tokens": False}).json()
    answer = served.client.chat.completions.create(model=served.model, messages=CHAT, tools=[UNIT_TOOL],
                                                   tool_choice="none", max_tokens=1)
    assert chat["count"] == answer.usage.prompt_tokens and "token_strs" not in chat
    assert post("/detokenize", {"tokens": got["tokens"]}).json()["prompt"] == tokenizer.decode(got["tokens"])
    for path, body, param in [
            ("/tokenize", {}, "messages"), ("/tokenize", {"prompt": "x", "messages": CHAT}, "messages"),
            ("/tokenize", {"messages": CHAT, "add_special_tokens": True}, "add_special_tokens"),
            ("/detokenize", {"tokens": [10 ** 6]}, "tokens"), ("/detokenize", {"tokens": "x"}, "tokens")]:
        refused = post(path, body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, (body, refused.text)
    assert post("/tokenize", {"prompt": "x", "model": "other"}).status_code == 404


def test_vllms_prompt_logprobs_are_the_target_alones_in_vllms_format(served, target):
    """vLLM's `prompt_logprobs: N`: per choice of a completion, at the top of a chat answer, null for the first
    prompt token, then {token ID: {logprob, rank, decoded_token}} of the prompt token (its rank among the whole
    vocabulary) and the N most likely there, each equal to the target alone's; beside an echo asking for fewer
    alternatives, the echo's legacy logprobs keep their own number."""
    model, tokenizer = target
    ids = tokenizer(PROMPT).input_ids

    def alones(prompt: list[int]) -> tuple[torch.Tensor, torch.return_types.topk, list, list]:
        from tests.test_prompt_logprobs import rank_bounds
        with torch.inference_mode():
            logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), -1)
        chosen = logprobs.gather(-1, torch.tensor(prompt[1:]).view(-1, 1))
        return (chosen.squeeze(-1), logprobs.topk(3, -1), *rank_bounds(logprobs, chosen))

    def check(entries: list, prompt: list[int]) -> None:
        """The token's own entry first (its rank within the bounds), then the top 3 at ranks 1-3 (the token, if one
        of them, at its place there), each with the target alone's logprob."""
        chosen, top, low, high = alones(prompt)
        assert entries[0] is None and len(entries) == len(prompt)
        for entry, token, logprob, a, b, others, values in zip(entries[1:], prompt[1:], chosen, low, high,
                                                               top.indices, top.values):
            assert next(iter(entry)) == str(token) and entry[str(token)]["decoded_token"] == tokenizer.decode([token])
            expected = {str(token): (range(a, b + 1), float(logprob))}
            expected.update({str(t): (range(r, r + 1), v) for r, (t, v) in enumerate(zip(others.tolist(),
                                                                                       values.tolist()), 1)})
            assert entry.keys() == expected.keys()
            assert all(entry[key]["rank"] in expected[key][0] and abs(entry[key]["logprob"] - expected[key][1]) < 1e-4
                       for key in entry)
    body = {"model": served.model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "n": 2, "prompt_logprobs": 3,
            "echo": True, "logprobs": 1}
    completion = httpx.post(served.base_url + "/completions", json=body).json()
    for choice in completion["choices"]:
        check(choice["prompt_logprobs"], ids)
        assert all(len(top) == 1 for top in choice["logprobs"]["top_logprobs"][1:])      # the echo's own 1
    chat = httpx.post(served.base_url + "/chat/completions", json={
        "model": served.model, "messages": CHAT, "max_tokens": 2, "prompt_logprobs": 3}).json()
    assert "prompt_logprobs" not in chat["choices"][0]
    rendered = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    check(chat["prompt_logprobs"], tokenizer(rendered).input_ids)
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    plain = httpx.post(served.base_url + "/completions", json={**body, "prompt_logprobs": None}).json()
    assert "prompt_logprobs" not in plain["choices"][0]


def test_chat_logprobs_format(served):
    answer = served.client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": "x"}],
                                                   max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == c.top_logprobs[0].logprob for c in content)          # greedy: the argmax


def asgi_client(http_overrides: dict, router) -> httpx.AsyncClient:
    from openai_api.app import create_app
    from settings.schema import HttpConfig
    app = create_app(HttpConfig(**http_overrides), lambda: router)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def test_401_503_and_no_chat_template(byte_pair):
    async def run():
        async with asgi_client({}, None) as loading:
            assert (await loading.get("/health")).status_code == 503
            response = await loading.post("/v1/completions", json={"model": "m", "prompt": "x"})
            assert response.status_code == 503 and response.json()["error"]["type"] == "service_unavailable"
        async with asgi_client({"api_keys": ["k1"]}, None) as keyed:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                response = await keyed.get("/v1/models", headers=headers)
                assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
            assert (await keyed.get("/v1/models", headers={"Authorization": "Bearer k1"})).status_code == 503
            for content in (b"not json", b'{"model": "m", "prompt": "x", "max_tokens": -1}'):   # the key first
                response = await keyed.post("/v1/completions", content=content,
                                            headers={"Authorization": "Bearer wrong", "Content-Type": "application/json"})
                assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        from router.metrics import Metrics
        from router.server import Router
        from settings.schema import SpecpoolConfig
        no_template = types.SimpleNamespace(model_info={"model_path": byte_pair[1]}, eos_ids=frozenset(),
                                            tokenizer=None, draining=False, metrics=Metrics(), config=SpecpoolConfig())
        no_template.ended = types.MethodType(Router.ended, no_template)
        async with asgi_client({}, no_template) as client:
            response = await client.post("/v1/chat/completions", json={
                "model": Path(byte_pair[1]).name, "messages": [{"role": "user", "content": "hi"}]})
            assert response.status_code == 400 and "http.chat_template" in response.json()["error"]["message"]
            assert no_template.metrics.requests.labels("INVALID_ARGUMENT")._value.get() == 1
    asyncio.run(run())


def openai_error(response: httpx.Response, status: int) -> dict:
    """The error of an answer in OpenAI's shape, with this status."""
    assert response.status_code == status, response.text
    assert set(response.json()) == {"error"}
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    return error


def test_malformed_bodies_and_unknown_routes_answer_in_openai_shape():
    json_type = {"Content-Type": "application/json"}

    async def run():
        async with asgi_client({}, None) as client:
            bad_json = openai_error(await client.post("/v1/completions", content=b'{"model": ', headers=json_type), 400)
            assert bad_json["message"].startswith("body: invalid JSON") and bad_json["param"] is None
            for content in (b"[1]", b'"text"'):
                not_object = openai_error(await client.post("/v1/completions", content=content, headers=json_type), 400)
                assert not_object["message"] == "body: must be a JSON object" and not_object["param"] is None
            form = openai_error(await client.post("/v1/completions", content=b'{"model": "m", "prompt": "x"}',
                                                  headers={"Content-Type": "application/x-www-form-urlencoded"}), 400)
            assert "Content-Type: application/json" in form["message"]
            for stop in (5, [5], ["x", 5]):
                error = openai_error(await client.post("/v1/completions", json={"model": "m", "prompt": "x",
                                                                                 "stop": stop}), 400)
                assert error["param"] == "stop" and error["message"].startswith("stop")
            for prompt in (5, [1, "x"], ["x", 1]):
                error = openai_error(await client.post("/v1/completions", json={"model": "m", "prompt": prompt}), 400)
                assert error["param"] == "prompt" and "None" not in error["message"]
            missing = openai_error(await client.get("/v1/nowhere"), 404)
            assert "/v1/nowhere" in missing["message"]
            method = await client.get("/v1/completions")
            assert "POST" in openai_error(method, 405)["message"] and method.headers["allow"] == "POST"
    asyncio.run(run())


@pytest.mark.parametrize("message, param", [
    ({"role": "wizard", "content": "x"}, "messages[1].role"), ({"role": "user"}, "messages[1].content"),
    ({"role": "assistant", "content": None}, "messages[1].content"), ({"content": "x"}, "messages[1].role"),
    ({"role": "user", "content": 5}, "messages[1].content"),
    ({"role": "user", "content": [{"type": "text"}]}, "messages[1].content[0].text"),
])
def test_chat_messages_need_a_known_role_and_content(message, param):
    """Roles system, developer, user, assistant and tool; content (no tool calls: required in every message)."""
    async def run():
        async with asgi_client({}, None) as client:
            return await client.post("/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "system", "content": "x"}, message]})
    error = openai_error(asyncio.run(run()), 400)
    assert error["param"] == param and error["message"].startswith(f"{param}: ")


def test_cli_generate_from_stdin_and_status_from_config(served, target, tmp_path, monkeypatch, capsys):
    import io
    import yaml
    from router import cli
    monkeypatch.setattr("sys.stdin", io.StringIO(PROMPT))
    assert cli.main(["generate", "-", "--address", served.address, "--max-new-tokens", "12", "--stream"]) == 0
    completion = target[1].decode(greedy_alone(target, PROMPT, 12), skip_special_tokens=True)
    assert capsys.readouterr().out.startswith(PROMPT + completion + "\n[12 tokens, finish=length")
    path = tmp_path / "served.yaml"
    path.write_text(yaml.safe_dump({"router": {"port": served.service.port, "admin_port": served.service.admin_port}}))
    assert cli.main(["status", "--config", str(path)]) == 0
    assert "request(s) generating" in capsys.readouterr().out      # the summary (--full: every statistic)


def logged_requests(out: str) -> list[str]:
    return [line.split("[specpool] ", 1)[1] for line in out.splitlines() if "[specpool] request " in line]


def test_the_request_log_a_reload_turns_on_has_one_line_per_request_grpc_and_http_until_turned_off(served, capsys):
    before = served.reload(router={"log_requests": True})
    try:
        capsys.readouterr()
        request = generation_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=8, request_id="log-me")
        request.speculation.k = 3
        served.stub.Generate(request)
        with pytest.raises(grpc.RpcError):
            served.stub.Generate(generation_pb2.GenerateRequest(prompt=PROMPT))
        with pytest.raises(grpc.RpcError):     # an id over the bound is refused, and not written out
            served.stub.Generate(generation_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=1, request_id="x" * 300))
        completion = served.client.completions.create(model=served.model, prompt=PROMPT, max_tokens=4, temperature=0)
        refused = httpx.post(f"{served.base_url}/completions", json={"model": served.model, "prompt": PROMPT,
                                                                     "max_tokens": -1})
        assert refused.status_code == 400
        too_many = httpx.post(f"{served.base_url}/completions", headers={"X-Request-Id": "trace-n"},
                              json={"model": served.model, "prompt": PROMPT, "max_tokens": 10 ** 6})     # by the router
        assert too_many.status_code == 400
        lines = logged_requests(capsys.readouterr().out)
    finally:
        served.reload(**before)
    assert len(lines) == 6, lines
    refused_by_router = lines.pop()              # past the body's checks: under the client's X-Request-Id
    assert refused_by_router.startswith("request cmpl-trace-n /v1/completions from 127.0.0.1:")
    assert ": INVALID_ARGUMENT in " in refused_by_router and too_many.json()["error"]["message"] in refused_by_router
    assert lines[0].startswith("request log-me Generate from ipv4:127.0.0.1:")
    assert ": OK in " in lines[0] and " + 8 new tokens (length), " in lines[0] and "drafts accepted" in lines[0]
    assert lines[1].startswith("request - Generate from ")
    assert ": INVALID_ARGUMENT in " in lines[1] and "max_new_tokens" in lines[1]
    long_id = lines.pop(2)
    assert long_id.startswith("request - Generate from ") and ": INVALID_ARGUMENT in " in long_id
    assert "request_id: must be at most 256 characters" in long_id and "xxxx" not in long_id
    assert lines[2].startswith(f"request {completion.id} /v1/completions from 127.0.0.1:")    # the id its client saw
    assert ": OK in " in lines[2] and "+ 4 new tokens" in lines[2]
    assert lines[3].startswith("request - /v1/completions from 127.0.0.1:")
    assert ": INVALID_ARGUMENT in " in lines[3] and lines[3].endswith(refused.json()["error"]["message"])
    served.stub.Generate(request)
    assert logged_requests(capsys.readouterr().out) == []


def test_a_clients_x_request_id_is_the_responses_id_and_comes_back_streamed_or_not(served):
    body = {"model": served.model, "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    whole = httpx.post(f"{served.base_url}/completions", json=body, headers={"X-Request-Id": "trace-42"})
    assert whole.json()["id"] == "cmpl-trace-42" and whole.headers["x-request-id"] == "trace-42"
    with httpx.stream("POST", f"{served.base_url}/chat/completions", headers={"X-Request-Id": "trace-43"},
                      json={"model": served.model, "max_tokens": 3, "stream": True,
                            "messages": [{"role": "user", "content": "hi"}]}) as streamed:
        assert streamed.headers["x-request-id"] == "trace-43"
        events = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
    assert events and all(event["id"] == "chatcmpl-trace-43" for event in events)
    anonymous = httpx.post(f"{served.base_url}/completions", json=body)
    assert anonymous.json()["id"] == "cmpl-" + anonymous.headers["x-request-id"]     # made up, and said
    error = openai_error(httpx.post(f"{served.base_url}/completions", json=body,
                                    headers={"X-Request-Id": "x" * 257}), 400)
    assert error["param"] == "X-Request-Id" and "at most 256 characters" in error["message"]
