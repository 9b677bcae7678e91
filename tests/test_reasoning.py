"""Reasoning parsers (openai_api/reasoning.py, http.reasoning_parser): a thinking model's output split into its
reasoning and its content (the <think> format), opened by the prompt or by the output's own <think>, the same whole
and at every split of a stream, the content's tool calls read after the split, under structured output the structure
after the reasoning; reasoning sent back on an assistant message reaches the chat template; and through a served demo pair whose
template opens the thinking, chat and Responses answers carry the reasoning."""
import json

import pytest

from openai_api.choices import ChatCompletions
from openai_api.reasoning import HARMONY, ReasoningParser, for_request
from tests.test_harmony import ANALYSIS, FINAL, WEATHER_CALL
from tests.test_tool_calls import HERMES_OUTPUT, plan

THOUGHT = "<think>\nThe user wants a point.\n</think>\n\n"
# the output begins as reasoning (the prompt ended with <think>), or only after an opening <think> of its own
PARSERS = {"opened": ReasoningParser(opens_reasoning=True), "unopened": ReasoningParser(opens_reasoning=False),
           "harmony": HARMONY, "gemma4": for_request("gemma4", "<|turn>model\n"),
           "seed_oss": for_request("seed_oss", "<seed:bos>assistant\n")}


@pytest.mark.parametrize("parser, text, expected", [
    ("opened", "It is 4.</think>\n\nFour.", ("It is 4.", "\n\nFour.")),     # <think> opened by the template
    ("opened", " <think>It is 4.</think>Four.", ("It is 4.", "Four.")),        # ... and written by the model too
    ("opened", "Still thinking", ("Still thinking", "")),                      # cut before </think>
    ("opened", "a</think>b</think>c", ("a", "b</think>c")),                   # the first </think> ends it
    ("unopened", THOUGHT + "Four.", ("\nThe user wants a point.\n", "\n\nFour.")),
    ("unopened", "Four.", (None, "Four.")),                                    # thinking off: all content
    ("unopened", "Four. <think>x</think>", (None, "Four. <think>x</think>")),  # <think> must open the output
    ("unopened", "<think>cut", ("cut", "")),
    ("unopened", "", (None, "")), ("opened", "", ("", "")),
    ("gemma4", "<|channel>thought\nIt is 4.<channel|>Four.", ("It is 4.", "Four.")),    # Gemma 4's channel, its
    ("gemma4", "<|channel>It is 4.<channel|>Four.", ("It is 4.", "Four.")),             # label left out
    ("gemma4", "<|channel>thought\nStill", ("Still", "")), ("gemma4", "<|channel>thou", ("thou", "")),
    ("gemma4", "Four. <|channel>x<channel|>", (None, "Four. <|channel>x<channel|>")),
    ("gemma4", THOUGHT + "Four.", (None, THOUGHT + "Four.")),                  # <think> is not its marker
    ("seed_oss", "<seed:think>It is 4.</seed:think>Four.", ("It is 4.", "Four.")),      # Seed-OSS's markers
    ("seed_oss", THOUGHT + "Four.", (None, THOUGHT + "Four.")),
])
def test_a_whole_output_splits_at_its_first_think_end(parser, text, expected):
    assert PARSERS[parser].split(text) == expected


@pytest.mark.parametrize("name, prompt, opens", [
    ("deepseek_r1", "<|Assistant|><think>\n", True),           # R1, Qwen3-Thinking: the template opens it
    ("qwen3", "<|im_start|>assistant\n", False),                # Qwen3 thinking on: the model writes <think>
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", False),      # enable_thinking false
    ("deepseek_r1", "<|Assistant|></think>", False),            # DeepSeek V3.1's non-thinking mode
    ("gemma4", "<|turn>model\n", False),                        # Gemma 4: the model opens its channel
    ("", "<think>", None)])                                    # no parser
def test_the_prompt_says_whether_the_output_opens_as_reasoning(name, prompt, opens):
    parser = for_request(name, prompt)
    assert (parser.opens_reasoning if parser else None) == opens


TEXTS = ["It is 4.</think>\n\nFour.", "  <think>a</think>b", "plain", "<thi", " <think", "a</thin", "<think></think>",
         "x</think>y</think>z", "", "<think>", "</think>x", "<|channel>thought\nIt is 4.<channel|>Four.",
         "<|channel>thought", "<|channel>though", "<|channel>thoughts\n<channel|>", "<|chan", "<|channel><channel|>x",
         "<seed:think>a</seed:think>b", "<seed:th"]


@pytest.mark.parametrize("parser", sorted(PARSERS))
@pytest.mark.parametrize("text", TEXTS)
def test_every_split_of_a_stream_sends_the_whole_outputs_reasoning_and_content(parser, text):
    """Cut into two or three pieces at every place: the reasoning and content a client assembles from the pieces
    are the whole output's (nothing of a `<think>` or `</think>` leaks either way)."""
    reasoning, content = PARSERS[parser].split(text)
    for cut in range(len(text) + 1):
        for pieces in ([text[:cut], text[cut:]], [text[:cut // 2], text[cut // 2:cut], text[cut:]]):
            stream, sent = PARSERS[parser].stream(), []
            sent += [stream.feed(piece) for piece in pieces]
            sent.append(stream.finish())
            said = [r for r, _ in sent if r is not None]       # none sent: no reasoning field at all
            assert ("".join(said) if said else None, "".join(c for _, c in sent)) == (reasoning, content)


def chat_kind(parser: str, tools: str | None = None) -> ChatCompletions:
    kind = ChatCompletions(str, plan("auto", tools) if tools else None, reasoning=PARSERS[parser])
    kind.bind([type("State", (), {"top_logprobs": None})()])
    return kind


@pytest.mark.parametrize("tools", [None, "hermes"])
def test_a_chat_answer_carries_the_reasoning_and_reads_calls_in_the_content_only(tools):
    """The message's `reasoning` and `reasoning_content`, and the content after `</think>`, out of which the tool
    parser reads the calls; the stream's deltas, at every split, put together to the same."""
    text = THOUGHT + (HERMES_OUTPUT if tools else "Four.")
    message = chat_kind("unopened", tools).choice(0, text, None, "stop")["message"]
    assert message["reasoning"] == message["reasoning_content"] == "\nThe user wants a point.\n"
    if tools:
        assert message["content"].strip() == "Let me look." and len(message["tool_calls"]) == 2
    else:
        assert message["content"] == "\n\nFour."
    for cut in range(0, len(text) + 1, 3):
        kind = chat_kind("unopened", tools)
        deltas = [kind.chunk_choice(0, piece, None, finish)["delta"]
                  for piece, finish in ((text[:cut], None), (text[cut:], "stop"))]
        assert "".join(d.get("reasoning", "") for d in deltas) == message["reasoning"]
        assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
        assert "".join(d.get("content") or "" for d in deltas) == (message["content"] or "")
        calls = [call["function"] for d in deltas for call in d.get("tool_calls", [])]
        assert [c["name"] for c in calls if "name" in c] == [c["function"]["name"]
                                                             for c in message.get("tool_calls", [])]


@pytest.mark.parametrize("choice", ["named", "required"])
def test_a_constrained_call_after_the_reasoning_is_read_from_the_content(choice):
    """Named and "required" calls constrain the output after the reasoning (the structure follows </think>): the
    message has the reasoning and the calls, whole and at every split of a stream."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    call = '{"city": "Oslo"}' if choice == "named" else '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    text = THOUGHT.rstrip() + call

    def kind():
        made = ChatCompletions(str, plan(named if choice == "named" else choice), reasoning=PARSERS["unopened"])
        made.bind([type("State", (), {"top_logprobs": None})()])
        return made
    message = kind().choice(0, text, None, "stop")["message"]
    assert (message["reasoning"], message["content"]) == ("\nThe user wants a point.\n", None)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("get_weather", '{"city": "Oslo"}')]
    for cut in range(len(text) + 1):
        made = kind()
        deltas = [made.chunk_choice(0, piece, None, finish)["delta"]
                  for piece, finish in ((text[:cut], None), (text[cut:], "stop"))]
        assert "".join(d.get("reasoning", "") for d in deltas) == message["reasoning"]
        assert not "".join(d.get("content") or "" for d in deltas)
        assert "".join(c["function"]["arguments"] for d in deltas for c in d.get("tool_calls", [])) == \
            message["tool_calls"][0]["function"]["arguments"]


def test_an_answer_that_does_not_reason_has_no_reasoning_and_one_all_reasoning_no_content():
    assert "reasoning" not in chat_kind("unopened").choice(0, "Four.", None, "stop")["message"]
    message = chat_kind("opened").choice(0, "Still thinking", None, "length")["message"]
    assert (message["reasoning"], message["content"]) == ("Still thinking", None)
    deltas = [chat_kind("unopened").chunk_choice(0, "<think></think>Four.", None, "stop")["delta"]]
    assert deltas[0]["reasoning"] == "" and deltas[0]["content"] == "Four."     # an empty reasoning is sent too


def test_reasoning_sent_back_on_an_assistant_message_reaches_the_chat_template():
    """Interleaved thinking (a tool call's reasoning sent back): `reasoning_content` (DeepSeek's name, which wins)
    or `reasoning` (vLLM's) reach the template as both; a user message's is not passed on."""
    from openai_api.chat import ChatTemplate
    from openai_api.protocol import ChatRequest
    template = ChatTemplate("{% for m in messages %}[{{ m.role }}|{{ m.reasoning_content }}|{{ m.reasoning }}]"
                            "{% endfor %}", "</s>")
    body = ChatRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "q", "reasoning": "no"},
        {"role": "assistant", "content": "a", "reasoning": "r1"},
        {"role": "assistant", "content": "b", "reasoning": "old", "reasoning_content": "r2"},
        {"role": "assistant", "content": None, "reasoning": "only"}]})      # an answer that only reasoned
    assert template.render(body.messages) == "[user||][assistant|r1|r1][assistant|r2|r2][assistant|only|only]"


@pytest.mark.parametrize("opens, start", [(True, ""), (False, "<think>")])
def test_a_structure_asked_for_follows_the_reasoning(opens, start):
    """Under structured output the grammar lets the reasoning run free to </think> (opened by <think> and optional
    where the prompt did not open it), as vLLM applies structured output after the reasoning; free text is left
    as it is."""
    from protos.specpool.v1 import generation_pb2
    generate = generation_pb2.GenerateRequest(structured_output=generation_pb2.StructuredOutput(json_object=True))
    ReasoningParser(opens_reasoning=opens).prepare(generate)
    assert (generate.structured_output.reasoning_end, generate.structured_output.reasoning_start) == ("</think>", start)
    free = generation_pb2.GenerateRequest()
    ReasoningParser(opens_reasoning=opens).prepare(free)
    assert not free.HasField("structured_output") and not free.keep_special_tokens
    gemma = generation_pb2.GenerateRequest(structured_output=generation_pb2.StructuredOutput(json_object=True))
    for_request("gemma4", "<|turn>model\n").prepare(gemma)          # Gemma 4's markers: special tokens, kept
    assert (gemma.structured_output.reasoning_end, gemma.structured_output.reasoning_start,
            gemma.keep_special_tokens) == ("<channel|>", "<|channel>", True)


def test_the_config_names_the_reasoning_parsers():
    from openai_api.reasoning import NAMES
    from settings.schema import REASONING_PARSERS, ConfigError, config_from_dict
    assert NAMES == REASONING_PARSERS
    with pytest.raises(ConfigError, match=r"^http\.reasoning_parser: one of deepseek_r1, qwen3, gemma4, seed_oss, openai_gptoss or "
                                          r"\"\" "
                                          r"\(got 'x'\)$"):
        config_from_dict({"http": {"reasoning_parser": "x"}})


@pytest.mark.parametrize("parser, pieces, thought", [
    ("unopened", ["<think>", "\nA", " b", "</think>", "Four", "."], 2),      # the markers are not counted
    ("unopened", ["<th", "ink>A", " b</th", "ink>", "Four"], 2),             # tokens sharing text with them count
    ("opened", ["A", " b", "</think>", "\n\nFour"], 2),
    ("opened", ["A", " b", " c"], 3),                                       # cut before </think>: all of it
    ("opened", ["</think>", "Four"], 0), ("unopened", ["Four", "."], 0), ("unopened", [], 0),
    ("unopened", ["<think>", "", "A", "</think>"], 2),                       # a token with no text inside counts
])
def test_the_reasoning_tokens_are_the_output_tokens_with_text_in_the_reasoning(parser, pieces, thought):
    assert PARSERS[parser].reasoning_tokens(pieces) == thought


def test_usage_counts_each_choices_reasoning_tokens():
    """chat's completion_tokens_details.reasoning_tokens, summed over the choices; none without a parser."""
    import types
    words = ["<think>", "x", "y", "</think>", "Four"]
    states = [types.SimpleNamespace(prompt_len=1, tokens=[9, *output], generated=len(output), prediction=(),
                                    stats=types.SimpleNamespace(cached_prompt_tokens=0))
              for output in ([0, 1, 2, 3, 4], [0, 1, 3, 4], [4])]
    kind = ChatCompletions(words.__getitem__, reasoning=PARSERS["unopened"])
    assert kind.usage(states, 3)["completion_tokens_details"] == {"reasoning_tokens": 3}
    assert kind.usage(states, 3)["completion_tokens"] == 10
    assert "completion_tokens_details" not in ChatCompletions(words.__getitem__).usage(states)


# A chat template that opens the thinking in the generation prompt, as DeepSeek-R1's does
THINKING_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}")


@pytest.fixture(scope="module")
def served(start_service, tmp_path_factory):
    from tests.test_openai_http import served_over_http
    template = tmp_path_factory.mktemp("thinking") / "template.jinja"
    template.write_text(THINKING_TEMPLATE)
    return served_over_http(start_service, http={"reasoning_parser": "deepseek_r1", "chat_template": str(template)})


def test_a_served_chat_answers_the_reasoning_whole_and_streamed(served):
    """The template opens <think> and the demo target writes no </think>, so all of its output is reasoning: the
    target alone's greedy text in `reasoning` and `reasoning_content`, content null; the stream's deltas put
    together to the same; with a JSON object asked for the reasoning runs free before it (the grammar allows every
    token but EOS until `</think>`, and the target alone writes neither in 12 tokens), so it is the same."""
    from tests.test_openai_http import CHAT, demo_target, greedy_alone
    model, tokenizer = demo_target()
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False,
                                           chat_template=THINKING_TEMPLATE)
    answer = served.client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=12, temperature=0)
    message = answer.choices[0].message
    expected = tokenizer.decode(greedy_alone((model, tokenizer), prompt, 12), skip_special_tokens=True)
    assert (message.content, message.model_extra["reasoning"], message.model_extra["reasoning_content"]) == (
        None, expected, expected)
    assert answer.usage.completion_tokens_details.reasoning_tokens == answer.usage.completion_tokens == 12
    streamed = served.client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=12,
                                                     temperature=0, stream=True)
    deltas = [chunk.choices[0].delta for chunk in streamed if chunk.choices]
    assert "".join((d.model_extra or {}).get("reasoning", "") for d in deltas) == expected
    assert not "".join(d.content or "" for d in deltas)
    raw = json.loads(served.client.chat.completions.with_raw_response.create(
        model=served.model, messages=CHAT, max_tokens=4, temperature=0).text)
    assert set(raw["choices"][0]["message"]) >= {"reasoning", "reasoning_content", "content"}
    structured = served.client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=12,
                                                       temperature=0, response_format={"type": "json_object"})
    assert (structured.choices[0].message.content, structured.choices[0].message.model_extra["reasoning"]) == (
        None, expected)


# ---- the Responses API: a reasoning item before the message ----------------------------------------------------

def response_kinds(parser: str, tools: str | None = None, choice=None):
    """A Response read whole and one streamed, of the same (scripted) output (`choice`: a tool_choice of its own,
    with the hermes parser)."""
    import types
    from openai_api.responses_api import ResponseObjects, ResponsesRequest
    from protos.specpool.v1 import generation_pb2
    body = ResponsesRequest.model_validate({"model": "m", "input": "x"})
    state = types.SimpleNamespace(top_logprobs=None, prompt_len=3, generated=4, tokens=[7] * 7, prediction=(),
                                  stats=generation_pb2.GenerationStats())
    tool_plan = plan(choice) if choice else plan("auto", tools) if tools else plan("none")
    kinds = [ResponseObjects(str, tool_plan, body, reasoning=PARSERS[parser]) for _ in range(2)]
    for kind in kinds:
        kind.bind([state])
    return kinds


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("parser, text, choice", [
    ("opened", 'Let me think</think>{"city": "Oslo"}', NAMED), ("opened", "Still thinking", NAMED),
    ("opened", 'Hmm</think>[{"name": "get_time", "parameters": {}}]', "required")])
@pytest.mark.parametrize("finish", [2, 1], ids=["stop", "length"])
def test_a_constrained_call_after_the_reasoning_streams_the_items_read_whole(parser, text, choice, finish):
    """A named or required call after the reasoning (the structure follows </think>): a reasoning item, then the
    call's (none where the output was cut while reasoning), whole and at every split of a stream."""
    from router.stopping import Chunk
    whole_kind, _ = response_kinds(parser, choice=choice)
    whole = whole_kind.whole("r", "m", [whole_kind.choice(0, text, None, {2: "stop", 1: "length"}[finish])])
    kinds = [item["type"] for item in whole["output"]]
    assert kinds == (["reasoning", "function_call"] if "</think>" in text else ["reasoning"])
    for cut in range(len(text) + 1):
        _, stream_kind = response_kinds(parser, choice=choice)
        events = stream_kind.events("r", "m")
        frames = events.start() + events.chunk(0, Chunk([1], text[:cut], [], 0)) + \
            events.chunk(0, Chunk([2], text[cut:], [], finish)) + events.end()
        final = json.loads(frames[-1].split("\ndata: ")[1])["response"]["output"]
        assert [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in final] == \
            [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in whole["output"]]


@pytest.mark.parametrize("parser, text", [
    ("unopened", THOUGHT + "Four."), ("unopened", "Four."), ("opened", "Still thinking"),
    ("opened", "x</think>\n\n"), ("unopened", THOUGHT + HERMES_OUTPUT), ("unopened", "<think></think>Four."),
    ("opened", "Still thinking</think>" + HERMES_OUTPUT), ("harmony", ANALYSIS + FINAL),
    ("harmony", ANALYSIS + WEATHER_CALL), ("harmony", "<|channel|>analysis<|message|>Still thinking"),
    ("harmony", "Four.")])
@pytest.mark.parametrize("finish", [2, 1], ids=["stop", "length"])
def test_a_response_has_a_reasoning_item_before_its_message_whole_and_streamed(parser, text, finish):
    """The reasoning is a `reasoning` item (one reasoning_text part) before the message (none when nothing follows
    the reasoning); the stream's events, at every split, build the same items and validate against the SDK's types."""
    from pydantic import TypeAdapter
    from openai.types.responses import Response, ResponseStreamEvent
    from router.stopping import Chunk
    tools = "hermes" if "<tool_call>" in text else "openai" if "to=functions." in text else None
    adapter = TypeAdapter(ResponseStreamEvent)
    whole_kind, _ = response_kinds(parser, tools)
    whole = whole_kind.whole("r", "m", [whole_kind.choice(0, text, None, {2: "stop", 1: "length"}[finish])])
    Response.model_validate(whole)
    reasoning, _ = PARSERS[parser].split(text)
    assert [item["type"] for item in whole["output"]][:1] == (["reasoning"] if reasoning else ["message"])
    if reasoning:
        assert whole["output"][0]["content"] == [{"type": "reasoning_text", "text": reasoning}]
    for cut in range(0, len(text) + 1, 2):
        _, stream_kind = response_kinds(parser, tools)
        events = stream_kind.events("r", "m")
        frames = events.start() + events.chunk(0, Chunk([1], text[:cut], [], 0)) + \
            events.chunk(0, Chunk([2], text[cut:], [], finish)) + events.end()
        payloads = [json.loads(frame.split("\ndata: ")[1]) for frame in frames]
        for payload in payloads:
            adapter.validate_python(payload, strict=False)
        deltas = "".join(p["delta"] for p in payloads if p["type"] == "response.reasoning_text.delta")
        assert deltas == (reasoning or "")
        final = payloads[-1]["response"]["output"]
        assert [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in final] == \
            [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in whole["output"]]


@pytest.mark.parametrize("parser, pieces, answered", [
    ("unopened", ["<think>", "Hmm", " ok", "</think>", "\n\nFour", "."], 2),   # the markers' logprobs: the reasoning's
    ("unopened", ["<think>", "Hmm", " ok</think>\n\nFo", "ur."], 2),          # a token across the end: the answer's
    ("unopened", ["Four", "."], 2), ("unopened", ["<think>", "Hmm"], 0),
    ("harmony", ["<|channel|>", "analysis", "<|message|>", "Hmm", "<|end|>", "<|start|>", "assistant", "<|channel|>",
                 "final", "<|message|>", "Four", "."], 2)])        # the final message's header: not the answer's
def test_a_responses_message_carries_only_its_own_tokens_logprobs_whole_and_streamed(parser, pieces, answered):
    """The reasoning's tokens (up to its </think>) have no logprobs in the message's output_text, read whole and
    streamed at every split (reasoning_text parts carry none)."""
    import types
    from openai_api.responses_api import ResponseObjects, ResponsesRequest
    from protos.specpool.v1 import generation_pb2
    from router.stopping import Chunk
    entries = [generation_pb2.TokenLogprob(token_id=i, logprob=-0.5 * i) for i in range(len(pieces))]
    state = types.SimpleNamespace(top_logprobs=0, prompt_len=1, generated=len(pieces), logprobs=entries,
                                  tokens=[99, *range(len(pieces))], stats=generation_pb2.GenerationStats(),
                                  prediction=())

    def kind():
        made = ResponseObjects(pieces.__getitem__, plan("none"), ResponsesRequest.model_validate(
            {"model": "m", "input": "x"}), reasoning=PARSERS[parser])
        made.bind([state])
        return made
    whole_kind = kind()
    whole = whole_kind.whole("r", "m", [whole_kind.choice(0, "".join(pieces), entries, "stop")])
    messages = [item for item in whole["output"] if item["type"] == "message"]
    logprobs = messages[0]["content"][0]["logprobs"] if messages else []
    assert [entry["logprob"] for entry in logprobs] == [-0.5 * i for i in range(len(pieces) - answered, len(pieces))]
    for cut in range(len(pieces) + 1):
        events = kind().events("r", "m")
        chunks = [Chunk(list(range(len(pieces)))[at:to], "".join(pieces[at:to]), entries[at:to], finish)
                  for at, to, finish in ((0, cut, 0), (cut, len(pieces), 2))]
        frames = events.start() + [frame for chunk in chunks for frame in events.chunk(0, chunk)] + events.end()
        final = json.loads(frames[-1].split("\ndata: ")[1])["response"]["output"]
        assert [item.get("content") for item in final] == [item.get("content") for item in whole["output"]]


def test_reasoning_items_sent_back_go_with_the_assistant_message_after_them():
    from openai_api.responses_api import ResponsesRequest, input_items, messages
    body = ResponsesRequest.model_validate({"model": "m", "input": [
        {"role": "user", "content": "q"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "why"}]},
        {"type": "function_call", "call_id": "c", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "noon"},
        {"type": "reasoning", "id": "rs_2", "summary": []},
        {"role": "user", "content": "and?"}]})
    turns = messages(None, input_items(body))
    assert [(m.role, m.reasoning_content) for m in turns] == [("user", None), ("assistant", "why"), ("tool", None),
                                                              ("user", None)]


def test_a_served_response_reasons_and_continues_with_its_reasoning(served):
    """The demo target's output is all reasoning here: a reasoning item and no message, whole and streamed; sent
    back (its output as input, and by previous_response_id) the conversation goes on."""
    whole = served.client.responses.create(model=served.model, input="a point", max_output_tokens=8, temperature=0)
    assert [item.type for item in whole.output] == ["reasoning"] and whole.output_text == ""
    assert whole.usage.output_tokens_details.reasoning_tokens == whole.usage.output_tokens == 8
    events = list(served.client.responses.create(model=served.model, input="a point", max_output_tokens=8,
                                                 temperature=0, stream=True))
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == whole.output[0].content[0].text and events[-1].response.output[0].type == "reasoning"
    again = served.client.responses.create(model=served.model, max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": "a point"}, *[item.model_dump(exclude_none=True) for item in whole.output],
        {"role": "user", "content": "more"}])
    continued = served.client.responses.create(model=served.model, previous_response_id=whole.id, input="more",
                                               max_output_tokens=4, temperature=0)
    assert again.output[0].content[0].text == continued.output[0].content[0].text
