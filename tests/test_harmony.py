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
])
def test_an_output_splits_into_its_analysis_and_the_rest(text, expected):
    assert HARMONY.split(text) == expected


TEXTS = [ANALYSIS + FINAL, ANALYSIS + WEATHER_CALL, " to=functions.get_time<|channel|>commentary json<|message|>{}",
         "plain", "to", "tomato", "<|channel|>analysis<|message|><|end|>x", "<|channel|>final<|message|>a<|e", "<|"]


@pytest.mark.parametrize("text", TEXTS)
def test_every_split_of_a_stream_sends_the_whole_outputs_reasoning_and_content(text):
    """Cut into two or three pieces at every place: what a client assembles is the whole output's split (nothing of
    a marker or an unfinished header leaks into the reasoning or the content)."""
    expected = HARMONY.split(text)
    for cut in range(len(text) + 1):
        for pieces in ([text[:cut], text[cut:]], [text[:cut // 2], text[cut // 2:cut], text[cut:]]):
            stream = HARMONY.stream()
            sent = [stream.feed(piece) for piece in pieces] + [stream.finish()]
            said = [reasoning for reasoning, _ in sent if reasoning is not None]
            assert ("".join(said) if said else None, "".join(content for _, content in sent)) == expected


@pytest.mark.parametrize("text, expected", [
    (WEATHER_BLOCK, ("", [("get_weather", '{"city": "Oslo"}')])),                  # the arguments as json.dumps writes
    ("Let me look." + WEATHER_BLOCK + "<|call|>" + WEATHER_BLOCK.replace("Oslo", "Rome"),
     ("Let me look.", [("get_weather", '{"city": "Oslo"}'), ("get_weather", '{"city": "Rome"}')])),
    (WEATHER_BLOCK[:-3], ("", [("get_weather", '{"city":"Osl')])),                 # cut short: as written
    ("It is sunny.", None), ("", None),
])
def test_the_openai_parser_reads_the_calls_to_functions(text, expected):
    assert openai_calls(text) == expected


def test_a_call_block_is_the_message_written_back():
    assert call_block(messages(WEATHER_CALL)[0], WEATHER_CALL) == WEATHER_BLOCK


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


PIECES = ["<|channel|>", "analysis", "<|message|>", "Hmm", " ok", "<|end|>", "<|start|>", "assistant", "<|channel|>",
          "final", "<|message|>", "Four", "."]


@pytest.mark.parametrize("pieces, thought, leading", [
    (PIECES, 2, 11),                # the markers and the final header are not reasoning, but not the answer either
    (PIECES[:5], 2, 5),             # cut off while reasoning: all of it leads
    (["<|channel|>", "final", "<|message|>", "Four"], 0, 0), (["Four"], 0, 0), ([], 0, 0)])
def test_the_reasoning_tokens_are_the_analysis_bodies_and_the_answer_begins_at_the_final_text(pieces, thought,
                                                                                              leading):
    assert (HARMONY.reasoning_tokens(pieces), HARMONY.leading_thought(pieces)) == (thought, leading)


def test_only_an_unconstrained_request_is_read_as_harmony():
    assert for_request("openai_gptoss", "<|start|>assistant", False) is HARMONY and HARMONY.keeps_markers
    assert for_request("openai_gptoss", "<|start|>assistant", True) is None
    assert not for_request("qwen3", "", False).keeps_markers


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


# A harmony chat template in the shape of gpt-oss's own (written for this test): the date from strftime_now, an
# earlier answer's reasoning read as `thinking`, its calls as messages to functions.NAME, a tool's answer from it
HARMONY_TEMPLATE = """<|start|>system<|message|>Current date: {{ strftime_now("%Y-%m-%d") }}<|end|>
{%- for m in messages %}
{%- if m.role == "assistant" and "tool_calls" in m %}
{%- if "thinking" in m and not m.content %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>
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


def test_an_answers_calls_and_reasoning_sent_back_render_as_the_model_wrote_them():
    """The tool-call round trip: an answer read from harmony (reasoning, calls, null content), sent back as the SDK
    sends it with the tool's result, renders as the model's own messages again, with the date strftime_now gives."""
    from datetime import datetime
    from openai_api.chat import ChatTemplate
    from openai_api.protocol import ChatRequest
    answer = chat_kind().choice(0, ANALYSIS + WEATHER_CALL, None, "stop")["message"]
    body = ChatRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "Weather in Oslo?"}, answer,
        {"role": "tool", "tool_call_id": answer["tool_calls"][0]["id"], "content": "sunny"}]})
    prompt = ChatTemplate(HARMONY_TEMPLATE, now=lambda: datetime(2026, 11, 27)).render(body.messages)
    assert prompt == ("<|start|>system<|message|>Current date: 2026-11-27<|end|>"
                      "<|start|>user<|message|>Weather in Oslo?<|end|>" + ANALYSIS.replace("<|channel|>",
                      "<|start|>assistant<|channel|>") + '<|start|>assistant to=functions.get_weather<|channel|>'
                      'commentary json<|message|>{"city": "Oslo"}<|call|><|start|>functions.get_weather to=assistant'
                      '<|channel|>commentary<|message|>"sunny"<|end|><|start|>assistant')


def test_a_responses_requests_reasoning_effort_is_chats():
    from openai_api.responses_api import ResponsesRequest, chat_request, input_items
    body = ResponsesRequest.model_validate({"model": "m", "input": "x", "reasoning": {"effort": "low"}})
    assert chat_request(body, input_items(body)).reasoning_effort == "low"
    plain = ResponsesRequest.model_validate({"model": "m", "input": "x", "reasoning": {}})
    assert chat_request(plain, input_items(plain)).reasoning_effort is None
