"""Tool calling in chat completions: OpenAI's `tools` and `tool_choice`, and the assistant's `tool_calls`.

The tools reach the model through its chat template (`tools`, as transformers passes them). What the output is:
- `tool_choice` naming a function: its arguments, as JSON its `parameters` schema accepts (structured output, so
  exact under speculation); the answer is one call of it.
- `"required"`: a JSON array of one or more `{"name": ..., "parameters": {...}}`, each a tool's name and arguments
  (as vLLM constrains it); the answer is those calls.
- `"auto"` (the default when there are tools): free text, which the configured parser (`http.tool_call_parser`)
  reads calls out of: `hermes` (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`: Qwen 2.5 / 3, Hermes) or
  `llama3_json` (the output a JSON object `{"name": ..., "parameters": ...}`, or several joined by `;`) or
  `mistral` (the output a JSON array of `{"name": ..., "arguments": ...}`, after `[TOOL_CALLS]`).
- `"none"`: free text, no calls read.

    {"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
      "properties": {"city": {"type": "string"}}, "required": ["city"]}}}], "tool_choice": "required"}
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError

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


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _json_object_text(text: str) -> str:
    if not isinstance(_json(text), dict):
        raise PydanticCustomError("json_object", "must be a JSON object's text (the call's arguments)")
    return text


class CalledFunction(BaseModel):
    name: str = Field(strict=True)
    arguments: Annotated[str, Field(strict=True), AfterValidator(_json_object_text)]    # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    """An assistant message's earlier call, as a client sends the conversation back."""
    id: str = Field(strict=True)
    type: Literal["function"] = "function"
    function: CalledFunction


Call = tuple[str, str]          # (function name, arguments as JSON text)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call(text: str, *argument_keys: str) -> Call | None:
    """The call a JSON object `{"name": ..., <an argument key>: {...}}` makes, or None if it is not one."""
    call = _json(text.strip())
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = next((call[key] for key in argument_keys if key in call), {})
    return (call["name"], json.dumps(arguments)) if isinstance(arguments, dict) else None


def _all(calls: list[Call | None], start: int) -> tuple[int, list[Call]] | None:
    return None if None in calls else (start, calls)


def hermes_calls(text: str) -> tuple[int, list[Call]] | None:
    """Where the calls start and the calls of `<tool_call>{...}</tool_call>` blocks (the last may be unclosed, as
    a model that stops at EOS leaves it); None where there is none or one is not a call."""
    start = text.find("<tool_call>")
    if start < 0:
        return None
    blocks = re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text[start:], re.DOTALL)
    return _all([_call(block, "arguments") for block in blocks], start)


def llama3_json_calls(text: str) -> tuple[int, list[Call]] | None:
    """Llama 3.x's JSON calls: the output (after `<|python_tag|>`, if any) one `{"name", "parameters"}` object or
    several joined by `;`; None where it is not."""
    start = len(text) - len(text.lstrip())
    body = text[start:].removeprefix("<|python_tag|>")
    if not body.startswith("{"):
        return None
    return _all([_call(part, "parameters", "arguments") for part in body.split(";")], start)


def mistral_calls(text: str) -> tuple[int, list[Call]] | None:
    """Mistral's calls: the output (after `[TOOL_CALLS]`, a special token the text usually drops) a JSON array of
    `{"name", "arguments"}` objects; None where it is not."""
    start = len(text) - len(text.lstrip())
    called = _json(text[start:].removeprefix("[TOOL_CALLS]"))
    if not isinstance(called, list) or not called:
        return None
    return _all([_call(json.dumps(call), "arguments") for call in called], start)


def hermes_held_from(text: str) -> int:
    """Where a stream must stop sending content: the start of `<tool_call>`, or of a tail that may begin one."""
    start = text.find("<tool_call>")
    if start >= 0:
        return start
    tails = [n for n in range(1, len("<tool_call>")) if text.endswith("<tool_call>"[:n])]
    return len(text) - max(tails, default=0)


def whole_output_held_from(*openings: str) -> Callable[[str], int]:
    """For calls that are the whole output (Llama 3's, Mistral's): hold it while it is blank or may still begin
    with one of `openings`."""
    def held_from(text: str) -> int:
        body = text.lstrip()
        if not body or any(body.startswith(opening) or opening.startswith(body) for opening in openings):
            return 0
        return len(text)
    return held_from


@dataclass(frozen=True)
class Parser:
    calls: Callable[[str], tuple[int, list[Call]] | None]      # text -> (where the calls start, calls) or None
    held_from: Callable[[str], int]                            # streamed text -> where content must stop for now


PARSERS = {"hermes": Parser(hermes_calls, hermes_held_from),
           "llama3_json": Parser(llama3_json_calls, whole_output_held_from("{", "<|python_tag|>")),
           "mistral": Parser(mistral_calls, whole_output_held_from("[", "[TOOL_CALLS]"))}


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools ask of its output (ChatRequest.tool_plan builds it, checked)."""
    tools: tuple = ()                      # Tool, in the request's order
    choice: str = "none"                   # none | auto | required | named
    named: str = ""                        # the function of a named tool_choice
    parser: Parser | None = None           # auto's
    single: bool = False                   # parallel_tool_calls false: "required" asks for one call

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
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, schema in parameters.items()]
        return {"type": "array", "minItems": 1, **({"maxItems": 1} if self.single else {}),
                "items": {"anyOf": calls}, "x-guidance": AS_DUMPED}

    def structured_output(self) -> generation_pb2.StructuredOutput | None:
        schema = self.schema()
        return None if schema is None else generation_pb2.StructuredOutput(json_schema=json.dumps(schema))

    def calls(self, text: str) -> tuple[int, list[Call]] | None:
        """(where the calls start, the calls) the output holds, or None: no calls, the text is content."""
        if self.choice == "named":
            return 0, [(self.named, text)]
        if self.choice == "required":
            called = _json(text)
            if not isinstance(called, list):                    # cut short by max_tokens: returned as content
                return None
            return 0, [(call["name"], json.dumps(call["parameters"])) for call in called]
        return self.parser.calls(text) if self.calls_read else None

    @property
    def calls_read(self) -> bool:
        """Whether free text is read for calls (`auto`, with a parser)."""
        return self.choice == "auto" and self.parser is not None


def calls_message(calls: list[Call], new_id: Callable[[], str], delta: bool = False) -> list[dict]:
    """OpenAI's `tool_calls` (a stream's delta ones carry their index)."""
    return [{**({"index": i} if delta else {}), "id": new_id(), "type": "function",
             "function": {"name": name, "arguments": arguments}} for i, (name, arguments) in enumerate(calls)]


def finish_with_calls(plan: ToolPlan, finish_reason: str | None) -> str | None:
    """A named call ends as the generation did (OpenAI's `stop`); other calls with `tool_calls`."""
    return finish_reason if plan.choice == "named" or finish_reason == "length" else "tool_calls"


def message(plan: ToolPlan, text: str, finish_reason: str | None,
            new_id: Callable[[], str] = new_call_id) -> tuple[dict, str | None]:
    """The assistant message of a whole output, and its finish reason."""
    found = plan.calls(text)
    if not found:
        return {"role": "assistant", "content": text}, finish_reason
    start, calls = found
    content = text[:start].strip() or None
    return ({"role": "assistant", "content": content, "tool_calls": calls_message(calls, new_id)},
            finish_with_calls(plan, finish_reason))


def merged(delta: dict, last: dict) -> dict:
    """Two deltas of one chunk as one: their content joined, the tool calls of whichever has them."""
    content = delta.get("content", "") + last.get("content", "")
    return {**delta, **last, **({"content": content} if content else {})}


@dataclass
class ToolStream:
    """One choice's stream: content deltas as they come, up to where calls may start; the calls at the end (a
    named function's arguments as they come)."""
    plan: ToolPlan
    new_id: Callable[[], str] = new_call_id
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
        return self._content(self.plan.parser.held_from(self.text) if self.plan.calls_read else len(self.text))

    def finish(self, finish_reason: str | None) -> tuple[dict, str | None]:
        """The last delta (what was held) and the finish reason."""
        if self.plan.choice == "named":
            return {}, finish_reason
        found = self.plan.calls(self.text)
        if not found:
            return self._content(len(self.text)), finish_reason
        start, calls = found
        delta = self._content(start) if self.text[self.sent:start].strip() else {}
        return {**delta, "tool_calls": calls_message(calls, self.new_id, delta=True)}, \
            finish_with_calls(self.plan, finish_reason)

    def _content(self, upto: int) -> dict:
        piece, self.sent = self.text[self.sent:upto], max(self.sent, upto)
        return {"content": piece} if piece else {}

    def _arguments(self, piece: str) -> dict:
        if not piece and self.opened:
            return {}
        call = {"index": 0, "function": {"arguments": piece}}
        if not self.opened:
            self.opened = True
            call = {"index": 0, "id": self.new_id(), "type": "function",
                    "function": {"name": self.plan.named, "arguments": piece}}
        return {"tool_calls": [call]}
