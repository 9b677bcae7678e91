"""OpenAI's Responses API (/v1/responses) against a served demo pair, with the real `openai` SDK and raw HTTP: a
response is the chat completion it stands for (the target alone's greedy text, the same tool calls, structured
output and logprobs), streamed as the Responses events in their order, and its errors name the Responses
parameters a client sent."""
import json
import re
import time
import types

import httpx
import pytest

from openai_api.responses_api import PREDICTION_COUNTS
from tests.test_openai_http import (CHAT, TIME_TOOL, UNIT_TOOL, demo_target, greedy_alone, requests_counted,
                                    served_over_http, stream_assembled)


@pytest.fixture(scope="module")
def served(start_service, tmp_path_factory):
    """The demo pair over HTTP, its responses stored in an SQLite file (http.store_path; the memory store serves
    tests/test_reasoning.py's and tests/test_harmony.py's)."""
    return served_over_http(start_service, http={"store_path": str(tmp_path_factory.mktemp("store") / "responses.db")})


@pytest.fixture(scope="module")
def target():
    return demo_target()


def flat(tool: dict) -> dict:
    """A chat tool as the Responses API sends it."""
    return {"type": "function", **tool["function"]}


def chat_of(served, **body):
    return served.client.chat.completions.create(model=served.model, **body)


def events_of(served, body: dict) -> list:
    """The SDK's events of a streamed response."""
    return list(served.client.responses.create(model=served.model, stream=True, **body))


def test_a_response_is_the_target_alones_greedy_continuation_of_its_instructions_and_input(served, target):
    model, tokenizer = target
    messages = [{"role": "system", "content": "You write Python."}, *CHAT]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ok = requests_counted(served, "OK")
    response = served.client.responses.create(model=served.model, instructions="You write Python.", input="a point",
                                              max_output_tokens=16, temperature=0, store=True,
                                              metadata={"team": "a"}, extra_body={"speculation": {"k": 3}})
    assert requests_counted(served, "OK") == ok + 1          # counted as the other routes are
    tokens = greedy_alone(target, prompt, 16)
    assert response.output_text == tokenizer.decode(tokens, skip_special_tokens=True)
    assert response.output_text == chat_of(served, messages=messages, max_tokens=16,
                                           temperature=0).choices[0].message.content
    assert (response.usage.input_tokens, response.usage.output_tokens) == (len(tokenizer(prompt).input_ids), 16)
    assert response.usage.total_tokens == response.usage.input_tokens + 16
    assert (response.status, response.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    item, = response.output
    assert (item.type, item.role, item.status, item.content[0].type) == ("message", "assistant", "incomplete",
                                                                         "output_text")
    assert response.id.startswith("resp_") and item.id.startswith("msg_") and response.object == "response"
    assert (response.instructions, response.max_output_tokens, response.store, response.metadata) == (
        "You write Python.", 16, True, {"team": "a"})
    assert response.model_extra["specpool"]["target_passes"] >= 1


def test_input_items_are_the_chat_messages_they_stand_for(served):
    """A list of message items (content parts, a developer message) answers what the same chat answers."""
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "input_text", "text": "a "}, {"type": "input_text",
                                                                                  "text": "point"}]}]
    response = served.client.responses.create(model=served.model, input=items, max_output_tokens=12, temperature=0)
    chat = chat_of(served, messages=[{"role": "developer", "content": "Be brief."}, *CHAT], max_tokens=12,
                   temperature=0)
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_a_streamed_response_is_the_whole_one_in_the_responses_events_order(served):
    body = dict(input="a point", max_output_tokens=16, temperature=0)
    whole = served.client.responses.create(model=served.model, **body)
    events = events_of(served, body)
    kinds = [event.type for event in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"] and deltas >= 1
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == events[-4].text == events[-1].response.output_text == whole.output_text
    item_id = events[2].item.id
    assert all(event.item_id == item_id for event in events[3:-3]) and events[-2].item.id == item_id
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens == 16
    assert events[-1].response.status == "incomplete" and events[-2].item.status == "incomplete"


def test_the_raw_stream_names_each_event_and_ends_without_done(served):
    body = {"model": served.model, "input": "x", "max_output_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", served.base_url + "/responses", json=body) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        frames = response.read().decode().split("\n\n")
    assert frames[-1] == "" and "[DONE]" not in "".join(frames)
    for frame in frames[:-1]:
        kind, data = frame.split("\n")
        assert kind == "event: " + json.loads(data.removeprefix("data: "))["type"]


POINT_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
                "required": ["n"], "additionalProperties": False}
POINT = {"type": "function", "function": {"name": "make_point", "parameters": POINT_SCHEMA}}


def test_a_named_function_is_called_with_the_arguments_chat_gets(served):
    """tool_choice naming a function (chat's tested against the target alone under the schema): one function_call
    item, whole and streamed, its arguments chat's."""
    chat = chat_of(served, messages=CHAT, tools=[POINT], max_tokens=24, temperature=0,
                   tool_choice={"type": "function", "function": {"name": "make_point"}})
    expected = chat.choices[0].message.tool_calls[0].function.arguments
    body = dict(input="a point", tools=[flat(POINT)], tool_choice={"type": "function", "name": "make_point"},
                max_output_tokens=24, temperature=0)
    response = served.client.responses.create(model=served.model, **body)
    call, = response.output
    assert (call.type, call.name, call.arguments, call.status) == ("function_call", "make_point", expected,
                                                                   "completed")
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and response.status == "completed"
    events = events_of(served, body)
    assert [e.type for e in events if "arguments" not in e.type] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.output_item.done",
        "response.completed"]
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert pieces == done.arguments == events[-1].response.output[0].arguments == expected
    assert done.name == "make_point"
    with served.client.responses.stream(model=served.model, **body) as stream:     # the SDK's stream helper
        assert stream.get_final_response().output[0].arguments == expected


def test_auto_calls_follow_the_text_before_them_whole_and_streamed(served):
    """tool_choice "auto" with the hermes parser, the call forced by a regex (as in chat's test): a message item
    with the text before the call, then the function_call item."""
    regex = r'Checking\.<tool_call>\{"name": "get_time", "arguments": \{\}\}</tool_call>'
    body = dict(input="a point", tools=[flat(UNIT_TOOL), flat(TIME_TOOL)], max_output_tokens=64, temperature=0,
                extra_body={"guided_regex": regex})
    response = served.client.responses.create(model=served.model, **body)
    message, call = response.output
    assert (message.type, response.output_text, call.type, call.name, call.arguments) == (
        "message", "Checking.", "function_call", "get_time", "{}")
    final = events_of(served, body)[-1].response
    assert [(item.type, getattr(item, "name", None)) for item in final.output] == [
        ("message", None), ("function_call", "get_time")] and final.output_text == "Checking."


def test_a_call_and_its_output_are_the_chat_conversation_they_stand_for(served):
    called = {"name": "set_unit", "arguments": '{"unit": "celsius"}'}
    items = [*CHAT, {"type": "function_call", "call_id": "call_1", **called},
             {"type": "function_call_output", "call_id": "call_1", "output": "ok"}]
    response = served.client.responses.create(model=served.model, input=items, tools=[flat(UNIT_TOOL)],
                                              tool_choice="none", max_output_tokens=16, temperature=0)
    chat = chat_of(served, messages=[*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": called}]}, {"role": "tool", "tool_call_id": "call_1",
                                                                     "content": "ok"}],
        tools=[UNIT_TOOL], tool_choice="none", max_tokens=16, temperature=0)
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_text_format_json_schema_is_chats_response_format(served):
    fmt = {"type": "json_schema", "name": "point", "schema": POINT_SCHEMA, "strict": True}
    response = served.client.responses.create(model=served.model, input="a point", max_output_tokens=32,
                                              temperature=0, text={"format": fmt})
    chat = chat_of(served, messages=CHAT, max_tokens=32, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "point", "schema": POINT_SCHEMA, "strict": True}})
    assert response.output_text == chat.choices[0].message.content and response.output_text.startswith('{"n": ')
    assert response.text.format.type == "json_schema"


def test_included_logprobs_are_chats_whole_and_streamed(served):
    """The same tokens and alternatives as chat's, and their logprobs to float noise: each request's verify passes
    have their own shapes (the adaptive K, the batch), whose sums differ in the last bits."""
    body = dict(input="a point", max_output_tokens=8, temperature=0, top_logprobs=2,
                include=["message.output_text.logprobs"])
    response = served.client.responses.create(model=served.model, **body)
    chat = chat_of(served, messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    expected = chat.choices[0].logprobs.content
    tokens = [e.token for e in expected]
    got = response.output[0].content[0].logprobs
    assert [(e.token, [t.token for t in e.top_logprobs]) for e in got] == \
        [(e.token, [t.token for t in e.top_logprobs]) for e in expected]
    assert [(e.logprob, *(t.logprob for t in e.top_logprobs)) for e in got] == [pytest.approx(
        (e.logprob, *(t.logprob for t in e.top_logprobs)), abs=1e-4) for e in expected]
    events = events_of(served, body)
    streamed = [e for event in events if event.type == "response.output_text.delta" for e in event.logprobs]
    assert [e.token for e in streamed] == tokens
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in expected], abs=1e-4)
    plain = served.client.responses.create(model=served.model, input="a point", max_output_tokens=8, temperature=0)
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == response.output_text


@pytest.mark.parametrize("body, param", [
    ({"n": 2}, "n"), ({"max_tokens": 5}, "max_tokens"), ({"background": True, "store": False}, "background"),
    ({"background": "yes"}, "background"),
    ({"input": [{"role": "user", "content": "a", "id": "m"}, {"role": "user", "content": "b", "id": "m"}]}, "input"),
    ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),         # the demo's chat template does not read it
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),             # chat's name: "send `reasoning.effort`"
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "web_search"}]}, "tools"), ({"tool_choice": "required"}, "tool_choice"),
    ({"input": []}, "input"), ({"input": 3}, "input"), ({"input": [{"type": "item_reference", "id": "r"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"max_output_tokens": 0}, "max_output_tokens"), ({"max_output_tokens": 10 ** 6}, "max_output_tokens"),
    ({"text": {"verbosity": "high"}}, "text.verbosity"), ({"text": {"format": {"type": "json_schema"}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, "text.format"),
    ({"include": ["everything"]}, "include"), ({"top_logprobs": 21}, "top_logprobs"),
    ({"input": [{"type": [], "role": "user", "content": "x"}]}, "input"),
    ({"max_completion_tokens": 5}, "max_completion_tokens"), ({"logprobs": True}, "logprobs"),     # chat's names
    ({"messages": [{"role": "user", "content": "x"}]}, "messages"),
    ({"tools": [flat(UNIT_TOOL)], "tool_choice": {"type": "function", "function": {"name": "set_unit"}}},
     "tool_choice"), ({"tool_choice": 3}, "tool_choice"),
    ({"text": {"format": {"type": "json_object"}}, "guided_regex": "a+"}, "guided_regex"),   # names text.format
])
def test_a_request_that_cannot_be_served_is_refused_naming_the_responses_parameter(served, body, param):
    base = {"model": served.model, "input": "x", "max_output_tokens": 4}
    refused = requests_counted(served, "INVALID_ARGUMENT")
    response = httpx.post(served.base_url + "/responses", json={**base, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error
    chats = {"messages", "max_completion_tokens", "response_format"} - {param}     # chat's names, not sent
    assert not chats & set(re.findall(r"\w+", error["message"])), error
    assert requests_counted(served, "INVALID_ARGUMENT") == refused + 1
    assert httpx.post(served.base_url + "/responses", json=base).status_code == 200


def test_neutral_values_of_refused_parameters_are_accepted(served):
    body = {"model": served.model, "input": "x", "max_output_tokens": 4, "n": 1, "best_of": 1, "store": True,
            "background": False, "truncation": "disabled", "text": {"verbosity": "medium"}, "service_tier": "auto"}
    response = httpx.post(served.base_url + "/responses", json=body)
    assert response.status_code == 200, response.text


def test_previous_response_id_continues_the_stored_conversation_without_its_instructions(served):
    """A response continues a stored one as chat continues the conversation: the first's input, its answer as the
    assistant's message, then the new input; the first's instructions are not carried over (OpenAI's rule), the
    second's own are. Streamed responses are stored too."""
    first = served.client.responses.create(model=served.model, instructions="You write Python.", input="a point",
                                           max_output_tokens=8, temperature=0)
    second = served.client.responses.create(model=served.model, previous_response_id=first.id, input="and a line",
                                            instructions="Be brief.", max_output_tokens=8, temperature=0)
    turns = [{"role": "system", "content": "Be brief."}, *CHAT, {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": "and a line"}]
    chat = chat_of(served, messages=turns, max_tokens=8, temperature=0)
    assert second.output_text == chat.choices[0].message.content and second.previous_response_id == first.id
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    third = events_of(served, dict(previous_response_id=second.id, input="more", max_output_tokens=8,
                                   temperature=0))[-1].response
    chat = chat_of(served, messages=[*turns[1:], {"role": "assistant", "content": second.output_text},
                                     {"role": "user", "content": "more"}], max_tokens=8, temperature=0)
    assert third.output_text == chat.choices[0].message.content
    assert served.client.responses.retrieve(third.id).output_text == third.output_text


def test_a_called_function_and_its_output_continue_a_stored_response(served):
    """The stored answer's function call goes back as the assistant's call; the client sends only its output."""
    first = served.client.responses.create(model=served.model, input="a point", tools=[flat(POINT)],
                                           tool_choice={"type": "function", "name": "make_point"},
                                           max_output_tokens=24, temperature=0)
    call = first.output[0]
    second = served.client.responses.create(
        model=served.model, previous_response_id=first.id, tools=[flat(POINT)], tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "done"}], max_output_tokens=8,
        temperature=0)
    chat = chat_of(served, messages=[*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": "make_point", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "done"}], tools=[POINT], tool_choice="none",
        max_tokens=8, temperature=0)
    assert second.output_text == chat.choices[0].message.content
    given = served.client.responses.input_items.list(second.id, order="asc").data
    assert [(item.type, item.id, item.call_id) for item in given[1:]] == [
        ("function_call", call.id, call.call_id), ("function_call_output", given[2].id, call.call_id)]
    assert (given[1].name, given[1].arguments, given[2].output) == ("make_point", call.arguments, "done")


def test_a_stored_response_is_retrieved_and_deleted_and_one_not_stored_is_not_found(served):
    kept = served.client.responses.create(model=served.model, input="x", max_output_tokens=4, temperature=0)
    got = httpx.get(f"{served.base_url}/responses/{kept.id}")
    assert got.status_code == 200 and got.json() == kept.model_dump(mode="json", exclude_unset=True), got.text
    deleted = httpx.delete(f"{served.base_url}/responses/{kept.id}")
    assert deleted.json() == {"id": kept.id, "object": "response", "deleted": True}
    unstored = served.client.responses.create(model=served.model, input="x", max_output_tokens=4, store=False)
    assert unstored.store is False
    for response_id in (kept.id, unstored.id):
        for method in ("GET", "DELETE"):
            missing = httpx.request(method, f"{served.base_url}/responses/{response_id}")
            assert missing.status_code == 404 and missing.json()["error"]["param"] == "response_id"
        refused = httpx.post(served.base_url + "/responses", json={
            "model": served.model, "input": "x", "previous_response_id": response_id})
        error = refused.json()["error"]
        assert (refused.status_code, error["param"], error["code"]) == (400, "previous_response_id",
                                                                         "previous_response_not_found")  # OpenAI's
    assert httpx.get(f"{served.base_url}/responses/{unstored.id}?stream=true").status_code == 404
    stored = served.client.responses.create(model=served.model, input="x", max_output_tokens=4)
    streamed = httpx.get(f"{served.base_url}/responses/{stored.id}?stream=true")
    assert (streamed.status_code, streamed.json()["error"]["param"]) == (400, "stream")     # not served
    wrong = httpx.post(f"{served.base_url}/responses/{kept.id}")
    assert wrong.status_code == 405 and set(wrong.headers["allow"].split(", ")) == {"GET", "DELETE"}


def test_input_items_list_what_a_stored_response_was_given_newest_first(served):
    """GET /v1/responses/{id}/input_items (the SDK's input_items.list, paged): a continuation's items are the
    conversation it was given, the earlier response's input and answer (under that answer's id) included, its
    instructions not (they are not input); each item keeps its id from one response to the next."""
    developer = {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be "},
                                                                       {"type": "input_text", "text": "brief."}]}
    first = served.client.responses.create(model=served.model, instructions="You write Python.",
                                           input=[developer, {"role": "user", "content": "a point"}],
                                           max_output_tokens=4, temperature=0)
    second = served.client.responses.create(model=served.model, previous_response_id=first.id, input="and a line",
                                            max_output_tokens=4, temperature=0)
    listed = list(served.client.responses.input_items.list(second.id, limit=2))     # two pages and one item
    assert [(item.role, [part.text for part in item.content]) for item in listed[::-1]] == [
        ("developer", ["Be ", "brief."]), ("user", ["a point"]), ("assistant", [first.output_text]),
        ("user", ["and a line"])]
    assert [part.type for item in listed for part in item.content] == [
        "input_text", "output_text", "input_text", "input_text", "input_text"]
    assert listed[1].id == first.output[0].id and len({item.id for item in listed}) == 4
    earlier = served.client.responses.input_items.list(first.id, order="asc").data
    assert [item.id for item in earlier] == [item.id for item in listed[:1:-1]]
    url = f"{served.base_url}/responses/{second.id}/input_items"
    paged = httpx.get(url, params={"order": "asc", "after": earlier[0].id, "limit": 2}).json()
    assert [item["id"] for item in paged["data"]] == [listed[2].id, listed[1].id] and paged["has_more"] is True
    for params, param in (({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"order": "up"}, "order"),
                          ({"after": "msg_nope"}, "after")):
        refused = httpx.get(url, params=params)
        assert (refused.status_code, refused.json()["error"]["param"]) == (400, param), refused.text
    missing = httpx.get(f"{served.base_url}/responses/resp_nope/input_items")
    assert (missing.status_code, missing.json()["error"]["param"]) == (404, "response_id")


def test_responses_sent_one_x_request_id_are_each_stored_and_found(served):
    """A stored response's id is its own (not the client's X-Request-Id, which comes back as the header): two
    responses sent one header, a continuation sent its parent's, each stays retrievable as answered."""
    sent = {"X-Request-Id": "trace-1"}
    first, second = (httpx.post(served.base_url + "/responses", headers=sent, json={
        "model": served.model, "input": text, "max_output_tokens": 4, "temperature": 0}) for text in ("a", "b"))
    third = httpx.post(served.base_url + "/responses", headers=sent, json={
        "model": served.model, "input": "c", "max_output_tokens": 4, "previous_response_id": first.json()["id"]})
    answers = [first, second, third]
    assert [a.headers["x-request-id"] for a in answers] == ["trace-1"] * 3
    assert len({a.json()["id"] for a in answers}) == 3
    for answer in answers:
        assert httpx.get(f"{served.base_url}/responses/{answer.json()['id']}").json() == answer.json()


def test_a_call_sent_again_beside_its_stored_response_is_refused(served):
    first = served.client.responses.create(model=served.model, input="a point", tools=[flat(POINT)],
                                           tool_choice={"type": "function", "name": "make_point"},
                                           max_output_tokens=24, temperature=0)
    call = first.output[0]
    again = {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments}
    refused = httpx.post(served.base_url + "/responses", json={
        "model": served.model, "previous_response_id": first.id, "tools": [flat(POINT)],
        "input": [again, {"type": "function_call_output", "call_id": call.call_id, "output": "done"}]})
    error = refused.json()["error"]
    assert (refused.status_code, error["param"]) == (400, "input") and error["message"].startswith("input[0]: ")


def test_a_stream_its_client_leaves_frees_its_sessions_and_is_not_stored(served):
    from tests.test_e2e_sessions import active_sessions, wait_for_no_sessions
    body = {"model": served.model, "input": "x", "max_output_tokens": 900, "temperature": 0, "stream": True,
            "ignore_eos": True, "speculation": {"k": 1}}
    cancelled = requests_counted(served, "CANCELLED")
    with httpx.Client(timeout=60) as client, client.stream("POST", served.base_url + "/responses", json=body) as left:
        lines = left.iter_lines()
        assert next(lines) == "event: response.created"
        response_id = json.loads(next(lines).removeprefix("data: "))["response"]["id"]
        assert active_sessions(served) == [1, 1]
    assert wait_for_no_sessions(served, timeout=20) == [0, 0]
    deadline = time.monotonic() + 10
    while requests_counted(served, "CANCELLED") == cancelled and time.monotonic() < deadline:
        time.sleep(0.05)                    # counted as the stream's handler ends
    assert requests_counted(served, "CANCELLED") == cancelled + 1
    assert httpx.get(f"{served.base_url}/responses/{response_id}").status_code == 404


def polled(served, response_id: str, until=lambda response: response.status not in ("queued", "in_progress"),
           timeout: float = 60):
    """A background response, retrieved until `until` holds (by default: until it is over)."""
    deadline = time.monotonic() + timeout
    while True:
        response = served.client.responses.retrieve(response_id)
        if until(response) or time.monotonic() > deadline:
            return response
        time.sleep(0.05)


def test_a_background_response_is_polled_until_over_and_answers_as_in_the_foreground(served):
    """`background: true`: the POST answers at once, queued; polled, the response comes out as the same request
    answered in the foreground (the target alone's greedy text, tested above), stored and continued as it is."""
    body = dict(instructions="You write Python.", input="a point", max_output_tokens=24, temperature=0)
    foreground = served.client.responses.create(model=served.model, **body)
    created = served.client.responses.create(model=served.model, background=True, **body)
    assert (created.status, created.background, created.output, created.usage) == ("queued", True, [], None)
    over = polled(served, created.id)
    assert (over.status, over.output_text, over.usage.output_tokens) == (
        foreground.status, foreground.output_text, foreground.usage.output_tokens)
    assert over.background is True and over.store is True and over.id == created.id
    after_each = [served.client.responses.create(model=served.model, previous_response_id=first, input="and a line",
                                                 max_output_tokens=8, temperature=0) for first in (foreground.id,
                                                                                                   over.id)]
    assert after_each[0].output_text == after_each[1].output_text
    given = served.client.responses.input_items.list(after_each[1].id, order="asc").data
    assert [item.role for item in given] == ["user", "assistant", "user"] and given[1].id == over.output[0].id


def test_a_background_stream_is_one_stream_replayed_from_any_event(served):
    """Streamed in the background: queued, then in progress, then the foreground stream's events; retrieved with
    `stream=true` it is the same events again (from `starting_after` on), and a client that leaves it stops
    nothing: a stream retrieved meanwhile follows the rest to the end."""
    body = dict(input="a point", max_output_tokens=16, temperature=0)
    events = events_of(served, {**body, "background": True})
    foreground = events_of(served, body)
    kinds = [event.type for event in events]
    assert kinds[:3] == ["response.created", "response.queued", "response.in_progress"]
    but_deltas = [kinds[3:], [event.type for event in foreground[2:]]]      # answers may travel differently grouped
    assert [[kind for kind in each if not kind.endswith(".delta")] for each in but_deltas] == [[
        "response.output_item.added", "response.content_part.added", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.incomplete"]] * 2
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert [events[i].response.status for i in (0, 1, 2)] == ["queued", "queued", "in_progress"]
    assert events[-1].response.output_text == foreground[-1].response.output_text
    response_id = events[0].response.id
    again = list(served.client.responses.retrieve(response_id, stream=True))
    assert [event.model_dump() for event in again] == [event.model_dump() for event in events]
    later = list(served.client.responses.retrieve(response_id, stream=True, starting_after=3))
    assert [event.model_dump() for event in later] == [event.model_dump() for event in events[4:]]
    long = {"model": served.model, "input": "x", "max_output_tokens": 48, "temperature": 0, "ignore_eos": True,
            "stream": True, "background": True}
    with httpx.stream("POST", served.base_url + "/responses", json=long, timeout=60) as left:
        lines = left.iter_lines()
        assert next(lines) == "event: response.created"
        response_id = json.loads(next(lines).removeprefix("data: "))["response"]["id"]
    followed = list(served.client.responses.retrieve(response_id, stream=True, starting_after=0))
    assert followed[0].sequence_number == 1 and followed[-1].type == "response.incomplete"
    assert followed[-1].response.usage.output_tokens == 48 == polled(served, response_id).usage.output_tokens


def test_a_cancelled_background_response_stops_frees_its_sessions_and_keeps_its_output(served):
    """POST /v1/responses/{id}/cancel: the run stops (its workers' sessions freed, counted CANCELLED), the response
    is `cancelled` with the output its stream had sent; cancelling again answers the same. DELETE cancels a
    running one too. A running response cannot be continued, one answered in the foreground cannot be
    cancelled."""
    from tests.test_e2e_sessions import active_sessions, wait_for_no_sessions
    body = dict(input="x", max_output_tokens=900, temperature=0, background=True,
                extra_body={"ignore_eos": True, "speculation": {"k": 1}})
    cancelled = requests_counted(served, "CANCELLED")
    running = served.client.responses.create(model=served.model, **body)
    assert polled(served, running.id, until=lambda response: response.output_text).status == "in_progress"
    assert active_sessions(served) == [1, 1]
    assert [item.content[0].text for item in served.client.responses.input_items.list(running.id)] == ["x"]
    continuing = httpx.post(served.base_url + "/responses", json={
        "model": served.model, "input": "x", "previous_response_id": running.id})
    assert (continuing.status_code, continuing.json()["error"]["param"]) == (400, "previous_response_id")
    stopped = served.client.responses.cancel(running.id)
    assert stopped.status == "cancelled" and stopped.output_text and stopped.usage.output_tokens > 0
    continuing = httpx.post(served.base_url + "/responses", json={
        "model": served.model, "input": "x", "previous_response_id": running.id})
    assert (continuing.status_code, continuing.json()["error"]["param"]) == (400, "previous_response_id")
    assert wait_for_no_sessions(served, timeout=20) == [0, 0]
    assert requests_counted(served, "CANCELLED") == cancelled + 1
    assert served.client.responses.cancel(running.id) == stopped == served.client.responses.retrieve(running.id)
    replayed = list(served.client.responses.retrieve(running.id, stream=True))
    assert "".join(event.delta for event in replayed if event.type == "response.output_text.delta") == \
        stopped.output_text
    deleted = served.client.responses.create(model=served.model, **body)
    polled(served, deleted.id, until=lambda response: response.status == "in_progress")
    # DELETE waits for the run to stop and free its sessions: longer than httpx's 5 s on a loaded 2-core machine
    assert httpx.delete(f"{served.base_url}/responses/{deleted.id}", timeout=30).json()["deleted"] is True
    assert wait_for_no_sessions(served, timeout=20) == [0, 0]
    assert httpx.get(f"{served.base_url}/responses/{deleted.id}").status_code == 404
    foreground = served.client.responses.create(model=served.model, input="x", max_output_tokens=4)
    for response_id, status in ((foreground.id, 400), ("resp_nope", 404)):
        refused = httpx.post(f"{served.base_url}/responses/{response_id}/cancel")
        assert (refused.status_code, refused.json()["error"]["param"]) == (status, "response_id")
    for query, param in (("starting_after=2", "starting_after"), ("stream=true&starting_after=-1", "starting_after")):
        refused = httpx.get(f"{served.base_url}/responses/{running.id}?{query}")
        assert (refused.status_code, refused.json()["error"]["param"]) == (400, param), refused.text


def test_a_background_response_is_admitted_as_any_request(start_service):
    """With every slot taken and no queue, a background response is a 429 when it is sent (not a response that
    fails later), also when two are sent at once for the last slot; one that runs holds its slot until it is over
    or cancelled. A stopping server cancels those still running once their grace is over."""
    from concurrent.futures import ThreadPoolExecutor
    served = served_over_http(start_service, router={"max_active_requests": 1, "max_queued_requests": 0})
    body = {"model": served.model, "input": "x", "max_output_tokens": 900, "temperature": 0, "background": True,
            "ignore_eos": True, "speculation": {"k": 1}}
    def send(**changed) -> httpx.Response:
        return httpx.post(served.base_url + "/responses", json={**body, **changed}, timeout=60)
    refused = requests_counted(served, "RESOURCE_EXHAUSTED")
    with ThreadPoolExecutor(2) as pool:
        sent = list(pool.map(lambda _: send(), range(2)))
    assert sorted(answer.status_code for answer in sent) == [200, 429]
    assert requests_counted(served, "RESOURCE_EXHAUSTED") == refused + 1
    running = next(answer.json()["id"] for answer in sent if answer.status_code == 200)
    polled(served, running, until=lambda response: response.status == "in_progress")
    assert send().status_code == 429
    served.client.responses.cancel(running)
    second = send(max_output_tokens=4).json()["id"]
    assert polled(served, second).status == "incomplete"
    third = send().json()["id"]
    polled(served, third, until=lambda response: response.status == "in_progress")
    api = served.service.http._app.state.stopping.__self__          # what HttpServer.stop calls first
    served._run(api.cancel_background())
    assert served.client.responses.retrieve(third).status == "cancelled"


def test_a_stored_response_is_found_with_the_api_key_that_stored_it_only():
    """With http.api_keys, each key reaches the responses it stored: another key's GET, DELETE and
    previous_response_id find nothing there (as OpenAI keeps a project's responses to it)."""
    import asyncio
    from openai_api.app import Api
    from openai_api.protocol import ApiError
    from openai_api.responses_api import InputMessage, ResponsesRequest
    from settings.schema import HttpConfig
    api = Api(HttpConfig(api_keys=["key-a", "key-b"]), lambda: None)
    a, b = (types.SimpleNamespace(headers={"authorization": f"Bearer {key}"}, method="GET") for key in ("key-a",
                                                                                                      "key-b"))
    response = {"id": "resp_1", "status": "completed", "output": []}
    api.stored.put(response, [InputMessage(id="msg_1", role="user", content="x")], 1, api.owner(a))
    assert json.loads(asyncio.run(api.stored_response("resp_1", a)).body) == response
    continuing = ResponsesRequest.model_validate({"model": "m", "input": "x", "previous_response_id": "resp_1"})
    assert len(api.conversation(continuing, api.owner(a))) == 2
    with pytest.raises(ApiError) as other_get:
        asyncio.run(api.stored_response("resp_1", b))
    with pytest.raises(ApiError) as other_continues:
        api.conversation(continuing, api.owner(b))
    assert (other_get.value.status, other_continues.value.code) == (404, "previous_response_not_found")
    assert not api.stored.delete("resp_1", api.owner(b)) and api.stored.get("resp_1", api.owner(a)) is not None
    assert Api(HttpConfig(), lambda: None).owner(b) == ""      # without keys, one owner: everyone


def test_a_prediction_changes_no_text_and_usage_counts_it_as_chat_does(served):
    """The Responses API passes a prediction (a specpool extension) on to the chat completion it stands for; its
    usage carries that completion's accepted and rejected prediction tokens, and none without a prediction."""
    body = {"model": served.model, "input": "a point", "max_output_tokens": 32, "temperature": 0}
    plain = httpx.post(served.base_url + "/responses", json=body, timeout=120).json()
    text = plain["output"][0]["content"][0]["text"]
    assert set(plain["usage"]["output_tokens_details"]) == {"reasoning_tokens"}
    prediction = {"type": "content", "content": text}
    predicted = httpx.post(served.base_url + "/responses", json={**body, "prediction": prediction}, timeout=120).json()
    chat = httpx.post(served.base_url + "/chat/completions", timeout=120, json={
        "model": served.model, "messages": [{"role": "user", "content": "a point"}], "max_tokens": 32,
        "temperature": 0, "prediction": prediction}).json()
    assert predicted["output"][0]["content"][0]["text"] == text
    details, chat_details = predicted["usage"]["output_tokens_details"], chat["usage"]["completion_tokens_details"]
    assert [details[key] for key in PREDICTION_COUNTS] == [chat_details[key] for key in PREDICTION_COUNTS]
    assert details["accepted_prediction_tokens"] >= 0.9 * predicted["usage"]["output_tokens"]


def test_a_length_error_names_max_output_tokens(served):
    response = httpx.post(served.base_url + "/responses", json={"model": served.model, "input": "x",
                                                                 "max_output_tokens": 4, "min_tokens": 9})
    error = response.json()["error"]
    assert (response.status_code, error["param"]) == (400, "min_tokens") and "max_output_tokens=4" in error["message"]


def test_a_seeded_sampled_response_is_the_seeded_chat_completion(served):
    """Sampling parameters (and vLLM's, in the body) reach the router as chat's do."""
    body = dict(temperature=0.9, top_p=0.95, extra_body={"seed": 11, "top_k": 20})
    response = served.client.responses.create(model=served.model, input="a point", max_output_tokens=12, **body)
    chat = chat_of(served, messages=CHAT, max_tokens=12, **body)
    assert response.output_text == chat.choices[0].message.content
    assert (response.temperature, response.top_p) == (0.9, 0.95)
    assert stream_assembled(chat_of(served, messages=CHAT, max_tokens=12, stream=True, **body))[0] == \
        events_of(served, dict(input="a point", max_output_tokens=12, **body))[-1].response.output_text


# The events alone, on scripted outputs (no server): what the stream puts together is the answer read whole

def scripted(plan, pieces: list, finish: int, logprobs: bool = True) -> tuple[dict, list[dict]]:
    """(the Response read whole, the stream's event payloads) of an output arriving as `pieces` (each a chunk's
    text; a token of it each, its token ID its index), ended with `finish` (a FinishReason)."""
    from openai_api.responses_api import ResponseObjects, ResponsesRequest
    from protos.specpool.v1 import generation_pb2
    from router.stopping import Chunk
    body = ResponsesRequest.model_validate({"model": "m", "input": "x"})
    state = types.SimpleNamespace(top_logprobs=1 if logprobs else None, prompt_len=3, generated=len(pieces),
                                  stats=generation_pb2.GenerationStats(), prediction=())
    entry = [generation_pb2.TokenLogprob(token_id=i, logprob=-i / 10, top=[generation_pb2.TopLogprob(
        token_id=i, logprob=-i / 10)]) for i in range(len(pieces))]
    chunks = [Chunk([i], piece, [entry[i]] if logprobs else [], finish if i == len(pieces) - 1 else 0)
              for i, piece in enumerate(pieces)]
    whole_kind, stream_kind = (ResponseObjects(str, plan, body) for _ in range(2))
    for kind in (whole_kind, stream_kind):
        kind.bind([state])
    choice = whole_kind.choice(0, "".join(pieces), entry if logprobs else None, FINISH[finish])
    events = stream_kind.events("r", "m")
    frames = events.start() + [text for index, chunk in enumerate(chunks) for text in events.chunk(0, chunk)]
    return whole_kind.whole("r", "m", [choice]), [json.loads(f.split("\ndata: ")[1]) for f in frames + events.end()]


FINISH = {1: "length", 2: "stop"}        # FINISH_REASON_LENGTH, FINISH_REASON_STOP
HERMES_CALL = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'


def without_ids(items: list) -> list:
    """The items, their ids (made up per answer) left out."""
    return [{key: value for key, value in item.items() if key not in ("id", "call_id")} for item in items]


@pytest.mark.parametrize("choice, pieces, finish", [
    ("none", ["def", " f", "(", ""], 2),                       # a last token without text (EOS): its logprob too
    ("none", [], 2),                                            # nothing: an empty message
    ("none", ["\n", " "], 1),                                   # only whitespace and no call: the message
    ("auto", ["\n", *HERMES_CALL], 2),                          # whitespace, then a call: the call alone
    ("auto", ["Checking", ".", *HERMES_CALL], 2),               # text, then a call
    ("named", ['{"n"', ": 4"], 1),                              # a named call cut at max_output_tokens
])
def test_the_stream_put_together_is_the_response_read_whole(choice, pieces, finish):
    from pydantic import TypeAdapter
    from openai.types.responses import Response, ResponseStreamEvent
    from openai_api.tools import PARSERS, Tool, ToolPlan
    tools = tuple(Tool.model_validate(tool) for tool in (TIME_TOOL, POINT))
    plan = ToolPlan(tools, choice, "make_point" if choice == "named" else "", PARSERS["hermes"])
    whole, payloads = scripted(plan, pieces, finish)
    final = payloads[-1]["response"]
    assert without_ids(final["output"]) == without_ids(whole["output"]) and final["status"] == whole["status"]
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    for item in final["output"]:
        if item["type"] == "message":
            deltas = [p for p in payloads if p["type"] == "response.output_text.delta" and p["item_id"] == item["id"]]
            assert "".join(p["delta"] for p in deltas) == item["content"][0]["text"]
            assert [e for p in deltas for e in p["logprobs"]] == item["content"][0]["logprobs"]
    if pieces and choice != "named" and not (choice == "auto" and "Checking" not in pieces):
        assert len(whole["output"][0]["content"][0]["logprobs"]) == len(pieces)   # every token's, the call's too
    for payload in payloads:                   # as the SDK's own types have them (strictly: no field missing)
        TypeAdapter(ResponseStreamEvent).validate_python(payload, strict=False)
    Response.model_validate(whole)


def test_a_failure_mid_stream_is_an_error_event_then_response_failed():
    from openai_api.protocol import ApiError
    from openai_api.responses_api import ResponseObjects, ResponsesRequest
    from openai_api.tools import ToolPlan
    from protos.specpool.v1 import generation_pb2
    kind = ResponseObjects(str, ToolPlan(), ResponsesRequest.model_validate({"model": "m", "input": "x"}),
                           store=lambda response: pytest.fail("a failed response is stored"))
    kind.bind([types.SimpleNamespace(top_logprobs=None, prompt_len=3, generated=0, prediction=(),
                                     stats=generation_pb2.GenerationStats())])
    events = kind.events("r", "m")
    from router.stopping import Chunk
    events.start(), events.chunk(0, Chunk([5], "def f", []))
    error, failed = (json.loads(f.split("\ndata: ")[1]) for f in events.failed(
        ApiError(503, "target 0 failed", kind="service_unavailable")))
    assert (error["type"], error["code"], error["message"]) == ("error", "server_error", "target 0 failed")
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "server_error", "message": "target 0 failed"}
    assert failed["response"]["store"] is False              # not stored: a later GET finds nothing
    message, = failed["response"]["output"]                  # the text already sent, the message left incomplete
    assert (message["status"], message["content"][0]["text"]) == ("incomplete", "def f")



def test_a_background_run_that_breaks_is_stored_failed_and_its_followers_end():
    """An unexpected error in a background run (no handler left to answer a 500): the response is stored `failed`
    with its output so far, and a stream following it ends; its events, queued ones included, validate against the
    SDK's types."""
    import asyncio
    from pydantic import TypeAdapter
    from openai.types.responses import ResponseStreamEvent
    from openai_api.background import BackgroundRun
    from openai_api.responses_api import ResponseObjects, ResponsesRequest
    from openai_api.tools import ToolPlan
    from protos.specpool.v1 import generation_pb2
    from router.stopping import Chunk
    stored = []
    kind = ResponseObjects(str, ToolPlan(), ResponsesRequest.model_validate({"model": "m", "input": "x",
                                                                             "background": True}), stored.append)
    kind.bind([types.SimpleNamespace(top_logprobs=None, prompt_len=3, generated=1, prediction=(),
                                     stats=generation_pb2.GenerationStats())])
    events, run = kind.events("r", "m"), BackgroundRun()

    async def texts():
        for text in events.start() + events.chunk(0, Chunk([5], "def f", [])):
            yield text
        raise RuntimeError("a bug")

    async def followed() -> list[str]:
        run.start(events, texts())
        assert run.current()["status"] == "queued"
        return [text async for text in run.follow()]
    frames = asyncio.run(asyncio.wait_for(followed(), timeout=10))
    payloads = [json.loads(frame.split("\ndata: ")[1]) for frame in frames]
    assert [p["type"] for p in payloads] == ["response.created", "response.queued", "response.in_progress",
                                             "response.output_item.added", "response.content_part.added",
                                             "response.output_text.delta", "error", "response.failed"]
    for payload in payloads:
        TypeAdapter(ResponseStreamEvent).validate_python(payload, strict=False)
    failed, = stored
    assert (failed["status"], failed["error"]["code"], failed["store"], failed["background"]) == (
        "failed", "server_error", True, True)
    assert failed["output"][0]["content"][0]["text"] == "def f" and run.current() == failed
