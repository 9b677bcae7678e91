"""Tool calling's parts without a service (openai_api/tools.py): the parsers on model output, a stream's deltas
against the whole message at every split of the output, the "required" schema against llguidance, each
tool_choice a request cannot have, and the chat template's prompt against transformers' own rendering with tools.
The whole stack (the demo pair served over HTTP) is in tests/test_openai_http.py."""
import json
from dataclasses import replace

import pytest

from openai_api.chat import ChatTemplate
from openai_api.protocol import ApiError, ChatRequest
from openai_api.tools import PARSERS, ToolPlan, ToolStream, merged, message
from settings.schema import TOOL_CALL_PARSERS

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
HERMES_OUTPUT = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
                 '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
CALLS = [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]


def chat(**body) -> ChatRequest:
    return ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body})


def plan(choice="auto", parser="hermes", **body) -> ToolPlan:
    return chat(tools=[WEATHER, TIME], tool_choice=choice, **body).tool_plan(PARSERS.get(parser))


def test_the_config_names_every_parser_and_refuses_another():
    from settings.schema import ConfigError, config_from_dict
    assert tuple(PARSERS) == TOOL_CALL_PARSERS
    assert config_from_dict({"http": {"tool_call_parser": "hermes"}}).http.tool_call_parser == "hermes"
    with pytest.raises(ConfigError, match=r"^http\.tool_call_parser: one of hermes, llama3_json, mistral, pythonic, "
                                          r"qwen3_coder, seed_oss, deepseek_v31, deepseek_v3, deepseek_v32, deepseek_v4, "
                                          r"gemma4, glm45, "
                                          r"minimax_m2, kimi_k2, "
                                          r"openai or \"\" "
                                          r"\(got 'xml'\)$"):
        config_from_dict({"http": {"tool_call_parser": "xml"}})
    with pytest.raises(ConfigError, match=r"^http\.tool_call_parser: openai reads gpt-oss's harmony messages, which "
                                          r"need http\.reasoning_parser: openai_gptoss as well \(got 'qwen3'\)$"):
        config_from_dict({"http": {"tool_call_parser": "openai", "reasoning_parser": "qwen3"}})
    assert config_from_dict({"http": {"tool_call_parser": "openai", "reasoning_parser": "openai_gptoss"}})


@pytest.mark.parametrize("text, expected", [
    (HERMES_OUTPUT, ("Let me look.\n\n", CALLS)),
    ('<tool_call>{"name": "get_time", "arguments": {}}', ("", [("get_time", "{}")])),       # unclosed at EOS
    ('A<tool_call>{"name": "get_time", "arguments": {}}</tool_call>B<tool_call>{"name": "get_time"}</tool_call>C',
     ("ABC", [("get_time", "{}")] * 2)),                                        # the text around the calls kept
    ("no calls here", None),
    ('<tool_call>{"name": "get_time", "arguments": {</tool_call>', None),                   # not JSON
    ('<tool_call>{"arguments": {}}</tool_call>', None),                                      # no name
    ('<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>', None),                 # arguments not an object
    ('<tool_call>{"name": "get_time", "arguments": {"x": NaN}}</tool_call>', None),          # not JSON's numbers
    ('<tool_call>{"name": "get_time", "arguments": {"x": 1e400}}</tool_call>', None),
    ("<tool_call>" + "[" * 100000, None),                                                     # too deep
])
def test_hermes_parser_finds_the_calls_or_none(text, expected):
    """(The cases below, and JSON that Python reads but JSON has not, or too deep for Python's reader.)"""
    assert PARSERS["hermes"].calls(text) == expected


@pytest.mark.parametrize("text, expected", [
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', ("", CALLS[:1])),
    ('  <|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", '
     '"parameters": {}}', ("  ", CALLS)),
    ('{"name": "sql", "parameters": {"q": "SELECT 1; SELECT 2"}} done', (" done", [
        ("sql", '{"q": "SELECT 1; SELECT 2"}')])),                              # a ; inside a string
    ('The answer is {"name": "x"}', None),
    ('{"name": "get_time", "parameters": {}', None),
])
def test_llama3_json_parser_finds_the_calls_or_none(text, expected):
    assert PARSERS["llama3_json"].calls(text) == expected


@pytest.mark.parametrize("text, expected", [
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}]',
     ("", CALLS)),
    (' [{"name": "get_time", "arguments": {}}]', (" ", [("get_time", "{}")])),        # the special token dropped
    ("[1, 2]", None), ("[]", None), ('Sure: [{"name": "get_time", "arguments": {}}]', None),
])
def test_mistral_parser_finds_the_calls_or_none(text, expected):
    assert PARSERS["mistral"].calls(text) == expected


@pytest.mark.parametrize("text, expected", [
    ('[get_weather(city="Oslo"), get_time()]', ("", CALLS)),
    ('\n<|python_start|>[get_weather(city=\'Oslo\')]<|python_end|>', ("\n", CALLS[:1])),     # Llama 4's markers
    ("[f(n=-2, xs=[1, (2, 3)], opt={'a': None}, on=true, off=false, none=null)]",           # literals as JSON
     ("", [("f", '{"n": -2, "xs": [1, [2, 3]], "opt": {"a": null}, "on": true, "off": false, "none": null}')])),
    ("[f(1)]", None), ("[f(a=x)]", None), ("[f(a=1 + 2)]", None), ("[f(**kw)]", None),        # not literals
    ("[a.b(x=1)]", None), ("[f(a={1: 2})]", None), ("[f(a=1e999)]", None), ("[f(a=b'x')]", None),
    ("[1, 2]", None), ("[]", None), ("[f(a=1)] and more", None), ("Sure: [f(a=1)]", None), ("[f(a=1", None),
    ("[" + "-" * 6000 + "]", None), ("[f(a=" + "-" * 6000 + "1)]", None),     # the parser's stack overflows
    ("[f(a=" + "[" * 400 + "]" * 400 + ")]", None), ("[f(a=" + "9" * 5000 + ")]", None),
])
def test_pythonic_parser_finds_the_calls_or_none(text, expected):
    assert PARSERS["pythonic"].calls(text) == expected


QWEN3_CODER_OUTPUT = ("I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
                      "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>")


@pytest.mark.parametrize("text, expected", [
    (QWEN3_CODER_OUTPUT, ("I'll check.\n\n", CALLS)),
    ("<tool_call>\n<function=edit>\n<parameter=code>\ndef f():\n    return 1\n\n</parameter>\n<parameter=n>\n2",
     ("", [("edit", json.dumps({"code": "def f():\n    return 1\n", "n": "2"}))])),    # unclosed at EOS; lines kept
    ("<tool_call><function=f><parameter=a>x<parameter=b>y</function></tool_call>",          # unclosed parameters
     ("", [("f", '{"a": "x", "b": "y"}')])),
    ("no calls", None), ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', None),      # hermes' JSON
    ("<tool_call><function=f><parameter=n>1</parameter></function><function=g></function></tool_call>",
     ("", [("f", '{"n": "1"}'), ("g", "{}")])),                                    # two functions in one block
    ("<tool_call>text<function=f></function></tool_call>", None),                  # text beside a function
    ("<tool_call><function=f>" + "<parameter=" * 20000, ("", [("f", "{}")])),    # hostile: no quadratic scan
])
def test_qwen3_coder_parser_finds_the_calls_or_none(text, expected):
    assert PARSERS["qwen3_coder"].calls(text) == expected


# DeepSeek's markers, as its tokenizer writes them (fullwidth bars, lower blocks)
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
DEEPSEEK_V31_OUTPUT = (f'Let me look.{CALLS_BEGIN}{CALL}get_weather{SEP}{{"city": "Oslo"}}{CALL_END}'
                       f'{CALL}get_time{SEP}{{}}{CALL_END}{CALLS_END}')
DEEPSEEK_V3_OUTPUT = (f'Let me look.{CALLS_BEGIN}{CALL}function{SEP}get_weather\n```json\n{{"city": "Oslo"}}\n```'
                      f'{CALL_END}\n{CALL}function{SEP}get_time\n```json\n{{}}\n```{CALL_END}{CALLS_END}')


@pytest.mark.parametrize("parser, text, expected", [
    ("deepseek_v31", DEEPSEEK_V31_OUTPUT, ("Let me look.", CALLS)),
    ("deepseek_v3", DEEPSEEK_V3_OUTPUT, ("Let me look.", CALLS)),
    ("deepseek_v31", f'{CALLS_BEGIN}{CALL}get_time{SEP}{{}}', ("", [("get_time", "{}")])),     # unclosed at EOS
    ("deepseek_v31", f'A{CALLS_BEGIN}{CALL}get_time{SEP}{{}}{CALL_END}{CALLS_END}B', ("AB", [("get_time", "{}")])),
    ("deepseek_v31", DEEPSEEK_V3_OUTPUT, None), ("deepseek_v3", DEEPSEEK_V31_OUTPUT, None),    # the other's format
    ("deepseek_v31", "no calls", None), ("deepseek_v31", f"{CALLS_BEGIN}text", None),          # no call block
    ("deepseek_v31", f"{CALLS_BEGIN}{CALL}f{SEP}[1]{CALL_END}", None),                        # arguments not an object
    ("deepseek_v31", f"{CALLS_BEGIN}{CALL}{SEP}{{}}{CALL_END}", None),                        # no name
    ("deepseek_v31", f"{CALLS_BEGIN}x{CALL}f{SEP}{{}}{CALL_END}", None),                      # text beside a call
    ("deepseek_v3", f"{CALLS_BEGIN}{CALL}function{SEP}f\n{{}}{CALL_END}", None),               # no json fence
])
def test_deepseek_parsers_find_the_calls_or_none(parser, text, expected):
    """V3.1's `NAME<｜tool▁sep｜>{...}` blocks and V3 / R1's `function<｜tool▁sep｜>NAME` with the arguments in a
    ```json fence, after `<｜tool▁calls▁begin｜>`, as vLLM's deepseek_v31 and deepseek_v3 parsers read them."""
    assert PARSERS[parser].calls(text) == expected


GLM45_OUTPUT = ("I'll check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n"
                "</tool_call>\n<tool_call>get_time\n</tool_call>")


@pytest.mark.parametrize("text, expected", [
    (GLM45_OUTPUT, ("I'll check.\n\n", CALLS)),
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>",      # GLM-4.7: no
     ("", [("get_weather", '{"city": "Oslo"}')])),                                              # line ends
    ("<tool_call>f\n<arg_key>code</arg_key>\n<arg_value>    return 1\n</arg_value>\n<arg_key>n</arg_key>"
     "<arg_value>2", ("", [("f", json.dumps({"code": "    return 1\n", "n": "2"}))])),    # as written; unclosed
    ("<tool_call>f\n<arg_key>a</arg_key>\\n<arg_value>1</arg_value></tool_call>", ("", [("f", '{"a": "1"}')])),
    ("no calls", None), ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', None),      # hermes' JSON
    ("<tool_call>\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>", None),                # no name
    ("<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value>\nstray</tool_call>",                  # text inside:
     ("", [("f", '{"a": "1"}')])),                                                                # ignored
    ("<tool_call>f<arg_key>a</arg_key>text<arg_value>1</arg_value></tool_call>", ("", [("f", "{}")])),
    ("<tool_call>f" + "<arg_key>" * 20000, ("", [("f", "{}")])),                     # hostile: no quadratic scan
    ("<tool_call>f" + "<arg_key>a</arg_key><arg_value>" * 20000, ("", [("f", json.dumps({"a": "<arg_key>a</arg_key>"
                                                                 "<arg_value>" * 19999}))])),
])
def test_glm45_parser_finds_the_calls_or_none(text, expected):
    """GLM-4.5's `<tool_call>NAME` blocks of `<arg_key>`/`<arg_value>` pairs (GLM-4.7's without line ends too), as
    vLLM's glm45 and glm47 parsers read them: each value its text as written, other text in a block ignored."""
    assert PARSERS["glm45"].calls(text) == expected


# Kimi K2's markers (special tokens in its tokenizer, kept in the text for its parser)
K_SECTION, K_SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
K_CALL, K_ARGS, K_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
KIMI_OUTPUT = (f'Let me look.{K_SECTION}{K_CALL}functions.get_weather:0{K_ARGS}{{"city": "Oslo"}}{K_END}'
               f'{K_CALL}functions.get_time:1{K_ARGS}{{}}{K_END}{K_SECTION_END}')


@pytest.mark.parametrize("text, expected", [
    (KIMI_OUTPUT, ("Let me look.", CALLS)),
    (f"{K_SECTION}\n{K_CALL} functions.get_time:4 {K_ARGS} {{}} {K_END}\n{K_SECTION_END}",     # blank space
     ("", [("get_time", "{}")])),
    (f"{K_SECTION}{K_CALL}functions.get_time:0{K_ARGS}{{}}", ("", [("get_time", "{}")])),         # unclosed at EOS
    (f"A{K_SECTION}{K_CALL}get_time:0{K_ARGS}{{}}{K_END}{K_SECTION_END}B", ("AB", [("get_time", "{}")])),  # no
    (f"<|tool_call_section_begin|>{K_CALL}functions.get_time:0{K_ARGS}{{}}{K_END}<|tool_call_section_end|>",  # prefix;
     ("", [("get_time", "{}")])),                                                                 # the singular
    (f"{K_SECTION}{K_CALL}functions.ns.get_time:0{K_ARGS}{{}}{K_END}", ("", [("ns.get_time", "{}")])),   # dotted
    ("no calls", None), (f"{K_SECTION}text", None),                                                      # no block
    (f"{K_SECTION}{K_CALL}functions.get_time{K_ARGS}{{}}{K_END}", None),                                 # no index
    (f"{K_SECTION}{K_CALL}functions.get_time:0{K_ARGS}[1]{K_END}", None),                   # not an object
    (f"{K_SECTION}{K_CALL}functions.get_time:0{{}}{K_END}", None),                           # no argument marker
    (f"{K_SECTION}x{K_CALL}functions.get_time:0{K_ARGS}{{}}{K_END}", None),                  # text beside a call
    (f"{K_SECTION}{K_CALL}functions.get_time:0{K_ARGS}{{}}{K_END}x", None),
])
def test_kimi_k2_parser_finds_the_calls_or_none(text, expected):
    """Kimi K2's `<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{...}<|tool_call_end|>`
    blocks in its tool-call section, as vLLM's kimi_k2 parser reads them (the section's singular spelling too); the
    text before the section and after its end is the content; a block may be unclosed at EOS."""
    assert PARSERS["kimi_k2"].calls(text) == expected


def test_kimi_k2_calls_keep_the_ids_it_wrote_whole_and_streamed():
    """Its template writes an earlier answer's calls back with their ids (`functions.get_weather:0`, numbered
    across the conversation), so the answer's ids are the ones the model wrote, not new `call_` ones."""
    tool_plan = plan(parser="kimi_k2")
    answer, finish = message(tool_plan, KIMI_OUTPUT, "stop")
    assert [call["id"] for call in answer["tool_calls"]] == ["functions.get_weather:0", "functions.get_time:1"]
    assert answer["content"] == "Let me look." and finish == "tool_calls"
    stream = ToolStream(tool_plan)
    streamed = [stream.feed(KIMI_OUTPUT[:20]), stream.feed(KIMI_OUTPUT[20:]), stream.finish("stop")[0]]
    assert [call["id"] for delta in streamed for call in delta.get("tool_calls", [])] == [
        "functions.get_weather:0", "functions.get_time:1"]
    first, _ = message(plan(parser="kimi_k2", parallel_tool_calls=False), KIMI_OUTPUT, "stop")
    assert [call["id"] for call in first["tool_calls"]] == ["functions.get_weather:0"]
    assert plan(parser="hermes").call_ids(HERMES_OUTPUT, CALLS)[0].startswith("call_")


KIMI_HISTORY = [{"role": "user", "content": "hi"},
                {"role": "assistant", "tool_calls": [
                    {"id": "functions.get_time:0", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
                    {"id": "functions.get_time:1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "functions.get_time:0", "content": "noon"},
                {"role": "tool", "tool_call_id": "functions.get_time:1", "content": "noon"},
                {"role": "user", "content": "and the weather?"}]


@pytest.mark.parametrize("messages, first", [(None, 0), (KIMI_HISTORY, 2)])
def test_kimi_k2_numbers_the_calls_it_was_made_to_write_across_the_conversation(messages, first):
    """A named or "required" call is written as JSON, with no id from the model: under kimi_k2 its id is Kimi's
    `functions.NAME:INDEX`, INDEX counting on from the calls of the conversation's assistant messages, as vLLM
    numbers them (Kimi's template writes ids back as they were); other parsers give new `call_` ones."""
    body = {"messages": messages} if messages else {}
    required = plan("required", "kimi_k2", **body)
    output = json.dumps([{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}])
    answer, _ = message(required, output, "stop")
    expected = [f"functions.get_weather:{first}", f"functions.get_time:{first + 1}"]
    assert [call["id"] for call in answer["tool_calls"]] == expected
    stream = ToolStream(required)
    streamed = [stream.feed(output[:9]), stream.feed(output[9:]), stream.finish("stop")[0]]
    assert [call["id"] for delta in streamed for call in delta.get("tool_calls", [])] == expected
    named = plan({"type": "function", "function": {"name": "get_weather"}}, "kimi_k2", **body)
    answer, _ = message(named, '{"city": "Oslo"}', "stop")
    assert [call["id"] for call in answer["tool_calls"]] == [f"functions.get_weather:{first}"]
    stream = ToolStream(named)
    assert stream.feed('{"city"')["tool_calls"][0]["id"] == f"functions.get_weather:{first}"
    assert message(plan("required", "hermes", **body), output, "stop")[0]["tool_calls"][0]["id"].startswith("call_")


def test_only_a_parser_whose_markers_are_special_tokens_keeps_them_in_the_text():
    """Kimi K2's and Gemma 4's markers are special tokens, which the output text leaves out unless asked: their
    auto calls keep them (vLLM's parsers turn skip_special_tokens off the same way, DeepSeek's DSML ones too); other
    parsers, and these where no free text is read for calls, leave the request as it was."""
    from protos.specpool.v1 import generation_pb2

    def prepared(choice, parser):
        generate = generation_pb2.GenerateRequest()
        plan(choice, parser).prepare(generate)
        return generate
    assert prepared("auto", "kimi_k2").keep_special_tokens
    assert all(prepared("auto", parser).keep_special_tokens for parser in ("deepseek_v32", "deepseek_v4", "gemma4"))
    assert not prepared("auto", "hermes").keep_special_tokens and not prepared("none", "kimi_k2").keep_special_tokens
    required = prepared("required", "kimi_k2")
    assert not required.keep_special_tokens and json.loads(required.structured_output.json_schema)["type"] == "array"


MINIMAX_OUTPUT = ('Let me look.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Oslo'
                  '</parameter>\n</invoke>\n<invoke name="get_time">\n</invoke>\n</minimax:tool_call>')


@pytest.mark.parametrize("text, expected", [
    (MINIMAX_OUTPUT, ("Let me look.\n", CALLS)),
    ('<minimax:tool_call><invoke name=get_weather><parameter name=city>\n  Oslo\n', ("", [CALLS[0]])),  # unquoted,
    ("A<minimax:tool_call><invoke name='get_time'></invoke></minimax:tool_call>B", ("AB", [CALLS[1]])),  # unclosed
    ('<minimax:tool_call><invoke name="f"><parameter name="a">1<parameter name="b">2</invoke>',          # values
     ("", [("f", '{"a": "1", "b": "2"}')])),                                                            # unclosed
    ("no calls", None), ("<minimax:tool_call>text</minimax:tool_call>", None),                          # no invoke
    ('<minimax:tool_call>x<invoke name="f"></invoke></minimax:tool_call>', None),                      # text beside
    ('<minimax:tool_call><invoke name=""></invoke></minimax:tool_call>', None),                        # no name
    ("<minimax:tool_call>" + "<invoke name=" * 20000, None),                          # hostile: no quadratic scan
    ('<minimax:tool_call><invoke name="f">' + "<parameter name=" * 20000, ("", [("f", "{}")])),
])
def test_minimax_m2_parser_finds_the_calls_or_none(text, expected):
    """MiniMax-M2's `<minimax:tool_call>` blocks of `<invoke name="NAME">` with `<parameter name="KEY">` values, as
    vLLM's minimax_m2 parser reads them: each value its text with blank space trimmed (typed by the tools' schema,
    below), the text around the blocks the content."""
    assert PARSERS["minimax_m2"].calls(text) == expected


DS = "\uff5cDSML\uff5c"
DSML_CALLS = (f'<{DS}invoke name="get_weather">\n<{DS}parameter name="city" string="true">Oslo</{DS}parameter>\n'
              f'</{DS}invoke>\n<{DS}invoke name="get_time">\n</{DS}invoke>\n')
DSML_OUTPUT = f"Let me look.\n\n<{DS}function_calls>\n{DSML_CALLS}</{DS}function_calls>"
DSV4_OUTPUT = f"Let me look.\n\n<{DS}tool_calls>\n{DSML_CALLS}</{DS}tool_calls>"


@pytest.mark.parametrize("parser, text, expected", [
    ("deepseek_v32", DSML_OUTPUT, ("Let me look.\n\n", CALLS)),
    ("deepseek_v4", DSV4_OUTPUT, ("Let me look.\n\n", CALLS)),
    ("deepseek_v32", DSV4_OUTPUT, None), ("deepseek_v4", DSML_OUTPUT, None),         # each its own wrapper
    ("deepseek_v32", f"A<{DS}function_calls><{DS}invoke name=\"get_time\"></{DS}invoke></{DS}function_calls>B",
     ("AB", [CALLS[1]])),                                                             # the text around: content
    ("deepseek_v32", DSML_OUTPUT.removesuffix(f"</{DS}function_calls>"), None),      # unclosed at EOS: content,
    ("deepseek_v32", f"<{DS}function_calls><{DS}invoke name=\"get_time\">", None),         # as vLLM reads it whole
    ("deepseek_v32", f"<{DS}function_calls>x<{DS}invoke name=\"get_time\"></{DS}invoke></{DS}function_calls>", None),
    ("deepseek_v32", f"<{DS}function_calls>text</{DS}function_calls>", None),         # no invoke
    ("deepseek_v32", "no calls", None),
    ("deepseek_v32", f"<{DS}function_calls>" + f"<{DS}invoke name=\"" * 20000, None),  # hostile: linear time
    ("deepseek_v32", f"<{DS}function_calls>" * 20000, None),
    ("deepseek_v32", f'<{DS}function_calls><{DS}invoke name="get_time">' + f'<{DS}parameter name="a" string="true">'
     * 20000 + f"</{DS}invoke></{DS}function_calls>", ("", [CALLS[1]])),
    ("deepseek_v32", f"<{DS}function_calls>" + f'<{DS}invoke name="get_time"></{DS}invoke>' * 20000
     + f"</{DS}function_calls>", ("", [CALLS[1]] * 20000)),
])
def test_deepseek_dsml_parsers_find_the_calls_or_none(parser, text, expected):
    """DeepSeek V3.2's `<｜DSML｜function_calls>` and V4's `<｜DSML｜tool_calls>` blocks of `<｜DSML｜invoke name=...>`
    with `<｜DSML｜parameter name=... string="true|false">` values, as vLLM's deepseek_v32 and deepseek_v4 parsers read
    them: the block, each invoke and each value closed; the text around the blocks the content."""
    assert plan(parser=parser).calls(text) == expected


def test_deepseek_dsml_values_are_text_or_typed_by_the_tools_schema():
    """As vLLM gives them: a `string="true"` value is its text whatever the schema; a `string="false"` one reads
    as its property's type, or as JSON where the property has types but none fits, and stays text where the schema
    gives it no type; a lone `arguments` object around the schema's own properties is taken off."""
    schema = {"properties": {"n": {"type": "integer"}, "s": {"type": "string"}, "o": {"type": "object"},
                             "x": {"type": "integer"}, "b": {"type": "boolean"}, "any": {}}}
    tool_plan = chat(tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}]).tool_plan(
        PARSERS["deepseek_v32"])

    def arguments(*values):
        body = "".join(f'<{DS}parameter name="{key}" string="{string}">{value}</{DS}parameter>'
                       for key, string, value in values)
        found = tool_plan.calls(f'<{DS}function_calls><{DS}invoke name="f">{body}</{DS}invoke></{DS}function_calls>')
        return json.loads(found[1][0][1])
    assert arguments(("n", "false", "3"), ("s", "false", "42"), ("o", "false", '{"k": [1, null]}'),
                     ("x", "false", "2.5"), ("b", "false", "true"), ("any", "false", "[1]"), ("extra", "false", "7")) \
        == {"n": 3, "s": "42", "o": {"k": [1, None]}, "x": 2.5, "b": True, "any": "[1]", "extra": "7"}
    assert arguments(("n", "true", "3"), ("s", "true", " keep  spaces ")) == {"n": "3", "s": " keep  spaces "}
    assert arguments(("x", "false", "three")) == {"x": "three"}
    assert arguments(("arguments", "false", '{"n": 1, "s": "a"}')) == {"n": 1, "s": "a"}
    assert arguments(("arguments", "false", '{"zz": 1}')) == {"arguments": '{"zz": 1}'}


SEED_OUTPUT = ("Let me look.\n<seed:tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
               "</function>\n</seed:tool_call><seed:tool_call><function=get_time></function></seed:tool_call>")


def test_seed_oss_reads_qwen3_coders_calls_in_its_own_blocks():
    """Seed-OSS's `<seed:tool_call>` blocks hold Qwen3-Coder's `<function=NAME><parameter=KEY>` calls, read and
    typed as qwen3_coder's are (vLLM's seed_oss parser is qwen3_coder's with that wrapper); `<tool_call>` is not its."""
    assert plan(parser="seed_oss").calls(SEED_OUTPUT) == ("Let me look.\n", CALLS)
    qwen = SEED_OUTPUT.replace("seed:tool_call", "tool_call")
    assert plan(parser="seed_oss").calls(qwen) is None and plan(parser="qwen3_coder").calls(qwen) == (
        "Let me look.\n", CALLS)


Q = '<|"|>'      # Gemma 4's string quote
GEMMA_OUTPUT = (f"Let me look.<|tool_call>call:get_weather{{city:{Q}Oslo{Q}}}<tool_call|>"
                "<|tool_call>call:get_time{}<tool_call|>")


@pytest.mark.parametrize("text, expected", [
    (GEMMA_OUTPUT, ("Let me look.", CALLS)),
    (f"A<|tool_call>call:get_time{{}}<tool_call|>B", ("AB", [CALLS[1]])),              # the text around: content
    (f"<|tool_call>call:get_weather{{city:{Q}Oslo{Q}}}", None),                          # not closed: content
    ("<|tool_call>get_time{}<tool_call|>", None), ("<|tool_call>call:get_time<tool_call|>", None),  # no call:NAME{
    ("no calls", None),
    ("<|tool_call>" * 20000, None),                                                       # hostile: linear time,
    ("<|tool_call>call:get_time{a:" + "[" * 100000 + "}<tool_call|>", None),              # no recursion past 64
    (f"<|tool_call>call:get_time{{a:{Q}" + "x" * 100000 + "}<tool_call|>", ("", [("get_time", json.dumps(
        {"a": "x" * 100000}))])),                                                         # a string never closed
])
def test_gemma4_parser_finds_the_calls_or_none(text, expected):
    """Gemma 4's `<|tool_call>call:NAME{key:value,...}<tool_call|>` blocks, each closed, as vLLM's gemma4 parser reads
    them; the text around the blocks the content."""
    assert plan(parser="gemma4").calls(text) == expected


def test_gemma4_values_are_quoted_strings_or_read_as_json_would_write_them():
    """Its own value syntax, as vLLM reads it: `<|"|>`-quoted strings (a `}` or `,` inside kept), keys bare or
    quoted, true / false, null / none / nil, integers, numbers with a point, nested objects and arrays; a bare word
    that is none of them, or a number JSON cannot write, stays text; nesting past GEMMA_DEPTH is not a call."""
    from openai_api.tools import GEMMA_DEPTH, gemma4_calls
    body = (f"s:{Q}a, b}}{Q},{Q}quoted key{Q}:1, n:42,x:2.5,on:true,off:false,z:None,o:{{k:[1,{Q}b{Q},{{}}]}},"
            f"word:maybe,big:1.0e999,e:1e5,empty:")
    found = gemma4_calls(f"<|tool_call>call:f{{{body}}}<tool_call|>")
    assert json.loads(found[1][0][1]) == {"s": "a, b}", "quoted key": 1, "n": 42, "x": 2.5, "on": True, "off": False,
                                          "z": None, "o": {"k": [1, "b", {}]}, "word": "maybe", "big": "1.0e999",
                                          "e": "1e5", "empty": ""}
    nested = "a:" + "[" * GEMMA_DEPTH + "]" * GEMMA_DEPTH
    assert gemma4_calls(f"<|tool_call>call:f{{{nested}}}<tool_call|>")[1][0][0] == "f"
    assert gemma4_calls("<|tool_call>call:f{a:" + "[" * (GEMMA_DEPTH + 1) + "}<tool_call|>") is None
    for stray in ("a:[}],b:2", "a:[1,", "a:]"):                       # malformed, read to its end all the same
        assert gemma4_calls(f"<|tool_call>call:f{{{stray}}}<tool_call|>")[1][0][0] == "f"


def test_qwen3_coder_values_are_typed_by_the_tools_schema():
    """As vLLM types them: a value reads as its property's type where it is one (a Python literal too for objects
    and arrays), else stays text; a property the schema does not list is text."""
    from openai_api.tools import typed_arguments
    schema = {"properties": {"n": {"type": "integer"}, "x": {"type": "number"}, "on": {"type": "boolean"},
                             "o": {"type": "object"}, "a": {"type": "array"}, "s": {"type": "string"},
                             "maybe": {"type": ["integer", "null"]}, "any": {}, "bad": {"type": "integer"}}}
    text = {"n": "3", "x": "2.5", "on": "True", "o": "{'k': [1, None]}", "a": "[1, 2]", "s": "42", "maybe": "null",
            "any": "[true]", "bad": "three", "extra": "7"}
    assert json.loads(typed_arguments(json.dumps(text), schema)) == {
        "n": 3, "x": 2.5, "on": True, "o": {"k": [1, None]}, "a": [1, 2], "s": "42", "maybe": None, "any": "[true]",
        "bad": "three", "extra": "7"}
    hostile = {"x": "NaN", "n": "1e400", "a": "[" * 3000 + "]" * 3000, "o": '{"k": Infinity}'}
    assert json.loads(typed_arguments(json.dumps(hostile), schema)) == hostile       # none of them JSON: text
    for odd in ({"properties": ["x"]}, {"properties": {"x": {"type": [["number"]]}}}, {"properties": None}, []):
        assert json.loads(typed_arguments('{"x": "1"}', odd)) == {"x": "1"}
    weather = plan(parser="qwen3_coder").calls("<tool_call><function=get_weather><parameter=city>7</parameter>"
                                               "</function></tool_call>")
    assert weather == ("", [("get_weather", '{"city": "7"}')])          # the weather tool's city is a string
    typed = chat(tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}]).tool_plan(
        PARSERS["glm45"]).calls("<tool_call>f<arg_key>n</arg_key><arg_value>3</arg_value><arg_key>s</arg_key>"
                                "<arg_value>42</arg_value></tool_call>")
    assert typed == ("", [("f", '{"n": 3, "s": "42"}')])                # glm45's values typed the same way
    typed = chat(tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}]).tool_plan(
        PARSERS["minimax_m2"]).calls('<minimax:tool_call><invoke name="f"><parameter name="n">3</parameter>'
                                     '<parameter name="s">42</parameter></invoke></minimax:tool_call>')
    assert typed == ("", [("f", '{"n": 3, "s": "42"}')])                # and minimax_m2's


def test_an_auto_message_has_the_content_before_the_calls_and_finishes_with_tool_calls():
    ids = iter(["call_1", "call_2"])
    answer, finish = message(replace(plan(), id_source=lambda: next(ids)), HERMES_OUTPUT, "stop")
    assert answer == {"role": "assistant", "content": "Let me look.\n\n", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}
    assert finish == "tool_calls"
    assert message(plan(), "just text", "stop") == ({"role": "assistant", "content": "just text"}, "stop")
    assert message(plan("none"), HERMES_OUTPUT, "stop") == ({"role": "assistant", "content": HERMES_OUTPUT}, "stop")


@pytest.mark.parametrize("parser, text", [("llama3_json", '{"name": "Bob", "age": 3}'),
                                          ("mistral", '[{"name": "Bob", "age": 3}]'),
                                          ("hermes", '<tool_call>{"name": "Bob", "arguments": {}}</tool_call>'),
                                          ("pythonic", "[Bob(age=3)]")])
def test_json_that_names_no_given_tool_is_content_not_a_call(parser, text):
    """A JSON answer that happens to have a "name" (or a call of a function the request did not give) stays the
    text it is."""
    assert message(plan(parser=parser), text, "stop") == ({"role": "assistant", "content": text}, "stop")


def test_call_ids_are_what_the_models_template_takes_back():
    """OpenAI's `call_` ids, but 9 letters and digits with the mistral parser (Mistral's templates refuse others),
    whatever the tool_choice."""
    for choice in ("auto", "required"):
        mistral = plan(choice, "mistral").new_id()
        assert len(mistral) == 9 and mistral.isalnum()
    assert plan("required").new_id().startswith("call_")


@pytest.mark.parametrize("choice, parser, text", [
    ("auto", "hermes", HERMES_OUTPUT), ("auto", "hermes", "plain text, <tool no call"),
    ("auto", "llama3_json", ' {"name": "get_time", "parameters": {}}; {"name": "get_time", "parameters": {}}'),
    ("auto", "llama3_json", "Plain {text}"), ("auto", "mistral", '[{"name": "get_time", "arguments": {}}]'),
    ("auto", "mistral", "[not a call] after all"), ("auto", "pythonic", '[get_weather(city="Oslo"), get_time()]'),
    ("auto", "pythonic", "[not, a, call]"), ("auto", "qwen3_coder", QWEN3_CODER_OUTPUT),
    ("auto", "deepseek_v31", DEEPSEEK_V31_OUTPUT), ("auto", "deepseek_v3", DEEPSEEK_V3_OUTPUT),
    ("auto", "deepseek_v31", "plain <｜tool no call"), ("auto", "glm45", GLM45_OUTPUT),
    ("auto", "kimi_k2", KIMI_OUTPUT), ("auto", "kimi_k2", "plain <|tool_calls no call"),
    ("auto", "minimax_m2", MINIMAX_OUTPUT), ("auto", "minimax_m2", "plain <minimax:tool no call"),
    ("auto", "deepseek_v32", DSML_OUTPUT), ("auto", "deepseek_v4", DSV4_OUTPUT + " after"),
    ("auto", "deepseek_v32", f"plain <{DS}function no call"), ("auto", "gemma4", GEMMA_OUTPUT),
    ("auto", "gemma4", "plain <|tool no call"),
    ("auto", "seed_oss", SEED_OUTPUT), ("auto", "seed_oss", "plain <seed:tool no call"),
    ("named", "hermes", '{"city": "Oslo"}'), ("required", "hermes", '[{"name": "get_time", "parameters": {}}]')])
def test_every_split_of_the_output_streams_what_the_whole_message_holds(choice, parser, text):
    """Cut into two or three pieces at every place: the content and calls a client assembles from the deltas are
    the whole message's, character for character (a content never includes a piece of a call's markup; only
    whitespace is null in the whole message)."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    tool_plan = replace(plan(named if choice == "named" else choice, parser), id_source=lambda: "call_x")
    whole, finish = message(tool_plan, text, "stop")
    expected = (whole["content"] or "", [(c["function"]["name"], c["function"]["arguments"])
                                         for c in whole.get("tool_calls", [])], finish)
    for cut in range(len(text) + 1):
        for pieces in ([text[:cut], text[cut:]], [text[:cut // 2], text[cut // 2:cut], text[cut:]]):
            content, calls, streamed_finish = assembled(tool_plan, pieces)
            assert (content if content.strip() else "", calls, streamed_finish) == expected


def assembled(tool_plan: ToolPlan, pieces: list[str]) -> tuple[str, list, str]:
    """(content, calls, finish reason) a client assembles from a stream's chunks, OpenAI's way (content
    concatenated, a call's name and arguments concatenated by index), the last piece in the finishing chunk."""
    stream, deltas = ToolStream(tool_plan), []
    for piece in pieces[:-1]:
        deltas.append(stream.feed(piece))
    delta = stream.feed(pieces[-1])
    last, finish = stream.finish("stop")
    deltas.append(merged(delta, last))
    content, calls = "", {}
    for delta in deltas:
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], ["", ""])
            entry[0] += call["function"].get("name", "")
            entry[1] += call["function"]["arguments"]
    return content, [tuple(entry) for _, entry in sorted(calls.items())], finish


def test_required_asks_llguidance_for_an_array_of_the_tools_calls():
    import llguidance
    from openai_api.tools import AS_DUMPED, NO_PARAMETERS
    schema = plan("required").schema()
    assert schema["minItems"] == 1 and "maxItems" not in schema
    assert plan("required", parallel_tool_calls=False).schema()["maxItems"] == 1
    assert [item["properties"]["parameters"] for item in schema["items"]["anyOf"]] == [
        WEATHER["function"]["parameters"], NO_PARAMETERS]
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    assert plan("required").calls('[{"name": "get_weather", "parameters": {"city": "Oslo"}}]') == ("", CALLS[:1])
    assert plan("required").calls('[{"name": "get_wea') is None            # cut short: the text is content
    named = plan({"type": "function", "function": {"name": "get_weather"}})
    assert named.schema() == {**WEATHER["function"]["parameters"], "x-guidance": AS_DUMPED}
    assert named.calls('{"ci') == ("", [("get_weather", '{"ci')])
    assert plan("auto").schema() is None and plan("none").schema() is None


def test_required_keeps_each_tools_definitions_and_references():
    """A tool whose parameters refer to their own `$defs` (as pydantic writes nested models, and the openai SDK's
    pydantic_function_tool sends them): inside "required"'s array its references still resolve, and only to its
    own definitions."""
    import llguidance
    location = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    nested = [{"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"where": {"$ref": "#/$defs/Loc"}}, "required": ["where"],
        "$defs": {"Loc": {**location, "title": name}}}}} for name in ("f", "g")]
    schema = chat(tools=nested, tool_choice="required").tool_plan(None).schema()
    assert llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(schema)) == ""
    assert schema["$defs"] == {"f__Loc": {**location, "title": "f"}, "g__Loc": {**location, "title": "g"}}
    assert [item["properties"]["parameters"]["properties"]["where"] for item in schema["items"]["anyOf"]] == [
        {"$ref": "#/$defs/f__Loc"}, {"$ref": "#/$defs/g__Loc"}]


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),                                  # no tools
    ({"tools": [], "tool_choice": "auto"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [TIME], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [TIME], "tool_choice": {"type": "function", "function": {"name": "get_time"}},
      "guided_regex": "a"}, "guided_regex"),
])
def test_a_tool_choice_the_request_cannot_have_is_a_400_naming_its_parameter(body, param):
    with pytest.raises(ApiError) as refused:
        chat(**body).tool_plan(PARSERS["hermes"])
    assert refused.value.param == param and str(refused.value).startswith(param)


def test_auto_without_a_parser_is_refused_and_says_how_to_get_one():
    with pytest.raises(ApiError, match="http.tool_call_parser") as refused:
        chat(tools=[WEATHER]).tool_plan(None)
    assert refused.value.param == "tool_choice"
    assert chat(tools=[WEATHER], tool_choice="required").tool_plan(None).choice == "required"


QWEN_STYLE = """{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{{ message.content }}
{%- for tool_call in message.tool_calls %}
<tool_call>
{"name": "{{ tool_call.function.name }}", "arguments": {{ tool_call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_a_conversation_with_tools_renders_as_transformers_renders_it(tmp_path):
    """Tools, an assistant's calls (arguments sent as JSON text, given to the template as an object) and a tool's
    answer: the prompt is what transformers' apply_chat_template makes of the same conversation (its tojson too:
    `<` and `&` left as they are)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"x": 0}, unk_token="x")))
    tokenizer.chat_template = QWEN_STYLE
    messages = [{"role": "user", "content": "Weather in <Oslo> & Bergen?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    body = chat(messages=messages, tools=[WEATHER, TIME])
    ours = ChatTemplate(QWEN_STYLE).render(body.messages, body.tool_plan(PARSERS["hermes"]).template_tools())
    for sent in messages[1]["tool_calls"]:
        sent["function"]["arguments"] = json.loads(sent["function"]["arguments"])
    theirs = tokenizer.apply_chat_template(messages, tools=[WEATHER, TIME], add_generation_prompt=True,
                                           tokenize=False)
    assert ours == theirs and "<Oslo> & Bergen" in ours and '"arguments": {"city": "Oslo"}' in ours


# ---- the deprecated form: functions, function_call (openai_api/functions.py) ----------------------------------
FUNCTIONS = [WEATHER["function"], TIME["function"]]


def deprecated(parser="hermes", **body) -> tuple[ChatRequest, bool]:
    from openai_api.functions import as_tools
    return as_tools(chat(**body), PARSERS.get(parser))


def test_functions_stand_for_tools_with_one_call_at_most():
    """`functions` are tools; `function_call` is tool_choice (default "auto", as OpenAI's), with parallel calls off;
    an earlier turn's function_call and function message become a tool call and the tool message that answers it."""
    body, asked = deprecated(functions=FUNCTIONS, function_call={"name": "get_weather"})
    assert asked and [tool.function.name for tool in body.tools] == ["get_weather", "get_time"]
    assert body.tool_choice.function.name == "get_weather" and body.parallel_tool_calls is False
    assert body.tool_plan(None).choice == "named"
    assert deprecated(functions=FUNCTIONS)[0].tool_plan(PARSERS["hermes"]).choice == "auto"
    assert deprecated(functions=FUNCTIONS, function_call="none")[0].tool_plan(None).choice == "none"
    assert deprecated(functions=[])[1] is False
    turns = [{"role": "user", "content": "Oslo?"},
             {"role": "assistant", "content": None, "function_call": {"name": "get_weather", "arguments": "{}"}},
             {"role": "function", "name": "get_weather", "content": "sunny"}]
    body, asked = deprecated(messages=turns)          # the conversation alone, in a request without functions
    assert not asked and [m.for_template() for m in body.messages[1:]] == [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "fn0000001", "type": "function", "function": {"name": "get_weather", "arguments": {}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "fn0000001", "name": "get_weather"}]
    both = {"role": "assistant", "content": None, "function_call": {"name": "get_time", "arguments": "{}"},
            "tool_calls": [{"id": "call_a", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}
    body, _ = deprecated(messages=[turns[0], both, {"role": "function", "name": "get_time", "content": None}])
    assert [call.id for call in body.messages[1].tool_calls] == ["call_a", "fn0000001"]     # neither is lost
    assert body.messages[2].for_template()["content"] == ""


@pytest.mark.parametrize("body, parser, param", [
    ({"function_call": "auto"}, "hermes", "function_call"),                          # no functions
    ({"functions": FUNCTIONS, "tools": [WEATHER]}, "hermes", "functions"),
    ({"functions": FUNCTIONS, "tool_choice": "none"}, "hermes", "functions"),
    ({"functions": FUNCTIONS}, None, "function_call"),                              # auto, no parser
    ({"functions": FUNCTIONS, "function_call": {"name": "nope"}}, "hermes", "function_call"),
    ({"functions": [WEATHER["function"]] * 2}, "hermes", "functions"),
])
def test_a_deprecated_request_it_cannot_serve_is_a_400_naming_its_parameter(body, parser, param):
    """Named as the client sent it, not as the tools request it stands for."""
    from openai_api.functions import deprecated_plan
    with pytest.raises(ApiError) as refused:
        deprecated_plan(deprecated(parser, **body)[0], PARSERS.get(parser), True)
    assert refused.value.param == param and str(refused.value).startswith(param)
    if body.get("function_call") == {"name": "nope"}:                      # tool_plan's refusal, renamed
        assert str(refused.value) == "function_call: no function named 'nope' in `functions`"


def test_auto_with_parallel_calls_off_keeps_the_first_call():
    """parallel_tool_calls false (and so `functions`) promises one call at most: of output with two, the first, as
    vLLM answers."""
    assert plan(parallel_tool_calls=False).calls(HERMES_OUTPUT) == ("Let me look.\n\n", CALLS[:1])
    assert plan().calls(HERMES_OUTPUT) == ("Let me look.\n\n", CALLS)


@pytest.mark.parametrize("function_call, text", [
    ({"name": "get_weather"}, '{"city": "Oslo"}'), ("auto", 'Looking.<tool_call>{"name": "get_time", '
                                                            '"arguments": {}}</tool_call>'),
    ("auto", "no call"), ("auto", HERMES_OUTPUT)])
def test_a_deprecated_answer_carries_function_call_whole_and_at_every_split_of_a_stream(function_call, text):
    """`message.function_call` {name, arguments} (no id) and finish reason `function_call` (a named one: `stop`,
    as OpenAI's); a stream's deltas, assembled as the deprecated API's clients do, hold the same at every cut."""
    from openai_api.choices import ChatCompletions
    body, _ = deprecated(functions=FUNCTIONS, function_call=function_call)

    def kind():
        return ChatCompletions(str, body.tool_plan(PARSERS["hermes"]), deprecated=True)
    whole = kind().choice(0, text, None, "stop")
    called = whole["message"].get("function_call")
    assert "tool_calls" not in whole["message"] and (called is None) == (text == "no call")
    assert whole["finish_reason"] == ("function_call" if called and function_call == "auto" else "stop")
    expected = (whole["message"]["content"] or "", called and (called["name"], called["arguments"]))
    for cut in range(len(text) + 1):
        stream, deltas = kind(), []
        deltas.append(stream.chunk_choice(0, text[:cut], None, None))
        deltas.append(stream.chunk_choice(0, text[cut:], None, "stop"))
        content = "".join(d["delta"].get("content") or "" for d in deltas)
        calls = [d["delta"]["function_call"] for d in deltas if "function_call" in d["delta"]]
        name = "".join(c.get("name", "") for c in calls)
        assembled = (name, "".join(c.get("arguments", "") for c in calls)) if calls else None
        assert (content if content.strip() else "", assembled) == expected
        assert deltas[-1]["finish_reason"] == whole["finish_reason"]
