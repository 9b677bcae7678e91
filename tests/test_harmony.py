"""gpt-oss's harmony format (openai_api/harmony.py): the `openai_gptoss` reasoning parser and the `openai` tool-call
parser. An output reads as its messages (analysis: the reasoning; final and preambles: the content; to=functions.NAME:
the calls), the same whole and at every split of a stream; chat answers carry all three, whole and streamed; the
reasoning tokens and a Responses message's own tokens are counted without the markers; and, served, a harmony
request keeps special tokens in its text, which the markers are."""
import httpx
import pytest

from openai_api.choices import ChatCompletions
from openai_api.harmony import call_block, messages
from openai_api.reasoning import HARMONY, for_request
from openai_api.tools import message, openai_calls
from tests.test_tool_calls import assembled, plan

ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather.<|end|>"
THOUGHT = "The user wants the weather."
WEATHER_CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                '{"city":"Oslo"}')          # <|call|> is an end-of-sequence token: not in the text
WEATHER_BLOCK = '<|start|>assistant to=functions.get_weather<|channel|>commentary<|message|>{"city":"Oslo"}'
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny."


@pytest.mark.parametrize("text, expected", [
    (ANALYSIS + FINAL, (THOUGHT, "It is sunny.")),
    (ANALYSIS + WEATHER_CALL, (THOUGHT, WEATHER_BLOCK)),                          # a call: written back as one message
    (ANALYSIS + '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Oslo"}'
     "<|call|>", (THOUGHT, WEATHER_BLOCK + "<|call|>")),                          # the recipient after the role
    (" to=functions.get_time<|channel|>commentary json<|message|>{}",            # ... opening the output
     (None, "<|start|>assistant to=functions.get_time<|channel|>commentary<|message|>{}")),
    (ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>Let me look.<|end|>" + WEATHER_CALL,
     (THOUGHT, "Let me look." + WEATHER_BLOCK)),                                   # a preamble is content
    ("<|channel|>analysis to=functions.get_time<|message|>{}",                    # a call on the analysis channel
     (None, "<|start|>assistant to=functions.get_time<|channel|>analysis<|message|>{}")),
    ("<|channel|>final<|message|>Hi<|return|>", (None, "Hi")),
    ("plain text, no header", (None, "plain text, no header")),                  # read as it is written
    ("<|channel|>analysis<|message|>Still thinking", ("Still thinking", "")),     # cut off by max_tokens
    (ANALYSIS + "<|start|>assistant<|channel|>fin", (THOUGHT, "")),              # ... in a header: no message yet
    ("<|channel|>analysis<|end|>Hi", (None, "Hi")),                               # a header an end interrupts: dropped
    ("<|channel|>analysis<|message|><|end|><|start|>assistant<|channel|>final<|message|>4", ("", "4")),
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b", ("ab", "")),
    ("", (None, "")),
    ('<|channel|>commentary to=functions.get_weather<|message|>{"city":"Oslo"}<|start|>assistant<|channel|>final'
     "<|message|>Done", (None, WEATHER_BLOCK + "<|call|>Done")),         # a call closed by the next header
    ("and so on.<|end|><|start|>assistant<|channel|>final<|message|>More.<|return|>",
     (None, "and so on.More.")),                       # no header (continue_final_message): a body to its end
    ("to=be or not", (None, "to=be or not")),          # a recipient only where a marker follows
])
def test_an_output_splits_into_its_analysis_and_the_rest(text, expected):
    assert HARMONY.split(text) == expected


TEXTS = [ANALYSIS + FINAL, ANALYSIS + WEATHER_CALL, " to=functions.get_time<|channel|>commentary json<|message|>{}",
         "plain", "to", "tomato", "to=be", "<|channel|>analysis<|message|><|end|>x", "<|channel|>final<|message|>a<|e",
         "<|", '<|channel|>commentary to=functions.f<|message|>{}<|start|>assistant<|channel|>final<|message|>Done']
PARTS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>", "assistant",
         "analysis", "final", "commentary", " to=functions.get_time", " to=functions.f", "to=", "{}", "a", " ", "<|", "|>"]


def random_outputs(n: int, seed: int = 0) -> list[str]:
    """n texts of up to 7 parts drawn from the markers, headers' words and a little text (seeded)."""
    import random
    draw = random.Random(seed)
    return ["".join(draw.choice(PARTS) for _ in range(draw.randint(1, 7))) for _ in range(n)]


HEADERS = ["<|channel|>analysis", "<|channel|>final", "<|channel|>commentary", " to=functions.get_time<|channel|>"
           "commentary json", "<|channel|>commentary to=functions.get_weather <|constrain|>json",
           "<|channel|>analysis to=functions.get_time"]
BODIES = ["", "Hmm, ok.", "{}", '{"city": "Oslo"}', "to=do", "a<b"]


def random_conversations(n: int, seed: int = 0) -> list[str]:
    """n outputs of one to three messages (seeded): headers of every kind, short bodies, any end or none, a third
    of them cut off at a random character."""
    import random
    draw, texts = random.Random(seed), []
    for _ in range(n):
        text = "".join(("<|start|>assistant" if i else "") + draw.choice(HEADERS) + "<|message|>" +
                       draw.choice(BODIES) + draw.choice(["<|end|>", "<|call|>", "<|return|>", ""])
                       for i in range(draw.randint(1, 3)))
        texts.append(text[:draw.randint(1, len(text))] if draw.random() < 1 / 3 else text)
    return texts


def assembled_split(pieces: list[str]) -> tuple[str | None, str]:
    stream = HARMONY.stream()
    sent = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    said = [reasoning for reasoning, _ in sent if reasoning is not None]
    return "".join(said) if said else None, "".join(content for _, content in sent)


@pytest.mark.parametrize("text", TEXTS)
def test_every_split_of_a_stream_sends_the_whole_outputs_reasoning_and_content(text):
    """Cut into two or three pieces at every place: what a client assembles is the whole output's split (nothing of
    a marker or an unfinished header leaks into the reasoning or the content)."""
    expected = HARMONY.split(text)
    for cut in range(len(text) + 1):
        for pieces in ([text[:cut], text[cut:]], [text[:cut // 2], text[cut // 2:cut], text[cut:]]):
            assert assembled_split(pieces) == expected


def test_random_outputs_stream_what_they_split_into_whole_at_every_split():
    """400 seeded random texts of markers, header words and text, and 200 of whole messages: every two- and
    three-piece split of each, and the text fed a character at a time (the path that appends to an open body
    without parsing)."""
    for text in random_outputs(400) + random_conversations(200):
        expected = HARMONY.split(text)
        assert assembled_split(list(text)) == expected, text
        for cut in range(len(text) + 1):
            for pieces in ([text[:cut], text[cut:]], [text[:cut // 2], text[cut // 2:cut], text[cut:]]):
                assert assembled_split(pieces) == expected, (text, pieces)


@pytest.mark.parametrize("text, expected", [
    (WEATHER_BLOCK, ("", [("get_weather", '{"city": "Oslo"}')])),                  # the arguments as json.dumps writes
    ("Let me look." + WEATHER_BLOCK + "<|call|>" + WEATHER_BLOCK.replace("Oslo", "Rome"),
     ("Let me look.", [("get_weather", '{"city": "Oslo"}'), ("get_weather", '{"city": "Rome"}')])),
    (WEATHER_BLOCK[:-3], ("", [("get_weather", '{"city":"Osl')])),                 # cut short: as written
    ("It is sunny.", None), ("", None),
])
def test_the_openai_parser_reads_the_calls_to_functions(text, expected):
    assert openai_calls(text) == expected


def test_a_call_block_is_the_message_written_back_its_end_written_once_closed():
    assert call_block(messages(WEATHER_CALL)[0], WEATHER_CALL, closed=False) == WEATHER_BLOCK
    assert call_block(messages(WEATHER_CALL)[0], WEATHER_CALL, closed=True) == WEATHER_BLOCK + "<|call|>"


def test_an_auto_answer_of_calls_only_has_null_content_and_finishes_with_tool_calls():
    whole, finish = message(plan("auto", "openai"), HARMONY.split(ANALYSIS + WEATHER_CALL)[1], "stop")
    assert (whole["content"], finish) == (None, "tool_calls")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]] == [
        ("get_weather", '{"city": "Oslo"}')]
    for cut in range(len(WEATHER_BLOCK) + 1):
        assert assembled(plan("auto", "openai"), [WEATHER_BLOCK[:cut], WEATHER_BLOCK[cut:]]) == (
            "", [("get_weather", '{"city": "Oslo"}')], "tool_calls")


def chat_kind() -> ChatCompletions:
    kind = ChatCompletions(str, plan("auto", "openai"), reasoning=HARMONY)
    kind.bind([type("State", (), {"top_logprobs": None})()])
    return kind


@pytest.mark.parametrize("text", [ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>Let me look.<|end|>"
                                  + WEATHER_CALL, ANALYSIS + FINAL])
def test_a_chat_answer_carries_the_reasoning_the_content_and_the_calls_whole_and_streamed(text):
    """The message's reasoning (as `reasoning` and `reasoning_content`), the content without a marker, and the calls;
    the stream's deltas, at every split, put together to the same."""
    whole = chat_kind().choice(0, text, None, "stop")["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in whole.get("tool_calls", [])]
    assert whole["reasoning"] == whole["reasoning_content"] == THOUGHT
    assert (whole["content"], calls) == (("Let me look.", [("get_weather", '{"city": "Oslo"}')]) if "to=" in text
                                         else ("It is sunny.", []))
    for cut in range(len(text) + 1):
        kind = chat_kind()
        deltas = [kind.chunk_choice(0, piece, None, finish)["delta"]
                  for piece, finish in ((text[:cut], None), (text[cut:], "stop"))]
        assert "".join(d.get("reasoning", "") for d in deltas) == THOUGHT
        assert "".join(d.get("content") or "" for d in deltas) == whole["content"]
        assert [(c["function"]["name"], c["function"]["arguments"]) for d in deltas
                for c in d.get("tool_calls", [])] == calls


def chat_parts(text: str, pieces: list[str] | None) -> tuple:
    """(reasoning, content, calls) of a chat answer read whole (pieces None) or streamed in `pieces`; content
    that is only whitespace as "" (null whole, sent as it comes streamed)."""
    kind = chat_kind()
    if pieces is None:
        message = kind.choice(0, text, None, "stop")["message"]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
        return message.get("reasoning"), (message["content"] or "").strip() and message["content"], calls
    deltas = [kind.chunk_choice(0, piece, None, "stop" if last else None)["delta"]
              for last, piece in zip([False] * (len(pieces) - 1) + [True], pieces)]
    said = [d["reasoning"] for d in deltas if "reasoning" in d]
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [(c["function"]["name"], c["function"]["arguments"]) for d in deltas for c in d.get("tool_calls", [])]
    return "".join(said) if said else None, content.strip() and content, calls


@pytest.mark.parametrize("text", random_conversations(150, seed=1) + [
    "<|channel|>commentary<|message|>to=do: check<|end|><|start|>assistant to=functions.get_time<|channel|>"
    "commentary json<|message|>{}<|call|>"])           # a preamble that begins like a recipient
def test_a_chat_answer_streamed_at_every_split_is_the_answer_read_whole(text):
    expected = chat_parts(text, None)
    for cut in range(len(text) + 1):
        assert chat_parts(text, [text[:cut], text[cut:]]) == expected, cut


PIECES = ["<|channel|>", "analysis", "<|message|>", "Hmm", " ok", "<|end|>", "<|start|>", "assistant", "<|channel|>",
          "final", "<|message|>", "Four", "."]


@pytest.mark.parametrize("pieces, thought, leading", [
    (PIECES, 2, 11),                # the markers and the final header are not reasoning, but not the answer either
    (PIECES[:5], 2, 5),             # cut off while reasoning: all of it leads
    (["<|channel|>", "final", "<|message|>", "Four"], 0, 0), (["Four"], 0, 0), ([], 0, 0)])
def test_the_reasoning_tokens_are_the_analysis_bodies_and_the_answer_begins_at_the_final_text(pieces, thought,
                                                                                              leading):
    assert (HARMONY.reasoning_tokens(pieces), HARMONY.leading_thought(pieces)) == (thought, leading)


def test_a_harmony_request_keeps_special_tokens_and_its_structure_is_the_final_messages_body():
    from protos.specpool.v1 import generation_pb2
    assert for_request("openai_gptoss", "<|start|>assistant") is HARMONY
    plain, structured = generation_pb2.GenerateRequest(), generation_pb2.GenerateRequest(
        structured_output=generation_pb2.StructuredOutput(json_object=True))
    for generate in (plain, structured):
        HARMONY.prepare(generate)
        assert generate.keep_special_tokens
    assert not plain.HasField("structured_output") and structured.structured_output.harmony_final


def test_an_assistant_messages_reasoning_reaches_the_template_as_thinking():
    """gpt-oss's template reads an earlier answer's reasoning as `thinking`."""
    from openai_api.chat import ChatTemplate
    from openai_api.protocol import ChatRequest
    template = ChatTemplate("{% for m in messages %}[{{ m.role }}|{{ m.thinking }}]{% endfor %}")
    body = ChatRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "why"}]})
    assert template.render(body.messages) == "[user|][assistant|why]"


@pytest.fixture(scope="module")
def served(start_service):
    from tests.test_openai_http import served_over_http
    return served_over_http(start_service, http={"reasoning_parser": "openai_gptoss", "tool_call_parser": "openai"})


def test_a_served_harmony_chat_keeps_special_tokens_and_answers_plain_text_as_content(served):
    """The demo target writes no harmony markers: its greedy text is the content, whole and streamed, with no
    reasoning; EOS forced by logit_bias and gone past with ignore_eos stays in the text (a harmony request keeps
    special tokens, which its markers are), where it is left out by default."""
    from tests.test_openai_http import CHAT, demo_target, greedy_alone
    model, tokenizer = demo_target()
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    expected = tokenizer.decode(greedy_alone((model, tokenizer), prompt, 10), skip_special_tokens=False)
    answer = served.client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=10, temperature=0)
    assert answer.choices[0].message.content == expected and "reasoning" not in answer.choices[0].message.model_extra
    streamed = served.client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=10,
                                                     temperature=0, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices) == expected
    body = {"model": served.model, "messages": CHAT, "max_tokens": 2, "temperature": 0, "ignore_eos": True,
            "logit_bias": {str(tokenizer.eos_token_id): 100}}
    kept = httpx.post(served.base_url + "/chat/completions", json=body).json()
    assert kept["choices"][0]["message"]["content"] == tokenizer.eos_token * 2
    body.pop("messages")
    completion = httpx.post(served.base_url + "/completions", json={**body, "prompt": "def"}).json()
    assert completion["choices"][0]["text"] == ""



def test_a_served_harmony_structure_on_a_model_without_harmony_tokens_is_a_400_saying_so(served):
    """The openai_gptoss parser puts a structure in the final message (StructuredOutput.harmony_final), which takes
    harmony's markers as tokens of their own: the demo target has none, so response_format is refused naming it."""
    from tests.test_openai_http import CHAT
    body = {"model": served.model, "messages": CHAT, "max_tokens": 8, "response_format": {"type": "json_object"}}
    answer = httpx.post(served.base_url + "/chat/completions", json=body)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "response_format" and "harmony" in error["message"], error

# A harmony chat template in the shape of gpt-oss's own (written for this test): the date from strftime_now, an
# earlier answer's calls as messages to functions.NAME after their analysis, which is the message's content or its
# `thinking` (both refused, as gpt-oss's refuses them), a tool's answer from the function
HARMONY_TEMPLATE = """<|start|>system<|message|>Current date: {{ strftime_now("%Y-%m-%d") }}<|end|>
{%- for m in messages %}
{%- if m.role == "assistant" and "tool_calls" in m %}
{%- if m.content and m.thinking %}{{ raise_exception("a call's analysis is its content or its thinking") }}
{%- elif m.content or m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.content or m.thinking }}\
<|end|>
{%- endif %}
{%- for call in m.tool_calls %}<|start|>assistant to=functions.{{ call.function.name }}<|channel|>commentary json\
<|message|>{{ call.function.arguments | tojson }}<|call|>{% endfor %}
{%- elif m.role == "assistant" %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>
{%- elif m.role == "tool" %}<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>\
{{ m.content | tojson }}<|end|>
{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""


@pytest.mark.parametrize("preamble", ["", "Let me look."])
def test_an_answers_calls_and_reasoning_sent_back_render_as_its_analysis_and_calls(preamble):
    """The tool-call round trip: an answer read from harmony (reasoning, calls; content null, or a preamble), sent
    back as the SDK sends it with the tool's result, renders its analysis (the reasoning; where a preamble was the
    content, the template takes that instead, since gpt-oss's takes one or the other) and its call as messages
    again, with the date strftime_now gives."""
    from datetime import datetime
    from openai_api.chat import ChatTemplate
    from openai_api.protocol import ChatRequest
    said = f"<|start|>assistant<|channel|>commentary<|message|>{preamble}<|end|>" if preamble else ""
    answer = chat_kind().choice(0, ANALYSIS + said + WEATHER_CALL, None, "stop")["message"]
    assert answer["content"] == (preamble or None)
    body = ChatRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "Weather in Oslo?"}, answer,
        {"role": "tool", "tool_call_id": answer["tool_calls"][0]["id"], "content": "sunny"}]})
    prompt = ChatTemplate(HARMONY_TEMPLATE, now=lambda: datetime(2026, 11, 27)).render(body.messages)
    analysis = f"<|start|>assistant<|channel|>analysis<|message|>{preamble or THOUGHT}<|end|>"
    assert prompt == ("<|start|>system<|message|>Current date: 2026-11-27<|end|>"
                      "<|start|>user<|message|>Weather in Oslo?<|end|>" + analysis +
                      '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
                      '{"city": "Oslo"}<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary'
                      '<|message|>"sunny"<|end|><|start|>assistant')


def test_a_responses_requests_reasoning_effort_is_chats():
    from openai_api.responses_api import ResponsesRequest, chat_request, input_items
    body = ResponsesRequest.model_validate({"model": "m", "input": "x", "reasoning": {"effort": "low"}})
    assert chat_request(body, input_items(body)).reasoning_effort == "low"
    plain = ResponsesRequest.model_validate({"model": "m", "input": "x", "reasoning": {}})
    assert chat_request(plain, input_items(plain)).reasoning_effort is None
