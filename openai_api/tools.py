"""Tool calling in chat completions: OpenAI's `tools` and `tool_choice`, and the assistant's `tool_calls`.

The tools reach the model through its chat template (`tools`, as transformers passes them). What the output is:
- `tool_choice` naming a function: its arguments, as JSON its `parameters` schema accepts (structured output, so
  exact under speculation); the answer is one call of it.
- `"required"`: a JSON array of one or more `{"name": ..., "parameters": {...}}`, each a tool's name and arguments
  (as vLLM constrains it); the answer is those calls.
- `"auto"` (the default when there are tools): free text, which the configured parser (`http.tool_call_parser`)
  reads calls out of: `hermes` (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`: Qwen 2.5 / 3, Hermes) or
  `llama3_json` (the output a JSON object `{"name": ..., "parameters": ...}`, or several joined by `;`) or
  `mistral` (the output a JSON array of `{"name": ..., "arguments": ...}`, after `[TOOL_CALLS]`) or `pythonic`
  (the output a Python list of calls, `[get_weather(city="Oslo")]`: Llama 3.2 and 4) or `qwen3_coder`
  (`<tool_call><function=get_weather><parameter=city>Oslo</parameter></function></tool_call>`, values typed by the
  tool's schema) or `seed_oss` (the same in `<seed:tool_call>` blocks), `deepseek_v31`, `deepseek_v3`, `deepseek_v32` or `deepseek_v4` (DeepSeek V3.2's and V4's DSML
  `<｜DSML｜invoke name="get_weather">` blocks) or `gemma4` (`<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>}
  <tool_call|>`) or `glm45` (`<tool_call>get_weather<arg_key>city</arg_key>
  <arg_value>Oslo</arg_value></tool_call>`: GLM-4.5 to 4.7, values typed as qwen3_coder's) or `openai` (gpt-oss's
  harmony messages to `functions.NAME`, openai_api/harmony.py; with the `openai_gptoss` reasoning parser, which
  hands it the content with each call written back as one message).
- `"none"`: free text, no calls read.

    {"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
      "properties": {"city": {"type": "string"}}, "required": ["city"]}}}], "tool_choice": "required"}
"""
from __future__ import annotations

import ast
import functools
import json
import math
import re
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from openai_api import harmony
from protos.specpool.v1 import generation_pb2

NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}   # no `parameters`: none
# Calls' JSON as json.dumps writes it (", " and ": ", no newlines), llguidance's option: what models are trained on,
# and it keeps a model from padding its arguments with whitespace (which JSON allows) until max_tokens. A tool's
# schema with an x-guidance of its own keeps that.
AS_DUMPED = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Function(BaseModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$", strict=True)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None               # a JSON Schema object
    strict: Optional[bool] = None                             # specpool's arguments always follow the schema


class Tool(BaseModel):
    type: Literal["function"]
    function: Function


class FunctionName(BaseModel):
    name: str = Field(strict=True)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionName


def string_or_named(strings: Any, named: type, expected: str) -> Any:
    """A tool choice: one of `strings`, or a `named` function object, chosen by the JSON value's kind (tags with a
    space, so that an error names `tool_choice` or its own key, not a union member), else `must be <expected>`."""
    def kind(value: Any) -> str | None:
        return "a string" if isinstance(value, str) else "an object" if isinstance(value, (dict, BaseModel)) else None
    return Annotated[Union[Annotated[strings, Tag("a string")], Annotated[named, Tag("an object")]],
                     Discriminator(kind, custom_error_type="invalid_type", custom_error_message=f"must be {expected}")]


ToolChoice = string_or_named(Literal["none", "auto", "required"], NamedToolChoice,
                             '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}')


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):            # 1e400: Python's JSON reads it as inf, which JSON cannot write
        raise ValueError(f"{text} is out of range")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")   # NaN, Infinity: Python's JSON reads them, JSON has none


STRICT_JSON = json.JSONDecoder(parse_float=_finite, parse_constant=_no_constant)


def _json(text: str) -> Any:
    """JSON's value of `text`, or None (not JSON, too deep, or numbers JSON cannot write)."""
    try:
        return STRICT_JSON.decode(text)
    except (ValueError, RecursionError):
        return None


class CalledFunction(BaseModel):
    name: str = Field(strict=True)
    arguments: str = Field(strict=True)        # JSON text, as OpenAI sends it (any text: a call cut short too)

    def for_template(self) -> dict | str:
        """The arguments as chat templates take them: an object (transformers' form), or the text as it came if it
        is not one."""
        arguments = _json(self.arguments)
        return arguments if isinstance(arguments, dict) else self.arguments


class ToolCall(BaseModel):
    """An assistant message's earlier call, as a client sends the conversation back."""
    id: str = Field(strict=True)
    type: Literal["function"] = "function"
    function: CalledFunction


Call = tuple[str, str]          # (function name, arguments as JSON text)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


Found = tuple[str, list[Call]]      # (the output's text outside its calls, the calls)


def _call(value: Any, *argument_keys: str) -> Call | None:
    """The call a JSON object `{"name": ..., <an argument key>: {...}}` makes, or None if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = next((value[key] for key in argument_keys if key in value), {})
    return (value["name"], json.dumps(arguments)) if isinstance(arguments, dict) else None


def _found(content: str, calls: list[Call | None]) -> Found | None:
    return None if not calls or None in calls else (content, calls)


def _json_values(text: str, separator: str = "") -> tuple[list, str]:
    """The JSON values `text` starts with (one, or with a separator several joined by it), and the text after."""
    values, at = [], 0
    while True:
        try:
            value, end = STRICT_JSON.raw_decode(text, at)
        except (ValueError, RecursionError):
            return values, text[at:]
        values.append(value)
        after = text[end:].lstrip()
        if not separator or not after.startswith(separator):
            return values, text[end:]
        rest = after[len(separator):]
        at = len(text) - len(rest.lstrip())


def hermes_calls(text: str) -> Found | None:
    """The calls of `<tool_call>{...}</tool_call>` blocks (the last may be unclosed, as a model that stops at EOS
    leaves it) and the text around them; None where there is none or one is not a call."""
    pieces = re.split(r"<tool_call>(.*?)(?:</tool_call>|$)", text, flags=re.DOTALL)   # text, block, text, ...
    return _found("".join(pieces[0::2]), [_call(_json(block.strip()), "arguments") for block in pieces[1::2]])


def llama3_json_calls(text: str) -> Found | None:
    """Llama 3.x's JSON calls: the output (after `<|python_tag|>`, if any) one `{"name", "parameters"}` object or
    several joined by `;`; None where it is not."""
    lead = len(text) - len(text.lstrip())
    body = text[lead:].removeprefix("<|python_tag|>")
    if not body.startswith("{"):
        return None
    values, rest = _json_values(body, ";")
    return _found(text[:lead] + rest, [_call(value, "parameters", "arguments") for value in values])


def mistral_calls(text: str) -> Found | None:
    """Mistral's calls: the output (after `[TOOL_CALLS]`, a special token the text usually drops) a JSON array of
    `{"name", "arguments"}` objects; None where it is not."""
    lead = len(text) - len(text.lstrip())
    body = text[lead:].removeprefix("[TOOL_CALLS]")
    values, rest = _json_values(body) if body.startswith("[") else ([], "")
    called = values[0] if values and isinstance(values[0], list) else []
    return _found(text[:lead] + rest, [_call(value, "arguments") for value in called])


_PYTHONIC_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def _literal(node: ast.AST) -> Any:
    """A keyword argument's value as JSON takes it: Python literals (strings, numbers, lists, tuples, dicts with
    string keys) and JSON's `true`, `false` and `null`; ValueError for anything else (a name, an expression)."""
    if isinstance(node, ast.Name) and node.id in _PYTHONIC_NAMES:
        return _PYTHONIC_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict) and all(isinstance(key, ast.Constant) and isinstance(key.value, str)
                                          for key in node.keys):
        return {key.value: _literal(value) for key, value in zip(node.keys, node.values)}
    value = ast.literal_eval(node)
    if isinstance(value, (str, int, bool, type(None))) or isinstance(value, float) and math.isfinite(value):
        return value
    raise ValueError("not a JSON value")


def _pythonic_call(node: ast.AST) -> Call | None:
    """The call `name(key=value, ...)` makes, or None (positional arguments, a name that is not plain, a value that
    is not a literal)."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args or \
            any(keyword.arg is None for keyword in node.keywords):
        return None
    try:
        return node.func.id, json.dumps({keyword.arg: _literal(keyword.value) for keyword in node.keywords})
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return None


def pythonic_calls(text: str) -> Found | None:
    """Pythonic calls (Llama 3.2, Llama 4): the output (between `<|python_start|>` and `<|python_end|>`, if
    there) one Python list of calls with keyword arguments, `[get_weather(city="Oslo"), get_time()]`; None where
    it is not."""
    lead = len(text) - len(text.lstrip())
    body = text[lead:].removeprefix("<|python_start|>").rstrip().removesuffix("<|python_end|>")
    if not body.lstrip().startswith("["):
        return None
    try:
        tree = ast.parse(body.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):     # MemoryError: the parser's stack, as thousands
        return None                                                    # of nested operators overflow it
    return _found(text[:lead], [_pythonic_call(node) for node in tree.elts]) if isinstance(tree, ast.List) else None


def qwen3_coder_calls(text: str, tag: str = "tool_call") -> Found | None:
    """Qwen3-Coder's XML calls: `<tool_call><function=NAME><parameter=KEY>value</parameter>...</function>
    </tool_call>` blocks (the last may be unclosed), the text around them content; Seed-OSS's the same in
    `<seed:tool_call>` blocks (`tag`). Each value is the text between its tags, one line end trimmed at each side:
    text, which ToolPlan types by the tool's schema (typed_arguments)."""
    pieces = re.split(rf"<{tag}>(.*?)(?:</{tag}>|\Z)", text, flags=re.DOTALL)    # text, block, text, ...
    return _found("".join(pieces[0::2]), [call for block in pieces[1::2] for call in _xml_calls(block)])


# DeepSeek's markers (fullwidth bars, U+FF5C, and lower blocks, U+2581), ordinary text in its output
DS_CALLS, DS_CALLS_END = "<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581calls\u2581end\uff5c>"
DS_CALL, DS_SEP, DS_CALL_END = ("<\uff5ctool\u2581call\u2581begin\uff5c>", "<\uff5ctool\u2581sep\uff5c>",
                                "<\uff5ctool\u2581call\u2581end\uff5c>")
_DS_V3_CALL = re.compile(r"function\n?(.*?)\n```json\n(.*)\n```\s*\Z", flags=re.DOTALL)   # name, arguments


def deepseek_calls(text: str, v3: bool = False) -> Found | None:
    """DeepSeek's calls: after `<｜tool▁calls▁begin｜>`, blocks `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}
    <｜tool▁call▁end｜>` (V3.1 on; `v3`: V3 and R1's `function<｜tool▁sep｜>NAME` then the arguments in a ```json
    fence), the last of which may be unclosed; the text before the calls (and after `<｜tool▁calls▁end｜>`) is the
    content. None where there are none or a block is not a call."""
    start = text.find(DS_CALLS)
    if start < 0:
        return None
    body, _, after = text[start + len(DS_CALLS):].partition(DS_CALLS_END)
    before, *blocks = body.split(DS_CALL)
    if before.strip() or not blocks:
        return None
    return _found(text[:start] + after, [_deepseek_call(block, v3) for block in blocks])


def _deepseek_call(block: str, v3: bool) -> Call | None:
    """The call of one block (what follows `<｜tool▁call▁begin｜>`): NAME<｜tool▁sep｜>ARGUMENTS<｜tool▁call▁end｜>
    (the end left out at EOS) and nothing but blank space after it; None where it is not one."""
    head, sep, tail = block.partition(DS_SEP)
    tail, _, rest = tail.partition(DS_CALL_END)
    if not sep or rest.strip():
        return None
    if v3:
        fenced = _DS_V3_CALL.match(head.strip() + "\n" + tail) if head.strip() == "function" else None
        head, tail = fenced.groups() if fenced else ("", "")
    arguments = _json(tail.strip())
    return (head.strip(), json.dumps(arguments)) if head.strip() and isinstance(arguments, dict) else None


_XML_FUNCTION = re.compile(r"<function=([^<>\n]+)>(.*?)(?:</function>|(?=<function=)|\Z)", flags=re.DOTALL)


def _xml_calls(block: str) -> list[Call | None]:
    """The calls of one block: each `<function=NAME>...</function>` in it (the last may be unclosed); [None] where
    it holds none or text outside them."""
    calls, outside = _XML_FUNCTION.findall(block), _XML_FUNCTION.sub("", block)
    if not calls or outside.strip():
        return [None]
    return [(name.strip(), json.dumps({key.strip(): _trimmed(value) for key, value in re.findall(
        r"<parameter=([^<>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", body, re.DOTALL)})) for name, body in calls]


def glm45_calls(text: str) -> Found | None:
    """GLM-4.5's (and 4.6's, 4.7's) calls: `<tool_call>NAME<arg_key>KEY</arg_key><arg_value>value</arg_value>...
    </tool_call>` blocks, blank space (or a written `\\n`) between a key and its value (the last block, and its
    last value, may be unclosed at EOS); the text around the blocks content, other text inside one ignored, as vLLM
    reads them. Each value is its text as written, which ToolPlan types by the tool's schema (typed_arguments)."""
    pieces = re.split(r"<tool_call>(.*?)(?:</tool_call>|\Z)", text, flags=re.DOTALL)    # text, block, text, ...
    return _found("".join(pieces[0::2]), [_glm_call(block) for block in pieces[1::2]])


_GLM_KEY = re.compile(r"<arg_key>([^<]*)</arg_key>(?:\\n|\s)*<arg_value>")


def _glm_call(block: str) -> Call | None:
    """The call of one block: its name (one word), then its KEY/value pairs, read in one pass whatever the block
    holds; None where the name is not one."""
    name = block.partition("<arg_key>")[0]
    if not re.fullmatch(r"[^\s<>]+", name.strip()):
        return None
    arguments, at = {}, len(name)
    while (start := block.find("<arg_key>", at)) >= 0 and (key := _GLM_KEY.match(block, start)):
        end = block.find("</arg_value>", key.end())
        end = len(block) if end < 0 else end
        arguments[key[1].strip()] = block[key.end():end]
        at = end + len("</arg_value>")
    return name.strip(), json.dumps(arguments)


# Kimi K2's markers (special tokens in its tokenizer); the section's also written in the singular, as vLLM reads it
KIMI_SECTIONS = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
KIMI_SECTION_ENDS = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
KIMI_CALL, KIMI_ARGUMENTS, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_KIMI_ID = re.compile(r"\s*((?:functions\.)?([\w.-]+):\d+)\s*")      # functions.NAME:INDEX, NAME the call's


def kimi_k2_blocks(text: str) -> tuple[str, list[tuple[str, Call | None]]] | None:
    """Kimi K2's calls with the ids it writes: after `<|tool_calls_section_begin|>`, blocks
    `<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{...}<|tool_call_end|>` (the last, and the
    section, may be unclosed at EOS); (the text before the section and after its end, [(id, call or None)]), or
    None where there is no section."""
    start = min((at for at in map(text.find, KIMI_SECTIONS) if at >= 0), default=-1)
    if start < 0:
        return None
    body = text[start:].split(">", 1)[1]
    ends = [at for at in map(body.find, KIMI_SECTION_ENDS) if at >= 0]
    body, after = (body[:min(ends)], body[min(ends):].split(">", 1)[1]) if ends else (body, "")
    before, *blocks = body.split(KIMI_CALL)
    if before.strip() or not blocks:
        return text[:start] + after, [("", None)]
    return text[:start] + after, [_kimi_call(block) for block in blocks]


def _kimi_call(block: str) -> tuple[str, Call | None]:
    """(the id, the call) of one block (what follows `<|tool_call_begin|>`); the call None where it is not one."""
    head, sep, tail = block.partition(KIMI_ARGUMENTS)
    tail, _, rest = tail.partition(KIMI_CALL_END)
    named, arguments = _KIMI_ID.fullmatch(head), _json(tail.strip())
    if not sep or not named or rest.strip() or not isinstance(arguments, dict):
        return "", None
    return named[1], (named[2], json.dumps(arguments))


def kimi_k2_calls(text: str) -> Found | None:
    found = kimi_k2_blocks(text)
    return found and _found(found[0], [call for _, call in found[1]])


def kimi_call_id(name: str, index: int) -> str:
    """Kimi K2's id of a call: `functions.NAME:INDEX`, INDEX counting the conversation's calls from 0."""
    return f"functions.{name}:{index}"


def kimi_k2_ids(text: str) -> list[str]:
    """The ids Kimi K2 wrote for its calls (`functions.get_weather:0`): its template writes them back as they were."""
    found = kimi_k2_blocks(text)
    return [call_id for call_id, _ in found[1]] if found else []


_MINIMAX_INVOKE = re.compile(r"<invoke name=([^<>\n]*)>(.*?)(?:</invoke>|(?=<invoke name=)|\Z)", flags=re.DOTALL)
_MINIMAX_PARAMETER = re.compile(r"<parameter name=([^<>\n]*)>(.*?)(?:</parameter>|(?=<parameter name=)|\Z)",
                                flags=re.DOTALL)


def minimax_m2_calls(text: str) -> Found | None:
    """MiniMax-M2's calls: `<minimax:tool_call>` blocks of `<invoke name="NAME"><parameter name="KEY">value
    </parameter>...</invoke>` (the block, an invoke and its last value may be unclosed at EOS; the name quoted or
    not); the text around the blocks is the content. Each value is its text, blank space trimmed, which ToolPlan
    types by the tool's schema (typed_arguments), as vLLM's minimax_m2 parser reads them."""
    pieces = re.split(r"<minimax:tool_call>(.*?)(?:</minimax:tool_call>|\Z)", text, flags=re.DOTALL)
    return _found("".join(pieces[0::2]), [call for block in pieces[1::2] for call in _minimax_calls(block)])


def _minimax_calls(block: str) -> list[Call | None]:
    """The calls of one block; [None] where it holds none, text outside them, or an invoke without a name."""
    invokes = _MINIMAX_INVOKE.findall(block)
    if not invokes or _MINIMAX_INVOKE.sub("", block).strip():
        return [None]
    return [(_unquoted(name), json.dumps({_unquoted(key): value.strip() for key, value in
                                          _MINIMAX_PARAMETER.findall(body)})) if _unquoted(name) else None
            for name, body in invokes]


def _unquoted(name: str) -> str:
    name = name.strip()
    return name[1:-1] if len(name) > 1 and name[0] == name[-1] and name[0] in "\"'" else name


DSML = "\uff5cDSML\uff5c"      # DeepSeek V3.2's and V4's markup, `<｜DSML｜invoke name="...">` (fullwidth bars)
_DSML_INVOKE = re.compile(rf'<{DSML}invoke\s+name="([^"]+)"\s*>')
_DSML_PARAMETER = re.compile(rf'<{DSML}parameter\s+name="([^"]+)"\s+string="(true|false)"\s*>')


def dsml_calls(text: str, wrapper: str) -> Found | None:
    """DeepSeek V3.2's (`wrapper` function_calls) and V4's (tool_calls) calls: `<｜DSML｜function_calls>` blocks of
    `<｜DSML｜invoke name="NAME"><｜DSML｜parameter name="KEY" string="true|false">value</｜DSML｜parameter>...
    </｜DSML｜invoke>`, each block, invoke and value closed, as vLLM's parsers read them; the text around the blocks
    is the content. A value's `string` attribute goes with it ([text, is a string]) for dsml_arguments, which types
    it by the tool's schema."""
    content, blocks = closed_blocks(text, f"<{DSML}{wrapper}>", f"</{DSML}{wrapper}>")
    return _found(content, [call for block in blocks for call in _dsml_calls(block)])


def closed_blocks(text: str, opening: str, closing: str) -> tuple[str, list[str]]:
    """(the text outside them, their bodies) of the `opening` ... `closing` blocks of `text`, each closed (one
    not closed is text). Each marker is found once (str.find), so hostile output costs linear time."""
    content, bodies, at = [], [], 0
    while (start := text.find(opening, at)) >= 0 and (end := text.find(closing, start)) >= 0:
        content.append(text[at:start])
        bodies.append(text[start + len(opening):end])
        at = end + len(closing)
    return "".join(content) + text[at:], bodies


def _element(text: str, head: re.Pattern, closing: str, at: int) -> tuple[tuple, str | None, int] | None:
    """(head's groups, the body up to `closing` or None where it is not closed, where the element ends) for the
    element whose head starts at `at`; None where none does."""
    opened = head.match(text, at)
    if not opened:
        return None
    end = text.find(closing, opened.end())
    return (opened.groups(), text[opened.end():end], end + len(closing)) if end >= 0 else (opened.groups(), None, 0)


_BLANK = re.compile(r"\s*")


def _dsml_calls(block: str) -> list[Call | None]:
    """The calls of one block; [None] where it holds none, an invoke not closed, or text outside them."""
    calls, at = [], 0
    while (at := _BLANK.match(block, at).end()) < len(block):
        invoke = _element(block, _DSML_INVOKE, f"</{DSML}invoke>", at)
        if invoke is None or invoke[1] is None:
            return [None]
        (name,), body, at = invoke
        calls.append((name, json.dumps(dict(_dsml_values(body)))))
    return calls or [None]


def _dsml_values(body: str):
    """(key, [text, is a string]) of each closed parameter in an invoke's body (text between them ignored, as vLLM
    reads them; none after one not closed)."""
    at = 0
    while (start := body.find(f"<{DSML}parameter", at)) >= 0:
        parameter = _element(body, _DSML_PARAMETER, f"</{DSML}parameter>", start)
        if parameter is None:
            at = start + 1
            continue
        (key, string), value, at = parameter
        if value is None:
            return
        yield key, [value, string == "true"]


GEMMA_CALL, GEMMA_CALL_END, GEMMA_QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'    # Gemma 4's (special tokens)
_GEMMA_HEAD = re.compile(r"call:([\w\-.]+)\{")
GEMMA_DEPTH = 64          # objects and arrays nested deeper than this: not a call (the parser recurses once a level)


def gemma4_calls(text: str) -> Found | None:
    """Gemma 4's calls: `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:42,on:true,o:{...},a:[...]}<tool_call|>` blocks,
    each closed, as vLLM's gemma4 parser reads them (strings between `<|"|>` quotes, other values true, false, null,
    numbers or bare text); the text around the blocks is the content. Each marker is found once, and each value read
    once, so hostile output costs linear time."""
    content, blocks = closed_blocks(text, GEMMA_CALL, "}" + GEMMA_CALL_END)
    return _found(content, [_gemma_call(block) for block in blocks])


def _gemma_call(block: str) -> Call | None:
    """The call of one block (`call:NAME{` and its arguments), None where it is not one."""
    head = _GEMMA_HEAD.match(block)
    values = _gemma_object(block, head.end(), "", 0)[0] if head else None
    return None if values is None else (head[1], json.dumps(values))


def _gemma_object(text: str, at: int, closing: str, depth: int) -> tuple[dict | None, int]:
    """The `key:value` pairs from `at` to `closing` (or the end), and where they end; None nested too deep."""
    values = {}
    while (at := _GEMMA_GAP.match(text, at).end()) < len(text) and text[at] != closing:
        colon = text.find(":", at)
        if colon < 0:
            break
        key = text[at:colon].strip()
        key = key[len(GEMMA_QUOTE):-len(GEMMA_QUOTE)] if len(key) > 1 and key.startswith(GEMMA_QUOTE) and \
            key.endswith(GEMMA_QUOTE) else key
        values[key], at = _gemma_value(text, _GEMMA_BLANK.match(text, colon + 1).end(), depth)
        if values[key] is _TOO_DEEP:
            return None, at
    return values, at + (at < len(text))


def _gemma_array(text: str, at: int, depth: int) -> tuple[list | None, int]:
    items = []
    while (at := _GEMMA_GAP.match(text, at).end()) < len(text) and text[at] != "]":
        item, end = _gemma_value(text, at, depth)
        if item is _TOO_DEEP:
            return None, end
        if end == at:                   # a stray `}`: the array ends here
            break
        items.append(item)
        at = end
    return items, at + (at < len(text))


def _gemma_value(text: str, at: int, depth: int) -> tuple[Any, int]:
    """The value at `at` and where it ends: a quoted string (the rest, where it is not closed), an object, an
    array, or bare text up to `,`, `}` or `]` read as true, false, null or a number where it is one."""
    if text.startswith(GEMMA_QUOTE, at):
        end = text.find(GEMMA_QUOTE, at + len(GEMMA_QUOTE))
        end = len(text) if end < 0 else end
        return text[at + len(GEMMA_QUOTE):end], end + len(GEMMA_QUOTE)
    if at < len(text) and text[at] in "{[":
        if depth >= GEMMA_DEPTH:
            return _TOO_DEEP, len(text)
        found, end = _gemma_object(text, at + 1, "}", depth + 1) if text[at] == "{" else \
            _gemma_array(text, at + 1, depth + 1)
        return (_TOO_DEEP if found is None else found), end
    end = _GEMMA_BARE.match(text, at).end()
    return _gemma_bare(text[at:end].strip()), end


def _gemma_bare(word: str) -> Any:
    if word in ("true", "false"):
        return word == "true"
    if word.lower() in ("null", "none", "nil"):
        return None
    try:
        number = float(word) if "." in word else int(word)
    except ValueError:
        return word
    return number if math.isfinite(number) else word


_GEMMA_GAP, _GEMMA_BLANK, _GEMMA_BARE = re.compile(r"[ ,\n\t]*"), re.compile(r"[ \n\t]*"), re.compile(r"[^,}\]]*")
_TOO_DEEP = object()


def dsml_arguments(arguments: str, schema: dict | None) -> str:
    """dsml_calls' arguments as vLLM gives them: a `string="true"` value as its text; another typed by its property
    in the tool's schema (typed_arguments' rules), or read as JSON where the property has types but none fits (text
    where it has none); a lone `arguments` or `input` object the schema does not name unwrapped."""
    properties = _properties(schema)
    typed = {key: text if string else _dsml_typed(text, properties.get(key))
             for key, (text, string) in json.loads(arguments).items()}
    return json.dumps(_unwrapped(typed, properties))


def _dsml_typed(text: str, schema: Any) -> Any:
    value, kinds = _typed(text, schema), _kinds(schema)
    if value is not text or not kinds or "string" in kinds:
        return value
    read = _json(text)
    return text if read is None and text.strip() != "null" else read


def _unwrapped(values: dict, properties: dict) -> dict:
    """A model's `{"arguments": {...}}` (or `input`) around the schema's own properties taken off, as vLLM repairs it."""
    for wrapper in ("arguments", "input"):
        inner = values.get(wrapper)
        inner = _json(inner) if isinstance(inner, str) else inner
        if list(values) == [wrapper] and wrapper not in properties and isinstance(inner, dict) and \
                set(inner) <= set(properties):
            return inner
    return values


def openai_calls(text: str) -> Found | None:
    """gpt-oss's calls: its harmony messages to `functions.NAME`, whose bodies are the arguments (JSON, written
    back as json.dumps writes it; a body that is not a JSON object as it is, a call cut short too); the other
    messages' bodies and the text outside any message are the content."""
    found = harmony.messages(text, opened=False)      # the reasoning parser's content: headers at <|start|> only
    calls = [(m.call, _openai_arguments(m.body(text))) for m in found if m.call]
    return _found("".join(m.body(text) for m in found if not m.call), calls)


def _openai_arguments(body: str) -> str:
    arguments = _json(body.strip())
    return json.dumps(arguments) if isinstance(arguments, dict) else body.strip()


def _trimmed(value: str) -> str:
    """A value as Qwen3-Coder's template writes it, on lines of its own: one line end off each side."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def typed_arguments(arguments: str, schema: dict | None) -> str:
    """Arguments whose values are all text (Qwen3-Coder's), typed by the tool's parameters schema, as vLLM types
    them: each value whose property's type is integer, number, boolean, null, object or array and whose text reads
    as one; anything else, and a property the schema does not list, stays text."""
    properties = _properties(schema)
    return json.dumps({key: _typed(value, properties.get(key)) for key, value in json.loads(arguments).items()})


def _properties(schema: dict | None) -> dict:
    properties = schema.get("properties") if isinstance(schema, dict) else None
    return properties if isinstance(properties, dict) else {}


def _kinds(schema: Any) -> list:
    """A property's JSON Schema types, as a list."""
    kinds = schema.get("type") if isinstance(schema, dict) else None
    return [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else []


def _typed(text: str, schema: Any) -> Any:
    """A value's text as the first of its property's types that it reads as; text where none (a property without a
    type is a string, as vLLM has it)."""
    for kind in _kinds(schema):
        value = _as_kind(text.strip(), kind) if isinstance(kind, str) else _NOT
        if value is not _NOT:
            return value
    return text


_NOT = object()      # _as_kind's "the text is not one"
_FITS = {"integer": lambda value: type(value) is int, "number": lambda value: type(value) in (int, float),
         "object": lambda value: isinstance(value, dict), "array": lambda value: isinstance(value, list)}


def _as_kind(text: str, kind: str) -> Any:
    """The value of JSON Schema type `kind` that `text` reads as (JSON; for an object or an array, a Python
    literal too; booleans and null in any case), or _NOT."""
    if kind in ("boolean", "null"):
        words = {"true": True, "false": False} if kind == "boolean" else {"null": None, "none": None}
        return words.get(text.lower(), _NOT)
    if kind not in _FITS:
        return _NOT
    value = _json(text) if text != "null" else _NOT
    if value is None and kind in ("object", "array"):
        try:
            value = _literal(ast.parse(text, mode="eval").body)
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return _NOT
    return value if value is not _NOT and _FITS[kind](value) else _NOT


def held_from_opening(*openings: str) -> Callable[[str], int]:
    """For calls after text: a stream stops sending content at the start of the first of `openings`, or of a tail
    that may begin one."""
    def held_from(text: str) -> int:
        starts = [at for at in map(text.find, openings) if at >= 0]
        if starts:
            return min(starts)
        tails = [n for opening in openings for n in range(1, len(opening)) if text.endswith(opening[:n])]
        return len(text) - max(tails, default=0)
    return held_from


hermes_held_from = held_from_opening("<tool_call>")


def whole_output_held_from(*openings: str) -> Callable[[str], int]:
    """For calls that are the whole output (Llama 3's, Mistral's): hold it while it is blank or may still begin
    with one of `openings`."""
    def held_from(text: str) -> int:
        body = text.lstrip()
        if not body or any(body.startswith(opening) or opening.startswith(body) for opening in openings):
            return 0
        return len(text)
    return held_from


def mistral_call_id() -> str:
    """Mistral's chat templates take back only call ids of 9 letters and digits."""
    return uuid.uuid4().hex[:9]


@dataclass(frozen=True)
class Parser:
    calls: Callable[[str], Found | None]       # output text -> (its text outside the calls, the calls), or None
    held_from: Callable[[str], int]            # streamed text -> where content must stop for now
    new_id: Callable[[], str] = new_call_id    # the ids of calls, as the model's template takes them back
    typed: Callable[[str, dict | None], str] | None = None   # (arguments, the tool's parameters schema) -> the
                                                             # arguments typed (its calls' values are text)
    ids: Callable[[str], list[str]] | None = None     # output text -> the ids it writes for its calls (None: new ones)
    special: bool = False                      # its markers are special tokens: the request's text keeps them
    numbered: bool = False                     # named and "required" calls get Kimi K2's ids (kimi_call_id)


PARSERS = {"hermes": Parser(hermes_calls, hermes_held_from),
           "llama3_json": Parser(llama3_json_calls, whole_output_held_from("{", "<|python_tag|>")),
           "mistral": Parser(mistral_calls, whole_output_held_from("[", "[TOOL_CALLS]"), mistral_call_id),
           "pythonic": Parser(pythonic_calls, whole_output_held_from("[", "<|python_start|>")),
           "qwen3_coder": Parser(qwen3_coder_calls, hermes_held_from, typed=typed_arguments),
           "seed_oss": Parser(functools.partial(qwen3_coder_calls, tag="seed:tool_call"),
                              held_from_opening("<seed:tool_call>"), typed=typed_arguments),
           "deepseek_v31": Parser(deepseek_calls, held_from_opening(DS_CALLS)),
           "deepseek_v3": Parser(functools.partial(deepseek_calls, v3=True), held_from_opening(DS_CALLS)),
           "deepseek_v32": Parser(functools.partial(dsml_calls, wrapper="function_calls"),
                                  held_from_opening(f"<{DSML}function_calls>"), typed=dsml_arguments, special=True),
           "deepseek_v4": Parser(functools.partial(dsml_calls, wrapper="tool_calls"),
                                 held_from_opening(f"<{DSML}tool_calls>"), typed=dsml_arguments, special=True),
           "gemma4": Parser(gemma4_calls, held_from_opening(GEMMA_CALL), special=True),
           "glm45": Parser(glm45_calls, hermes_held_from, typed=typed_arguments),
           "minimax_m2": Parser(minimax_m2_calls, held_from_opening("<minimax:tool_call>"), typed=typed_arguments),
           "kimi_k2": Parser(kimi_k2_calls, held_from_opening(*KIMI_SECTIONS), ids=kimi_k2_ids, special=True,
                             numbered=True),
           "openai": Parser(openai_calls, held_from_opening(harmony.START))}


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools ask of its output (ChatRequest.tool_plan builds it, checked)."""
    tools: tuple = ()                      # Tool, in the request's order
    choice: str = "none"                   # none | auto | required | named
    named: str = ""                        # the function of a named tool_choice
    parser: Parser | None = None           # auto's
    single: bool = False                   # parallel_tool_calls false: "required" asks for one call, and "auto"
                                           # keeps the first of several (as vLLM)
    earlier_calls: int = 0                 # the tool calls of the conversation's assistant messages
    id_source: Callable[[], str] | None = None     # where new call ids come from (None: the parser's; tests set it)

    def template_tools(self) -> list[dict] | None:
        """The tools as a chat template takes them (transformers' `tools`), or None without any."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools] or None

    def schema(self) -> dict | None:
        """The JSON Schema the output follows, or None for free text."""
        parameters = {tool.function.name: tool.function.parameters or NO_PARAMETERS for tool in self.tools}
        if self.choice == "named":
            return {"x-guidance": AS_DUMPED, **parameters[self.named]}
        if self.choice != "required":
            return None
        hoisted = {name: _hoisted(name, schema) for name, schema in parameters.items()}
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, (schema, _) in hoisted.items()]
        defs = {key: value for _, moved in hoisted.values() for key, value in moved.items()}
        return {"type": "array", "minItems": 1, **({"maxItems": 1} if self.single else {}),
                "items": {"anyOf": calls}, "x-guidance": AS_DUMPED, **({"$defs": defs} if defs else {})}

    def prepare(self, generate: generation_pb2.GenerateRequest) -> None:
        """The request as the tools ask it: a named or "required" call's structure; the special tokens kept in the
        text where the parser's markers are special tokens (Kimi K2's, as vLLM keeps them for its parser)."""
        schema = self.schema()
        if schema is not None:
            generate.structured_output.json_schema = json.dumps(schema)
        if self.calls_read and self.parser.special:
            generate.keep_special_tokens = True

    def calls(self, text: str) -> Found | None:
        """(the text outside the calls, the calls) the output holds, or None: no calls, the text is content. Free
        text's calls count only if each names one of the tools."""
        if self.choice == "named":                  # none where the output had none (cut while reasoning)
            return ("", [(self.named, text)]) if text else None
        if self.choice == "required":
            called = _json(text)
            if not isinstance(called, list):                    # cut short by max_tokens: returned as content
                return None
            return "", [(call["name"], json.dumps(call["parameters"])) for call in called]
        found = self.parser.calls(text) if self.calls_read else None
        schemas = {tool.function.name: tool.function.parameters for tool in self.tools}
        if not found or not all(name in schemas for name, _ in found[1]):
            return None
        calls = found[1][:1] if self.single else found[1]       # parallel_tool_calls false: the first, as vLLM
        if self.parser.typed:
            calls = [(name, self.parser.typed(arguments, schemas[name])) for name, arguments in calls]
        return found[0], calls

    @property
    def calls_read(self) -> bool:
        """Whether free text is read for calls (`auto`, with a parser)."""
        return self.choice == "auto" and self.parser is not None

    def call_ids(self, text: str, calls: list[Call]) -> list[str]:
        """The ids of `calls`, read from the output `text`: those the model wrote itself where its parser reads
        them (Kimi K2's auto calls); Kimi K2's numbering for the calls it was made to write (named, "required"), as
        vLLM gives them; else new ones, as the model's template takes them back."""
        if self.calls_read and self.parser.ids is not None:
            return self.parser.ids(text)
        if self.parser is not None and self.parser.numbered:
            return [kimi_call_id(name, self.earlier_calls + i) for i, (name, _) in enumerate(calls)]
        return [self.new_id() for _ in calls]

    @property
    def new_id(self) -> Callable[[], str]:
        return self.id_source or (self.parser.new_id if self.parser else new_call_id)


def _hoisted(name: str, schema: dict) -> tuple[dict, dict]:
    """A tool's parameters schema placed inside the "required" array's schema: its `$defs` (or `definitions`, as
    pydantic writes nested models) moved to that schema's root as `<name>__<def>`, the `$ref`s to them rewritten;
    (the schema, the $defs it moved)."""
    def moved(node: Any) -> Any:
        if isinstance(node, list):
            return [moved(value) for value in node]
        if not isinstance(node, dict):
            return node
        return {key: _renamed(value, name) if key == "$ref" and isinstance(value, str) else moved(value)
                for key, value in node.items()}
    defs = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    body = {key: value for key, value in schema.items() if key not in ("$defs", "definitions")}
    return moved(body), {f"{name}__{key}": moved(value) for key, value in defs.items()}


def _renamed(ref: str, name: str) -> str:
    for prefix in ("#/$defs/", "#/definitions/"):
        if ref.startswith(prefix):
            return f"#/$defs/{name}__{ref.removeprefix(prefix)}"
    return ref


def calls_message(calls: list[Call], ids: list[str], delta: bool = False) -> list[dict]:
    """OpenAI's `tool_calls` (a stream's delta ones carry their index)."""
    return [{**({"index": i} if delta else {}), "id": call_id, "type": "function",
             "function": {"name": name, "arguments": arguments}}
            for i, ((name, arguments), call_id) in enumerate(zip(calls, ids))]


def finish_with_calls(plan: ToolPlan, finish_reason: str | None) -> str | None:
    """A named call ends as the generation did (OpenAI's `stop`); other calls with `tool_calls`."""
    return finish_reason if plan.choice == "named" or finish_reason == "length" else "tool_calls"


def message(plan: ToolPlan, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
    """The assistant message of a whole output, and its finish reason."""
    found = plan.calls(text)
    if not found:
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = found
    return ({"role": "assistant", "content": content if content.strip() else None,
             "tool_calls": calls_message(calls, plan.call_ids(text, calls))}, finish_with_calls(plan, finish_reason))


def merged(delta: dict, last: dict) -> dict:
    """Two deltas of one chunk as one: their content joined, the tool calls of whichever has them."""
    content = delta.get("content", "") + last.get("content", "")
    return {**delta, **last, **({"content": content} if content else {})}


@dataclass
class ToolStream:
    """One choice's stream: content deltas as they come, up to where calls may start; the calls at the end (a
    named function's arguments as they come)."""
    plan: ToolPlan
    text: str = ""
    sent: int = 0                          # characters of text sent as content
    opened: bool = False                   # named: the call's first delta (id, name) has gone

    def feed(self, piece: str) -> dict:
        """The delta for a piece of output."""
        self.text += piece
        if self.plan.choice == "named":
            return self._arguments(piece)
        if self.plan.choice == "required":                  # a JSON array: read once it is whole
            return {}
        held = self.plan.parser.held_from(self.text) if self.plan.calls_read else len(self.text)
        return self._content(self.text[:held])

    def finish(self, finish_reason: str | None) -> tuple[dict, str | None]:
        """The last delta (what was held) and the finish reason."""
        if self.plan.choice == "named":
            return {}, finish_reason
        found = self.plan.calls(self.text)
        if not found:
            return self._content(self.text), finish_reason
        content, calls = found                  # starts with the text sent: calls are held from their start
        delta = self._content(content)
        return {**delta, "tool_calls": calls_message(calls, self.plan.call_ids(self.text, calls), delta=True)}, \
            finish_with_calls(self.plan, finish_reason)

    def _content(self, upto: str) -> dict:
        """A delta of the content `upto` holds past what was sent."""
        piece, self.sent = upto[self.sent:], max(self.sent, len(upto))
        return {"content": piece} if piece else {}

    def _arguments(self, piece: str) -> dict:
        if not piece:                   # the call opens with its first text (none while the model reasons)
            return {}
        call = {"index": 0, "function": {"arguments": piece}}
        if not self.opened:
            self.opened = True
            call = {"index": 0, "id": self.plan.call_ids("", [(self.plan.named, "")])[0], "type": "function",
                    "function": {"name": self.plan.named, "arguments": piece}}
        return {"tool_calls": [call]}
