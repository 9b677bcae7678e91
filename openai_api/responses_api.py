"""OpenAI's Responses API (POST /v1/responses), served as the chat completion it stands for: its request becomes a
ChatRequest (`instructions` the system message, `input` items the messages, flat function tools chat tools,
`text.format` a response_format), which runs through the same chat template, tool calling, structured output and
router as /v1/chat/completions; the answer comes back as a Response object (its output items: the message, then
any function calls), or streamed as the Responses API's typed events. Stored responses (openai_api/response_store.py)
are continued by `previous_response_id`: their conversation's items, then the new input.

    curl localhost:8000/v1/responses -H 'Content-Type: application/json' \\
         -d '{"model": "target", "input": "def fib(n):", "max_output_tokens": 32}'
"""
from __future__ import annotations

import json
import re
import time
import uuid
from typing import Annotated, Any, Callable, Literal, Optional, Union

from pydantic import AfterValidator, ConfigDict, Discriminator, Field, Tag, create_model, model_validator
from pydantic_core import PydanticCustomError

from openai_api.choices import FINISH, ChatCompletions, spec_stats
from openai_api.protocol import (DEFAULT_CHAT_MAX_TOKENS, ApiError, Body, ChatRequest, Flag, MaxTokens, Message,
                                 Effort, SamplingBody, TemplateOptions, Text, TopLogprobs, neutral_only, one_of)
from openai_api.structured import JsonSchema, ResponseFormat, SchemaSpec
from openai_api.tools import CalledFunction, Function, FunctionName, NamedToolChoice, Tool, ToolCall, string_or_named


class InputText(Body):
    """A content part of an input item: text (`output_text` in an earlier answer sent back)."""
    type: Literal["input_text", "output_text"]
    text: Text


Parts = one_of("a string or a list of content parts", Text, list[InputText], list[InputText])


def text_of(parts: str | list[InputText]) -> str:
    return parts if isinstance(parts, str) else "".join(part.text for part in parts)


class InputMessage(Body):
    type: Literal["message"] = "message"
    id: Optional[Text] = None       # its id in an earlier answer's output, or the one it is given when stored
    role: Literal["user", "assistant", "system", "developer"]
    content: Parts


class FunctionCallItem(Body):
    """An earlier answer's function call, sent back with its output."""
    type: Literal["function_call"]
    id: Optional[Text] = None
    call_id: Text
    name: Text
    arguments: Text


class FunctionCallOutput(Body):
    type: Literal["function_call_output"]
    id: Optional[Text] = None
    call_id: Text
    output: Parts


class ReasoningText(Body):
    type: Literal["reasoning_text"]
    text: Text


class ReasoningItem(Body):
    """An earlier answer's reasoning, sent back (its text reaches the chat template with the assistant message
    after it, as reasoning_content)."""
    type: Literal["reasoning"]
    id: Optional[Text] = None
    summary: list[Any]
    content: Optional[list[ReasoningText]] = None
    encrypted_content: Optional[Text] = None

    def text(self) -> str:
        return "".join(part.text for part in self.content or [])


# An input item's kind (its `type`, "message" when left out) -> its tag, which an error's location carries (a space:
# protocol.one_of's rule, so that the path named is `input[2].call_id`)
ITEMS = {"message": "a message", "function_call": "a function call", "function_call_output": "a call's output",
         "reasoning": "a reasoning item"}


def _item(value: Any) -> str | None:
    """The tag of an item: a JSON object's by its `type` (left out or null: a message), a built item's by its own."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return ITEMS.get(kind or "message") if isinstance(kind, (str, type(None))) else None


Item = Annotated[Union[Annotated[InputMessage, Tag(ITEMS["message"])],
                       Annotated[FunctionCallItem, Tag(ITEMS["function_call"])],
                       Annotated[FunctionCallOutput, Tag(ITEMS["function_call_output"])],
                       Annotated[ReasoningItem, Tag(ITEMS["reasoning"])]],
                 Discriminator(_item, custom_error_type="item", custom_error_message=(
                     "must be a message, function_call, function_call_output or reasoning item (specpool serves text "
                     "and function tools, and keeps no stored items)"))]
Items = Annotated[list[Item], Field(min_length=1)]
Input = one_of("a string or a list of input items", Text, Items, Items)


class FunctionTool(Function):
    """A function tool, flat as the Responses API has it ({"type": "function", "name": ..., "parameters": ...})."""
    type: Literal["function"]

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") != "function":
            raise PydanticCustomError("tool_type", "only function tools are served (got type {type})",
                                      {"type": json.dumps(data.get("type"))})
        return data

    def as_chat(self) -> Tool:
        return Tool(type="function", function=Function(**self.model_dump(exclude={"type"})))


class FunctionChoice(Body):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: Text

    @model_validator(mode="before")
    @classmethod
    def _flat(cls, data: Any) -> Any:
        if isinstance(data, dict) and "function" in data:
            raise PydanticCustomError("flat", 'the Responses API names the function flat: {"type": "function", '
                                      '"name": ...}')
        return data


ToolChoice = string_or_named(Literal["none", "auto", "required"], FunctionChoice,
                             '"none", "auto", "required" or {"type": "function", "name": ...}')


class TextFormat(Body):
    """text.format: free text, any JSON object, or JSON under a schema (response_format's three)."""
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[Text] = None
    description: Optional[Text] = None
    schema_: Optional[JsonSchema] = Field(None, alias="schema")
    strict: Optional[Flag] = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "TextFormat":
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError('`name` and `schema` are required when `type` is "json_schema"')
        return self

    def response_format(self) -> ResponseFormat:
        spec = SchemaSpec(name=self.name, description=self.description, schema=self.schema_, strict=self.strict) \
            if self.type == "json_schema" else None
        return ResponseFormat(type=self.type, json_schema=spec)


def _medium(value: Any) -> Any:
    if value != "medium":
        raise PydanticCustomError("unsupported", 'not supported by specpool (only "medium")')
    return value


class TextConfig(Body):
    format: Optional[TextFormat] = None
    verbosity: Annotated[Any, AfterValidator(_medium)] = "medium"


def _elsewhere(hint: str) -> AfterValidator:
    """A parameter of chat completions that the Responses API does not take (`hint`: what to do instead)."""
    def check(value: Any) -> Any:
        if value is not None:
            raise PydanticCustomError("elsewhere", "not a Responses API parameter: {hint}", {"hint": hint})
        return value
    return AfterValidator(check)


LOGPROBS = "message.output_text.logprobs"     # the one `include` that changes an answer here
Includable = Literal["message.output_text.logprobs", "reasoning.encrypted_content", "file_search_call.results",
                     "web_search_call.results", "web_search_call.action.sources", "message.input_image.image_url",
                     "computer_call_output.output.image_url", "code_interpreter_call.outputs"]


def _no_summary(value: Any) -> Any:
    if value is not None:
        raise PydanticCustomError("unsupported", "not supported by specpool (only null: it sends the reasoning "
                                  "itself, as reasoning_text)")
    return value


class ReasoningOptions(Body):
    """`reasoning`: the effort, as chat's reasoning_effort (for a chat template that reads it: gpt-oss's); no
    summaries (specpool answers the reasoning itself, as reasoning_text)."""
    model_config = ConfigDict(extra="forbid")
    effort: Effort = None
    summary: Annotated[Any, AfterValidator(_no_summary)] = None
    generate_summary: Annotated[Any, AfterValidator(_no_summary)] = None      # summary's deprecated name


class ResponsesFields(SamplingBody, TemplateOptions):
    """The Responses API's parameters specpool serves (and the sampling extensions chat takes, vLLM's too)."""
    input: Input
    reasoning: Optional[ReasoningOptions] = None
    reasoning_effort: Annotated[Any, _elsewhere("send `reasoning.effort`")] = None       # chat's name
    instructions: Optional[Text] = None
    max_output_tokens: MaxTokens = None
    include: Optional[list[Includable]] = None
    top_logprobs: TopLogprobs = None
    tools: Optional[list[FunctionTool]] = None
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: Flag = True
    text: Optional[TextConfig] = None
    store: Flag = True                               # kept for previous_response_id, if http.store_responses
    background: Flag = False                         # run on after the POST's answer (openai_api/background.py)
    metadata: Optional[dict[str, Text]] = None
    previous_response_id: Optional[Text] = None
    max_tokens: Annotated[Any, _elsewhere("send `max_output_tokens`")] = None
    max_completion_tokens: Annotated[Any, _elsewhere("send `max_output_tokens`")] = None
    messages: Annotated[Any, _elsewhere("send `input`")] = None
    logprobs: Annotated[Any, _elsewhere('send `include: ["message.output_text.logprobs"]`')] = None
    response_format: Annotated[Any, _elsewhere("send `text.format`")] = None
    prompt_logprobs: Annotated[Any, _elsewhere("chat completions and completions serve it")] = None


# The Responses API's parameters that would change the output and that specpool lacks -> the neutral value:
# truncation of the conversation, a stored prompt template or conversation; and chat's
# n, a Response having one output
RESPONSES_REFUSED = {"truncation": "disabled", "prompt": None, "conversation": None, "n": 1}
ResponsesRequest = create_model("ResponsesRequest", __base__=ResponsesFields, __module__=__name__,
                                **neutral_only(RESPONSES_REFUSED, {"n": 1}))
# The chat request's fields a Responses request sends as they are (not those it sends otherwise, nor n)
SHARED = (set(SamplingBody.model_fields) | set(TemplateOptions.model_fields)) - set(ResponsesFields.__annotations__) \
    - set(RESPONSES_REFUSED)


def chat_request(body: ResponsesFields, items: list) -> ChatRequest:
    """The chat completion a Responses request stands for, its conversation `items` (input_items, after those of
    the response it continues), its fields already validated as the chat's are."""
    logprobs = LOGPROBS in (body.include or ()) or bool(body.top_logprobs)
    choice = body.tool_choice
    if isinstance(choice, FunctionChoice):
        choice = NamedToolChoice(type="function", function=FunctionName(name=choice.name))
    return ChatRequest.model_construct(
        **{name: getattr(body, name) for name in SHARED}, messages=messages(body.instructions, items),
        max_completion_tokens=body.max_output_tokens, logprobs=logprobs,
        top_logprobs=body.top_logprobs if logprobs else None, tool_choice=choice,
        tools=None if body.tools is None else [tool.as_chat() for tool in body.tools],
        parallel_tool_calls=body.parallel_tool_calls, reasoning_effort=body.reasoning and body.reasoning.effort,
        response_format=body.text.format.response_format() if body.text and body.text.format else None)


def input_items(body: ResponsesFields) -> list:
    """The request's input as items (a string: the user's message)."""
    return [InputMessage(role="user", content=body.input)] if isinstance(body.input, str) else list(body.input)


def without_logprobs(response: dict) -> dict:
    """The Response with no logprobs in its output text (as a stored one is kept: their alternatives would cost
    ~8 KB a token)."""
    output = [{**item, "content": [{**part, "logprobs": []} if part["type"] == "output_text" else part
                                   for part in item["content"]]} if "content" in item else item
              for item in response["output"]]
    return {**response, "output": output}


def as_input(output: list[dict]) -> list:
    """A response's output items as the input items that send them back (its reasoning, the assistant's message, its
    calls), under their ids."""
    return [InputMessage(id=item["id"], role="assistant", content=item["content"][0]["text"])
            if item["type"] == "message" else
            ReasoningItem(type="reasoning", id=item["id"], summary=[], content=item["content"])
            if item["type"] == "reasoning" else
            FunctionCallItem(type="function_call", id=item["id"], call_id=item["call_id"], name=item["name"],
                             arguments=item["arguments"]) for item in output]


ID_PREFIXES = {InputMessage: "msg", FunctionCallItem: "fc", FunctionCallOutput: "fco", ReasoningItem: "rs"}


def with_ids(items: list) -> list:
    """The items, each with an id (those sent without one are given one), as a stored conversation keeps them."""
    return [item if item.id else item.model_copy(update={"id": new_id(ID_PREFIXES[type(item)])}) for item in items]


def listed(item) -> dict:
    """A stored input item as GET /v1/responses/{id}/input_items lists it (OpenAI's ResponseItem): an assistant's
    message with output_text parts, another's with input_text parts."""
    if isinstance(item, FunctionCallItem):
        return {**item.model_dump(), "status": "completed"}
    if isinstance(item, FunctionCallOutput):
        return {"id": item.id, "type": item.type, "call_id": item.call_id, "output": text_of(item.output),
                "status": "completed"}
    if isinstance(item, ReasoningItem):
        return reasoning_item(item.id, "completed", item.text())
    texts = [item.content] if isinstance(item.content, str) else [part.text for part in item.content]
    parts = [output_text(text, []) for text in texts] if item.role == "assistant" else \
        [{"type": "input_text", "text": text} for text in texts]
    return {"id": item.id, "type": "message", "role": item.role, "content": parts, "status": "completed"}


def page(items: list[dict], order: str, after: str | None, limit: int) -> dict:
    """A page of listed items (OpenAI's list object): in `order`, those after the item `after`, at most `limit`."""
    ordered = items if order == "asc" else items[::-1]
    ids = [item["id"] for item in ordered]
    if after is not None and after not in ids:
        raise ApiError(400, f"after: no input item {after!r} in this response", "after")
    start = ids.index(after) + 1 if after is not None else 0
    data = ordered[start:start + limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": start + limit < len(ordered)}


def continued(stored: list, new: list) -> list:
    """A stored conversation's items (none without previous_response_id), then the new input; a 400 for an item
    sent again (OpenAI's: a duplicate item), which the prompt would otherwise hold twice: a function call the stored
    conversation has, an item id it has or the input has twice (ids name the items listed, input_items)."""
    called = {item.call_id for item in stored if isinstance(item, FunctionCallItem)}
    ids = {item.id for item in stored}
    for index, item in enumerate(new):
        if isinstance(item, FunctionCallItem) and item.call_id in called:
            raise ApiError(400, f"input[{index}]: the call {item.call_id!r} is in the conversation of "
                           "previous_response_id already: send its output only", "input")
        if item.id in ids:
            raise ApiError(400, f"input[{index}]: duplicate item id {item.id!r} (an item the conversation has "
                           "already, or sent twice)", "input")
        ids.add(item.id)
    return stored + new


def text_size(items: list) -> int:
    """Characters of text the items hold."""
    return sum(len(text_of(item.content)) if isinstance(item, InputMessage) else
               len(item.name) + len(item.arguments) if isinstance(item, FunctionCallItem) else
               len(item.text()) if isinstance(item, ReasoningItem) else
               len(text_of(item.output)) for item in items)


def messages(instructions: str | None, items: list) -> list[Message]:
    """`instructions` as the system message, then the items: a function call joins the assistant message before it
    (or makes one), a call's output is the tool message answering it, reasoning goes with the assistant message
    right after it (its reasoning_content; another item after it: dropped)."""
    out = [Message(role="system", content=instructions)] if instructions is not None else []
    reasoning = None
    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning = (reasoning or "") + item.text()
            continue
        if isinstance(item, FunctionCallItem):
            call = ToolCall(id=item.call_id, function=CalledFunction(name=item.name, arguments=item.arguments))
            if out and out[-1].role == "assistant" and reasoning is None:
                out[-1] = out[-1].model_copy(update={"tool_calls": [*(out[-1].tool_calls or []), call]})
            else:
                out.append(Message(role="assistant", tool_calls=[call]))
        elif isinstance(item, FunctionCallOutput):
            out.append(Message(role="tool", tool_call_id=item.call_id, content=text_of(item.output)))
        else:
            out.append(Message(role=item.role, content=text_of(item.content)))
        if out[-1].role == "assistant" and reasoning is not None:
            out[-1] = out[-1].model_copy(update={"reasoning_content": reasoning})
        reasoning = None
    return out


# chat's parameters -> the Responses API's, in the errors the chat pipeline raises
RENAMED = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
           "response_format": "text.format", "reasoning_effort": "reasoning.effort"}


def responses_error(error: ApiError) -> ApiError:
    """A chat pipeline's error as the Responses request sent it: `input` for `messages`, ... in its param and its
    message (not in a dotted name such as `router.max_tokens`, nor inside another word)."""
    param = RENAMED.get(error.param or "", error.param)
    message = re.sub(rf"(?<![\w.])({'|'.join(RENAMED)})\b", lambda found: RENAMED[found[1]], str(error))
    return ApiError(error.status, message, param, error.kind, error.code, error.grpc_code)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_text(text: str, logprobs: list) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def message_item(item_id: str, status: str, content: list) -> dict:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def reasoning_item(item_id: str, status: str, text: str | None) -> dict:
    """A reasoning item, its text in one reasoning_text part (none yet: None)."""
    return {"id": item_id, "type": "reasoning", "status": status, "summary": [],
            "content": [] if text is None else [reasoning_text(text)]}


def reasoning_text(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def call_item(item_id: str, status: str, call: dict) -> dict:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"].get("arguments", "")}


PREDICTION_COUNTS = ("accepted_prediction_tokens", "rejected_prediction_tokens")


def responses_usage(chat: dict) -> dict:
    """A chat answer's usage as a Response counts it; with a prediction (a specpool extension: OpenAI's Responses
    API takes none), its accepted and rejected tokens in `output_tokens_details`, as chat counts them."""
    details = chat.get("completion_tokens_details", {})
    output = {"reasoning_tokens": details.get("reasoning_tokens", 0),
              **{key: details[key] for key in PREDICTION_COUNTS if key in details}}
    return {"input_tokens": chat["prompt_tokens"],
            "input_tokens_details": {**chat["prompt_tokens_details"], "cache_write_tokens": 0},
            "output_tokens": chat["completion_tokens"], "output_tokens_details": output,
            "total_tokens": chat["total_tokens"]}


def echoed(body: ResponsesFields, stored: bool) -> dict:
    """The request's parameters as a Response carries them (`store`: whether it is stored)."""
    text_format = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format \
        else {"type": "text"}
    choice = body.tool_choice or ("auto" if body.tools else "none")
    return {"instructions": body.instructions, "max_output_tokens": body.max_output_tokens or DEFAULT_CHAT_MAX_TOKENS,
            "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
            "reasoning": None, "store": stored, "temperature": body.temperature,
            "text": {"format": text_format, "verbosity": "medium"},
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
            "top_logprobs": body.top_logprobs or 0, "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": "disabled", "user": body.user, "metadata": body.metadata or {}}


def status_of(finish: str | None) -> str:
    """An answer's status, and its items': `incomplete` when cut at max_output_tokens."""
    return "incomplete" if finish == "length" else "completed"


class ResponseObjects(ChatCompletions):
    """/v1/responses: the chat answer (its message, tool calls and logprobs) as a Response object."""

    def __init__(self, decode, tool_plan, body: ResponsesFields, store: Callable[[dict], None] | None = None,
                 reasoning=None):
        super().__init__(decode, tool_plan, reasoning=reasoning)
        self.body, self.created = body, int(time.time())
        self.store = store          # given: keeps the Response once it is answered (see keeps)
        self.id = new_id("resp")    # unique, not the client's X-Request-Id: a stored response is found by it

    def logged_id(self, request_id: str, given: str) -> str:
        return f"{self.id} (X-Request-Id {given})" if given else self.id

    def keeps(self, status: str) -> bool:
        """Whether a response with this status is (or will be) stored: one asked to be, once completed or
        incomplete (a failed or abandoned one not); a background one whatever its end."""
        return self.store is not None and (self.body.background or status not in ("failed", "cancelled"))

    def done(self, response: dict, over: bool = False) -> dict:
        """Store the answered `response` if it is kept (a background one only when its run is `over`: its events
        all recorded, BackgroundRun)."""
        if self.keeps(response["status"]) and (over or not self.body.background):
            self.store(response)
        return response

    def response(self, model: str, output: list, status: str = "in_progress", error: dict | None = None) -> dict:
        """The Response: queued or in_progress (no usage yet), then completed, incomplete (cut at
        max_output_tokens), failed or cancelled."""
        done = status not in ("queued", "in_progress")
        return {"id": self.id, "object": "response", "created_at": self.created,
                "status": status, "background": self.body.background, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "model": model, "output": output, **echoed(self.body, self.keeps(status)),
                "usage": responses_usage(self.usage(self.states)) if done else None,
                **({"specpool": spec_stats(self.states)} if done else {})}

    def whole(self, request_id: str, model: str, choices: list) -> dict:
        """The reasoning item (with a reasoning parser, if the answer reasons), the message item (unless the answer
        is only calls or only reasoning; its logprobs those of the output's tokens after the reasoning), then a
        function_call item per call."""
        message, status = choices[0]["message"], status_of(choices[0]["finish_reason"])
        logprobs = (choices[0]["logprobs"] or {}).get("content", [])[self.thought_tokens():]
        calls, reasoning = message.get("tool_calls") or [], message.get("reasoning")
        answered = message["content"] is not None or calls          # reasoning that ended before the answer
        items = [reasoning_item(new_id("rs"), "completed" if answered else status, reasoning)] if reasoning else []
        if message["content"] is not None or not (calls or reasoning):
            items.append(message_item(new_id("msg"), status, [output_text(message["content"] or "", logprobs)]))
        items += [call_item(new_id("fc"), status, call) for call in calls]
        return self.done(self.response(model, items, status))

    def events(self, request_id: str, model: str, usage_on: str = "") -> "ResponseEvents":
        return ResponseEvents(self, model)

    def thought_tokens(self) -> int:
        """How many of the output's first tokens hold only its reasoning (and its markers): their logprobs are
        not the message's."""
        if not self.reasoning:
            return 0
        return self.reasoning.leading_thought(self.output_pieces(self.states[0]))


class ResponseEvents:
    """The Responses stream: response.created and response.in_progress; per output item its added event, its
    deltas (a message's output_text, a function call's arguments) and its done events; then response.completed
    (response.incomplete when cut at max_output_tokens). Each event is `event: <type>` and its JSON, numbered by
    sequence_number; no [DONE], as OpenAI ends it. An error after the first event is an `error` event and
    response.failed. Put together, the events are the answer read whole (ResponseObjects.whole): text that is only
    whitespace waits, as a message before calls would not be one; a message's deltas carry every logprob its
    done event does. A background response's stream starts queued (response.created, response.queued), and is
    in_progress once its output starts."""

    def __init__(self, kind: ResponseObjects, model: str):
        self.kind, self.model = kind, model
        self.response: dict | None = None   # the Response, once the stream has ended (or failed)
        self.started = not kind.body.background     # in progress (a background one: once its output starts)
        self.sequence = 0
        self.items: list[dict] = []         # the output items so far; the last one open (`self.open`) until closed
        self.open = False
        self.text, self.logprobs = "", []   # the message's text and logprobs so far
        self.thought = ""                   # the reasoning item's text so far
        self.pending: list = []             # logprobs not yet sent (tokens without text, or held by the tool parser)
        self.counted = 0                    # logprobs that have left `pending`, sent or not
        self.thought_tokens: int | None = None      # the reasoning's tokens, known once the message begins
        self.space = ""                     # whitespace not yet sent, before any message
        self.finish: str | None = None

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def start(self) -> list[str]:
        if not self.started:
            response = self.kind.response(self.model, [], "queued")
            return [self._event("response.created", response=response), self._event("response.queued",
                                                                                    response=response)]
        response = self.kind.response(self.model, [])
        return [self._event("response.created", response=response), self._event("response.in_progress",
                                                                                response=response)]

    def chunk(self, index: int, chunk) -> list[str]:
        events = [] if self.started else [self._event("response.in_progress",
                                                      response=self.kind.response(self.model, []))]
        self.started = True
        return events + self._chunk(index, chunk)

    def _chunk(self, index: int, chunk) -> list[str]:
        wanted = self.kind.states[index].top_logprobs is not None
        choice = self.kind.chunk_choice(index, chunk.text, chunk.logprobs if wanted else None,
                                        FINISH.get(chunk.finish_reason))
        self.finish = choice["finish_reason"] or self.finish
        self.pending += (choice["logprobs"] or {}).get("content", [])
        delta = choice["delta"]
        events = self._reasoning(delta["reasoning"]) if delta.get("reasoning") else []
        events += self._text(delta["content"]) if delta.get("content") else []
        for call in delta.get("tool_calls", []):
            events += self._call(call)
        return events

    def _at(self) -> dict:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _opened(self, item: dict) -> list[str]:
        ended = self.open and self.items[-1]["type"] == "reasoning"     # reasoning the answer follows: completed
        events = self._close("completed" if ended else None)
        self.items.append(item)
        self.open = True
        return events + [self._event("response.output_item.added", output_index=len(self.items) - 1, item=item)]

    def _text(self, piece: str, hold: bool = True) -> list[str]:
        """A piece of the message's text: its delta, the message opened first if need be (unless `hold`ing text
        that is only whitespace)."""
        events = []
        if not (self.open and self.items[-1]["type"] == "message"):
            self.space += piece
            if hold and not self.space.strip():
                return []
            piece, self.space, self.text, self.logprobs = self.space, "", "", []
            events = self._opened(message_item(new_id("msg"), "in_progress", []))
            events.append(self._event("response.content_part.added", **self._at(), content_index=0,
                                      part=output_text("", [])))
        return events + (self._delta(piece) if piece or self.pending else [])

    def _reasoning(self, piece: str) -> list[str]:
        """A piece of the reasoning: its delta, the reasoning item opened first if need be."""
        events = []
        if not (self.open and self.items[-1]["type"] == "reasoning"):
            self.thought = ""
            events = self._opened(reasoning_item(new_id("rs"), "in_progress", None))
            events.append(self._event("response.content_part.added", **self._at(), content_index=0,
                                      part=reasoning_text("")))
        self.thought += piece
        return events + [self._event("response.reasoning_text.delta", **self._at(), content_index=0, delta=piece)]

    def _delta(self, piece: str) -> list[str]:
        self.text += piece
        sent = self._answer_logprobs()
        self.logprobs += sent
        return [self._event("response.output_text.delta", **self._at(), content_index=0, delta=piece, logprobs=sent)]

    def _answer_logprobs(self) -> list:
        """The pending logprobs less the reasoning tokens' (which come before the message's)."""
        if self.thought_tokens is None:
            self.thought_tokens = self.kind.thought_tokens()
        skip = max(0, min(len(self.pending), self.thought_tokens - self.counted))
        sent, self.counted, self.pending = self.pending[skip:], self.counted + len(self.pending), []
        return sent

    def _call(self, call: dict) -> list[str]:
        events = self._opened(call_item(new_id("fc"), "in_progress", {**call, "function": {
            **call["function"], "arguments": ""}})) if "id" in call else []
        piece = call["function"].get("arguments", "")
        if piece:
            self.items[-1]["arguments"] += piece
            events.append(self._event("response.function_call_arguments.delta", **self._at(), delta=piece))
        return events

    def _close(self, status: str | None = None) -> list[str]:
        """The done events of the open item, if any (a message's logprobs not yet sent in a last delta first), its
        status `status` or as the output ended."""
        if not self.open:
            return []
        item, at = self.items[-1], self._at()
        item["status"] = status or status_of(self.finish)
        if item["type"] == "function_call":
            self.open = False
            return [self._event("response.function_call_arguments.done", **at, name=item["name"],
                                arguments=item["arguments"]),
                    self._event("response.output_item.done", output_index=at["output_index"], item=item)]
        if item["type"] == "reasoning":
            self.open, part = False, reasoning_text(self.thought)
            item["content"] = [part]
            return [self._event("response.reasoning_text.done", **at, content_index=0, text=self.thought),
                    self._event("response.content_part.done", **at, content_index=0, part=part),
                    self._event("response.output_item.done", output_index=at["output_index"], item=item)]
        events = self._delta("") if self.pending else []
        self.open, part = False, output_text(self.text, self.logprobs)
        item["content"] = [part]
        return events + [self._event("response.output_text.done", **at, content_index=0, text=part["text"],
                                     logprobs=part["logprobs"]),
                         self._event("response.content_part.done", **at, content_index=0, part=part),
                         self._event("response.output_item.done", output_index=at["output_index"], item=item)]

    def end(self) -> list[str]:
        calls = any(item["type"] == "function_call" for item in self.items)
        # text that was only whitespace is the message unless calls came; an empty answer an empty message
        events = self._text("", hold=False) if not calls and (self.space or not self.items) else []
        events += self._close()
        status = status_of(self.finish)
        self.response = self.kind.done(self.kind.response(self.model, self.items, status))
        return events + [self._event(f"response.{status}", response=self.response)]

    def so_far(self, open_status: str) -> list[dict]:
        """The output items as far as they got, the open one (if any) with its text so far and `open_status`."""
        items = [dict(item) for item in self.items]
        if self.open:
            items[-1]["status"] = open_status
            if items[-1]["type"] == "message":
                items[-1]["content"] = [output_text(self.text, self.logprobs)]
            elif items[-1]["type"] == "reasoning":
                items[-1]["content"] = [reasoning_text(self.thought)]
        return items

    def failed(self, error: ApiError) -> list[str]:
        """The error event, then response.failed (its items as far as they got, the open one incomplete)."""
        code = "rate_limit_exceeded" if error.status == 429 else "server_error"
        self.response = self.kind.done(self.kind.response(self.model, self.so_far("incomplete"), "failed",
                                                          {"code": code, "message": str(error)}))
        return [self._event("error", code=error.code or code, message=str(error), param=error.param),
                self._event("response.failed", response=self.response)]
