"""OpenAI's deprecated function calling in chat completions (`functions`, `function_call`, an assistant's
`function_call` and `function` messages), served as the tools request it stands for (openai_api/tools.py), with
at most one call, as the deprecated API makes; the answer goes back in the deprecated form (`message.function_call`,
finish reason `function_call`).

    {"functions": [{"name": "get_weather", "parameters": {...}}], "function_call": {"name": "get_weather"}}
"""
from __future__ import annotations

from openai_api.protocol import ApiError, ChatRequest, Message
from openai_api.tools import PARSERS, FunctionName, NamedToolChoice, Parser, Tool, ToolCall, ToolPlan


def as_tools(body: ChatRequest, parser: Parser | None) -> tuple[ChatRequest, bool]:
    """The tools request `body` stands for, and whether it asked in the deprecated form (`functions`). An earlier
    turn's `function_call` and `function` messages become tool calls and tool messages in any request."""
    messages = conversation(body.messages)
    if not body.functions:
        if body.function_call not in (None, "none"):
            raise ApiError(400, "function_call: only allowed when `functions` are given", "function_call")
        return body.model_copy(update={"messages": messages}), False
    if body.tools is not None or body.tool_choice is not None:
        given = "tools" if body.tools is not None else "tool_choice"
        raise ApiError(400, f"functions: send `tools` and `tool_choice` or the deprecated `functions` and "
                       f"`function_call`, not both (`{given}` is there too)", "functions")
    choice = body.function_call or "auto"
    if choice == "auto" and parser is None:
        raise ApiError(400, 'function_call: "auto" (the default with `functions`) needs a tool-call parser: set '
                       f'http.tool_call_parser (one of {", ".join(PARSERS)}), or name a function', "function_call")
    named = NamedToolChoice(type="function", function=FunctionName(name=choice.name)) \
        if isinstance(choice, FunctionName) else choice
    tools = [Tool(type="function", function=function) for function in body.functions]
    return body.model_copy(update={"messages": messages, "tools": tools, "tool_choice": named,
                                   "parallel_tool_calls": False}), True


def conversation(messages: list[Message]) -> list[Message]:
    """The messages with an assistant's `function_call` as a tool call (after any it has), and a `function`
    message as the tool message that answers the call before it (ids `fn<message index, 7 digits>`: 9 letters and
    digits, as Mistral's templates take them, unlike a client's `call_` ids)."""
    out, last = [], ""
    for index, message in enumerate(messages):
        if message.function_call is not None:
            last = f"fn{index:07d}"
            calls = [*(message.tool_calls or []), ToolCall(id=last, function=message.function_call)]
            message = message.model_copy(update={"tool_calls": calls, "function_call": None})
        elif message.role == "function":
            message = message.model_copy(update={"role": "tool", "tool_call_id": last or None})
        out.append(message)
    return out


def deprecated_plan(body: ChatRequest, parser: Parser | None, deprecated: bool) -> ToolPlan:
    """body.tool_plan, its refusals naming what a deprecated request sent (`functions`, `function_call`)."""
    try:
        return body.tool_plan(parser)
    except ApiError as error:
        if not deprecated or error.param not in SENT_AS:
            raise
        param, message = SENT_AS[error.param], str(error).removeprefix(f"{error.param}:")
        message = message.replace("`tools`", "`functions`").replace("`tool_choice`", "`function_call`")
        raise ApiError(error.status, f"{param}:{message}", param) from None


SENT_AS = {"tools": "functions", "tool_choice": "function_call"}


def deprecated_message(message: dict, finish_reason: str | None) -> tuple[dict, str | None]:
    """An answer's message (or a stream's delta) with its tool call as `function_call`, as the deprecated API
    answers (no id or index), and `tool_calls`' finish reason as `function_call`."""
    calls = message.get("tool_calls")
    if calls:
        function = calls[0]["function"]
        message = {**{key: value for key, value in message.items() if key != "tool_calls"},
                   "function_call": {key: function[key] for key in ("name", "arguments") if key in function}}
    return message, "function_call" if finish_reason == "tool_calls" else finish_reason
