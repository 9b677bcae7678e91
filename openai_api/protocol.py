"""Request bodies of the OpenAI API (the fields specpool honours, plus vLLM-style `top_k` and
`speculation`; the OpenAI parameters that would change the output and that specpool lacks are refused unless
neutral), their translation into a specpool.v1.GenerateRequest, and OpenAI's error shape.

Every value a body can hold fits the GenerateRequest field it goes into (integers within the field's range,
text that is valid Unicode), so building the request cannot fail: what does not fit is a 400 naming it."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional, Union

from google.protobuf.descriptor import FieldDescriptor
from pydantic import (AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationInfo,
                      create_model, model_validator)
from pydantic_core import PydanticCustomError

from openai_api.structured import JsonSchema, ResponseFormat, StructuredOutputs, structured_output
from openai_api.tools import (PARSERS, CalledFunction, Function, FunctionName, NamedToolChoice, Parser, Tool,
                              ToolCall, ToolChoice, ToolPlan, string_or_named)
from protos.specpool.v1 import generation_pb2
from router.validation import MAX_TOP_LOGPROBS, RequestError


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, grpc_code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.kind, self.code = status, param, kind, code
        self.grpc_code = grpc_code          # the request's code in specpool_requests_total, if not the status's

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


INT_RANGES = {FieldDescriptor.CPPTYPE_INT32: (-2 ** 31, 2 ** 31 - 1), FieldDescriptor.CPPTYPE_UINT32: (0, 2 ** 32 - 1),
              FieldDescriptor.CPPTYPE_INT64: (-2 ** 63, 2 ** 63 - 1), FieldDescriptor.CPPTYPE_UINT64: (0, 2 ** 64 - 1)}


def strict(kind: type, **constraints: Any) -> Any:
    """`kind` as OpenAI's API takes it, JSON's own type and no coercion: "4", 4.0 and true are not integers,
    "0.5" and true are not numbers (an integer is one), 1 and "yes" are not booleans."""
    return Annotated[kind, Field(strict=True, **constraints)]


def proto_int(path: str, ge: int | None = None, le: int | None = None) -> Any:
    """A strict int that fits the GenerateRequest field at `path` ("sampling.top_k"), which it goes into,
    narrowed to [ge, le] where given."""
    descriptor = generation_pb2.GenerateRequest.DESCRIPTOR
    for name in path.split("."):
        field = descriptor.fields_by_name[name]
        descriptor = field.message_type
    low, high = INT_RANGES[field.cpp_type]
    return strict(int, ge=low if ge is None else max(ge, low), le=high if le is None else min(le, high))


def _unicode(text: str) -> str:
    """JSON's \\ud800 escapes make lone surrogates, which are not text: protobuf cannot encode them."""
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise PydanticCustomError("unicode", "not valid Unicode (a lone surrogate at character {at})",
                                  {"at": exc.start}) from None
    return text


def number(**bounds: float) -> Any:
    """A strict finite float (Python's JSON parser reads NaN, Infinity and 1e400 as inf) within `bounds`,
    checked on the JSON value itself: the float32 field it goes into would round 1.0000001 to 1."""
    return strict(float, allow_inf_nan=False, **bounds)


Text = Annotated[str, AfterValidator(_unicode)]
Flag = strict(bool)
Temperature, TopP = number(ge=0, le=2), number(gt=0, le=1)      # OpenAI's range; top_p 0 the router's refusal
Penalty, RepetitionPenalty = number(ge=-2, le=2), number(ge=0.01, le=100)  # OpenAI's range; the router's (validation)
MinP = number(ge=0, le=1)                                                  # vLLM's range


def _token_keys(bias: dict) -> dict:
    """logit_bias's keys are token IDs, written as JSON strings ("50256")."""
    for key in bias:
        if not re.fullmatch(r"[0-9]{1,9}", key):
            raise PydanticCustomError("token_id", "keys must be token IDs (got {key})", {"key": json.dumps(key)})
    return bias


LogitBias = Annotated[dict[str, number(ge=-100, le=100)], AfterValidator(_token_keys)]   # OpenAI's range


# Tags of a union's members, which an error's location carries: they have a space, unlike any field's name
STRING, STRINGS, LISTS, LIST = "a string", "a list of strings", "a list of lists", "another list"


def _kind(value: Any) -> str | None:
    if isinstance(value, str):
        return STRING
    if isinstance(value, list):
        first = value[0] if value else None
        return STRINGS if isinstance(first, str) else LISTS if isinstance(first, list) else LIST
    return None


def one_of(expected: str, string: Any, strings: Any, other_list: Any, lists: Any = None) -> Any:
    """A union whose member is chosen by the kind of JSON value (a string, a list that starts with a string, a
    list of lists where `lists` is given, another list), so that an invalid value gets that member's error alone,
    or `must be <expected>`."""
    members = [Annotated[string, Tag(STRING)], Annotated[strings, Tag(STRINGS)], Annotated[other_list, Tag(LIST)]]
    members += [Annotated[lists, Tag(LISTS)]] if lists is not None else []
    return Annotated[Union[tuple(members)],
                     Discriminator(_kind, custom_error_type="invalid_type", custom_error_message=f"must be {expected}")]


class Body(BaseModel):
    """A JSON object of a request, where an explicit null is the same as leaving the field out (as OpenAI takes
    it: `"max_tokens": null` is the default)."""

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_absent(cls, data: Any) -> Any:
        """Only a known field's null: an unknown key stays, for a model that forbids them to refuse."""
        if not isinstance(data, dict):
            return data
        return {key: value for key, value in data.items() if value is not None or key not in cls.model_fields}


MaxTokens = Optional[proto_int("max_new_tokens", ge=1)]
TopLogprobs = Optional[proto_int("logprobs", le=MAX_TOP_LOGPROBS)]


def _whole_vocabulary_refused(value: Any) -> Any:
    """vLLM's prompt_logprobs -1 asks for every token of the vocabulary at every prompt position."""
    if value is not None and value < 0:
        raise PydanticCustomError("alternatives", "0 to {most} alternatives per token (vLLM's -1, the whole "
                                  "vocabulary, is not served)", {"most": MAX_TOP_LOGPROBS})
    return value


PromptLogprobs = Annotated[Optional[strict(int, le=MAX_TOP_LOGPROBS)], AfterValidator(_whole_vocabulary_refused)]
TopK, Seed, SpeculationK = proto_int("sampling.top_k", ge=0), proto_int("sampling.seed"), proto_int("speculation.k")
MinTokens = proto_int("min_new_tokens")
Stop = one_of("a string or a list of strings", Text, list[Text], list[Text])
Prompt = one_of("a string, a list of strings, a list of token IDs or a list of such lists", Text, list[Text],
                list[proto_int("prompt_token_ids")], list[list[proto_int("prompt_token_ids")]])
StopTokenId, AllowedTokenId = proto_int("stop_token_ids"), proto_int("sampling.allowed_token_ids")
# A sane bound on one body's fan-out (each choice is a router request, holding a slot and both workers'
# caches); choices beyond router.max_active_requests run in waves (app.choice_chunks)
MAX_N = 16
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]   # function: the deprecated tool


class StreamOptions(Body):
    """OpenAI's two keys (specpool never obfuscates: include_obfuscation changes nothing) and vLLM's
    continuous_usage_stats (with include_usage: every chunk carries the usage so far); another is a 400."""
    model_config = ConfigDict(extra="forbid")
    include_usage: Flag = False
    include_obfuscation: Flag = True
    continuous_usage_stats: Flag = False


class Speculation(Body):
    """specpool's own extension object: a misspelt key (`kk`) is refused, not ignored as an unknown OpenAI
    parameter at the top level is (whatever its value: `"kk": null` too)."""
    model_config = ConfigDict(extra="forbid")
    k: Optional[SpeculationK] = None
    disable: Flag = False


@dataclass(frozen=True)
class SameAs:
    """A neutral value that is another parameter's value (best_of: n, whose default 1 counts when it is not sent)."""
    param: str

    def __str__(self) -> str:
        return f"equal to `{self.param}`"


# The OpenAI Completions and Chat Completions parameters (openai's completion_create_params.py and
# chat/completion_create_params.py) that would change the output and that specpool does not implement -> the
# value that changes nothing, the only one accepted (None: no such value; a null is absent, so always accepted).
# Both endpoints refuse each (vLLM's completions take response_format too). Parameters that
# do not change the output (user, metadata, store, service_tier, parallel_tool_calls, prompt_cache_key,
# safety_identifier) are ignored, as any unknown key; prediction, which does not either, is served (Prediction).
REFUSED: dict[str, Any] = {
    "best_of": SameAs("n"), "suffix": "",
    "tools": [], "tool_choice": "none", "functions": [], "function_call": "none",
    "modalities": ["text"], "audio": None, "reasoning_effort": None, "verbosity": "medium",
    "web_search_options": None, "moderation": None,
    # vLLM's and SGLang's own sampling extensions, which clients moving from them send (those specpool has,
    # repetition_penalty, ignore_eos, min_p, min_tokens and the structured-output ones, are fields above): the same
    # rule, so that no such request silently gets other output than it asked for
    "logits_processors": None,
    "truncate_prompt_tokens": None, "spaces_between_special_tokens": True,
    "detokenize": True, "return_tokens_as_token_ids": False, "guided_whitespace_pattern": None,
    "chat_template": None, "documents": None,      # a request's own template, RAG documents for the template
    "echo": False,                                  # chat's (a completion's is served)
}


def same_json(value: Any, other: Any) -> bool:
    """JSON's equality, at any depth: 0 is 0.0, but false is not 0 (as Python's == has it)."""
    if isinstance(value, dict) and isinstance(other, dict):
        return value.keys() == other.keys() and all(same_json(value[key], other[key]) for key in value)
    if isinstance(value, list) and isinstance(other, list):
        return len(value) == len(other) and all(map(same_json, value, other))
    return isinstance(value, bool) == isinstance(other, bool) and value == other


def is_neutral(value: Any, neutral: Any, validated: dict) -> bool:
    if isinstance(neutral, SameAs):     # of the other's JSON type too: best_of 1.0 is not n 1
        expected = validated.get(neutral.param, value)      # the other one invalid: its own error refuses the body
        return type(value) is type(expected) and value == expected
    return same_json(value, neutral)


def neutral_only(table: dict[str, Any], defaults: dict[str, Any] | None = None) -> dict[str, tuple]:
    """Fields (for create_model) of `table`'s parameters (REFUSED's form), each accepted at its neutral value only,
    absent by default (None, or `defaults`' value); after the model's own fields, so that a SameAs finds the
    parameter it names validated."""
    def check(value: Any, info: ValidationInfo) -> Any:
        neutral = table[info.field_name]
        if not is_neutral(value, neutral, info.data):
            raise PydanticCustomError("unsupported", "not supported by specpool (only {neutral})",
                                      {"neutral": str(neutral) if isinstance(neutral, SameAs) else json.dumps(neutral)})
        return value
    return {name: (Annotated[Any, AfterValidator(check)], (defaults or {}).get(name)) for name in table}


def only_when_true(flag: str) -> AfterValidator:
    """A parameter allowed only when the boolean parameter `flag`, read before it, is `true`, as OpenAI checks
    stream_options (`stream`) and top_logprobs (`logprobs`); its null is absent, so allowed."""
    def check(value: Any, info: ValidationInfo) -> Any:
        if info.data.get(flag) is False:        # not there: `flag` itself was invalid, its error comes first
            raise PydanticCustomError(f"{flag}_only", f"only allowed when `{flag}` is true")
        return value
    return AfterValidator(check)


def only_when_false(flag: str) -> AfterValidator:
    """A parameter refused when the boolean parameter `flag`, read before it, is `true`, as vLLM refuses
    prompt_logprobs with `stream`."""
    def check(value: Any, info: ValidationInfo) -> Any:
        if info.data.get(flag):
            raise PydanticCustomError(f"not_{flag}", f"not with `{flag}`: ask without it")
        return value
    return AfterValidator(check)


class ContentPart(Body):
    type: Literal["text"]
    text: Text


Content = one_of("a string or a list of content parts", Text, list[ContentPart], list[ContentPart])


class Prediction(Body):
    """OpenAI's Predicted Outputs: text the output is expected to repeat much of (router/prediction.py)."""
    type: Literal["content"]
    content: Content

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class SamplingFields(Body):
    """Fields common to both endpoints (SamplingBody adds the refused parameters)."""
    model: Text
    max_tokens: MaxTokens = None
    temperature: Temperature = 1.0
    top_p: Optional[TopP] = None
    top_k: TopK = 0
    min_p: MinP = 0.0                                           # vLLM's, in the body
    seed: Optional[Seed] = None
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    repetition_penalty: Optional[RepetitionPenalty] = None     # vLLM's, in the body
    ignore_eos: Flag = False                                    # vLLM's: go on past EOS (benchmarks send it)
    min_tokens: MinTokens = 0                                   # vLLM's: no EOS, stop token or stop string before
    logit_bias: Optional[LogitBias] = None
    stop: Optional[Stop] = None
    include_stop_str_in_output: Flag = False                    # vLLM's: the text keeps the stop string
    skip_special_tokens: Flag = True                            # vLLM's: false keeps special tokens in the text
    bad_words: Optional[list[Text]] = None                      # vLLM's: words the output never completes
    n: strict(int, ge=1, le=MAX_N) = 1
    use_beam_search: Flag = False                               # vLLM's: n is the beam width (openai_api/beam_search)
    length_penalty: number(ge=-10, le=10) = 1.0                 # ... a beam's score: logprob / length ** this
    stop_token_ids: Optional[list[StopTokenId]] = None
    allowed_token_ids: Annotated[list[AllowedTokenId], Field(min_length=1)] | None = None     # vLLM's
    stream: Flag = False
    stream_options: Annotated[StreamOptions | None, only_when_true("stream")] = None
    prompt_logprobs: Annotated[PromptLogprobs, only_when_false("stream")] = None    # vLLM's: each prompt token's
    speculation: Speculation | None = None
    prediction: Prediction | None = None                       # OpenAI's Predicted Outputs: drafts copied from it
    user: Text | None = None
    response_format: ResponseFormat | None = None              # structured output (openai_api/structured.py)
    structured_outputs: StructuredOutputs | None = None        # ... vLLM's
    guided_json: Union[JsonSchema, Text, None] = None
    guided_regex: Text | None = None
    guided_choice: Annotated[list[Text], Field(min_length=1)] | None = None
    guided_grammar: Text | None = None
    json_schema: Union[JsonSchema, Text, None] = None          # ... SGLang's
    regex: Text | None = None
    ebnf: Text | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Every chunk's usage so far, as vLLM gives it (only with include_usage, as vLLM has it)."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    def params(self) -> dict[str, str]:
        """The HTTP parameter behind each GenerateRequest field a RequestError may name (structured_output's: the
        parameter that asked for it)."""
        try:
            asked = structured_output(self)
        except ValueError:          # two of them: refused before any RequestError could name one
            asked = None
        return {**PARAMS, "structured_output": asked[0]} if asked else PARAMS


SamplingBody = create_model("SamplingBody", __base__=SamplingFields, __module__=__name__, **neutral_only(REFUSED))


class CompletionRequest(SamplingBody):
    prompt: Prompt
    max_tokens: MaxTokens = 16
    logprobs: TopLogprobs = None
    echo: Flag = False                 # the prompt before the output (with `logprobs`, the prompt's logprobs too)


def _assistants_only(calls: Any, info: ValidationInfo) -> Any:
    if calls and info.data.get("role") != "assistant":
        raise PydanticCustomError("assistant_only", "only an assistant message carries tool calls")
    return calls


def _content_or_calls(content: Any, info: ValidationInfo) -> Any:
    """Content may be left out (or null) only by an assistant message with tool calls (or a function call), as
    OpenAI has it, or with reasoning (an answer that only reasoned, sent back), and by a deprecated `function`
    message."""
    if content is None and info.data.get("role") not in (None, "function") and not any(
            info.data.get(key) for key in ("tool_calls", "function_call", "reasoning", "reasoning_content")):
        raise PydanticCustomError("missing", "Field required")
    return content


class Message(Body):
    """A chat message; an assistant's may carry the tool calls it made (and then needs no content), a tool's the
    id of the call it answers."""
    role: Role
    tool_calls: Annotated[Optional[list[ToolCall]], AfterValidator(_assistants_only)] = None
    function_call: Annotated[Optional[CalledFunction], AfterValidator(_assistants_only)] = None    # deprecated
    reasoning: Optional[Text] = None            # an assistant's, sent back (vLLM's name; interleaved thinking)
    reasoning_content: Optional[Text] = None    # ... DeepSeek's name, which wins where both are sent
    content: Annotated[Optional[Content], AfterValidator(_content_or_calls)] = Field(None, validate_default=True)
    tool_call_id: Optional[Text] = None
    name: Optional[Text] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        """The message as chat templates take it (transformers' form: a call's arguments as an object)."""
        message = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": call.type, "function": {
                "name": call.function.name, "arguments": call.function.for_template()}}
                for call in self.tool_calls]
        message.update({key: getattr(self, key) for key in ("tool_call_id", "name") if getattr(self, key)})
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None and self.role == "assistant":      # under each name templates read it by
            message["reasoning_content"] = message["reasoning"] = reasoning
            if not (self.tool_calls and message["content"]):        # gpt-oss's, which takes a call's analysis
                message["thinking"] = reasoning                     # from its content or this, never both
        return message


def _not_with_a_generation_prompt(value: Any, info: ValidationInfo) -> Any:
    if value and info.data.get("add_generation_prompt"):
        raise PydanticCustomError("continue", "not with add_generation_prompt true (its default): set it false to "
                                  "continue the final message, as vLLM asks")
    return value


Effort = Optional[Literal["low", "medium", "high"]]       # OpenAI's reasoning_effort, as gpt-oss takes it


class TemplateOptions(Body):
    """vLLM's chat-template parameters: a new assistant turn asked for (add_generation_prompt), or the final
    message continued (continue_final_message: its text is the start of the answer), and the template's own
    variables (chat_template_kwargs: Qwen3's enable_thinking, for one); OpenAI's reasoning_effort, passed to a
    template that reads it (gpt-oss's)."""
    add_generation_prompt: Flag = True
    continue_final_message: Annotated[Flag, AfterValidator(_not_with_a_generation_prompt)] = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    reasoning_effort: Effort = None


DeprecatedChoice = string_or_named(Literal["none", "auto"], FunctionName, '"none", "auto" or {"name": ...}')


class ChatRequest(SamplingBody, TemplateOptions):     # TemplateOptions' fields first: its validators read them
    messages: list[Message] = Field(min_length=1)
    reasoning_effort: Effort = None         # TemplateOptions' (SamplingBody's refuses it, for completions)
    max_completion_tokens: MaxTokens = None
    logprobs: Flag = False
    top_logprobs: Annotated[TopLogprobs, only_when_true("logprobs")] = None     # as OpenAI and vLLM: not ignored
    tools: Optional[list[Tool]] = None                                        # tool calling (openai_api/tools.py)
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: Flag = True
    functions: Optional[list[Function]] = None           # deprecated tools: openai_api/functions.py ([]: none)
    function_call: Optional[DeprecatedChoice] = None

    def params(self) -> dict[str, str]:
        length = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        forced = {"structured_output": "tools"} if self.tools and self.tool_choice not in (None, "none", "auto") else {}
        return {**super().params(), "prompt": "messages", "prompt_token_ids": "messages", "max_new_tokens": length,
                **forced}

    def tool_plan(self, parser: Parser | None) -> ToolPlan:
        """What the tools ask of the output; a 400 naming the parameter for a tool_choice they cannot meet."""
        choice = self.tool_choice or ("auto" if self.tools else "none")
        named = choice.function.name if isinstance(choice, NamedToolChoice) else ""
        names = [tool.function.name for tool in self.tools or []]
        twice = next((name for name in names if names.count(name) > 1), None)
        if twice:
            raise ApiError(400, f"tools: function names must differ ({twice!r} is there twice)", "tools")
        if choice != "none" and not names:
            raise ApiError(400, "tool_choice: only allowed when `tools` are given", "tool_choice")
        if named and named not in names:
            raise ApiError(400, f"tool_choice: no function named {named!r} in `tools`", "tool_choice")
        if choice == "auto" and parser is None:
            raise ApiError(400, 'tool_choice: "auto" needs a tool-call parser: set http.tool_call_parser (one of '
                           f'{", ".join(PARSERS)}), or send "required" or a named function', "tool_choice")
        earlier = sum(len(message.tool_calls or ()) for message in self.messages or () if message.role == "assistant")
        plan = ToolPlan(tuple(self.tools or ()), "named" if named else choice, named, parser,
                        single=not self.parallel_tool_calls, earlier_calls=earlier)
        try:
            asked = structured_output(self)
        except ValueError:          # two of them: generate_request refuses the body
            asked = None
        if plan.schema() is not None and asked is not None:
            raise ApiError(400, f"{asked[0]}: one structured output per request (`tool_choice` asks for the "
                           "tools' arguments)", asked[0])
        return plan


def _prompt_or_messages(messages: Any, info: ValidationInfo) -> Any:
    if "prompt" in info.data and (messages is None) == (info.data["prompt"] is None):
        raise PydanticCustomError("one_of", "send `prompt` (text) or `messages` (a chat), one of them")
    return messages


def _prompt_only(value: Any, info: ValidationInfo) -> Any:
    """With `messages`, only false (vLLM's default there): they are tokenized as a chat request's prompt is."""
    if value and info.data.get("messages") is not None:
        raise PydanticCustomError("prompt_only", "only false with `messages`: they are tokenized as a chat "
                                  "request's prompt is")
    return value


class TokenizeRequest(TemplateOptions):
    """vLLM's /tokenize: a `prompt`, or `messages` rendered by the chat template with any `tools`, as a chat
    request's prompt is (its tokens are the ones that request is given)."""
    model: Text
    prompt: Optional[Text] = None
    messages: Annotated[Optional[Annotated[list[Message], Field(min_length=1)]],
                        AfterValidator(_prompt_or_messages)] = Field(None, validate_default=True)
    tools: Optional[list[Tool]] = None
    add_special_tokens: Annotated[Optional[Flag], AfterValidator(_prompt_only)] = None    # default: true
    return_token_strs: Flag = False


class DetokenizeRequest(Body):
    """vLLM's /detokenize: token IDs -> their text, special tokens written out."""
    model: Text
    tokens: list[proto_int("prompt_token_ids")]


DEFAULT_CHAT_MAX_TOKENS = 256

# specpool.v1 request fields -> the OpenAI parameter a user sent
PARAMS = {"max_new_tokens": "max_tokens", "sampling.temperature": "temperature", "sampling.top_p": "top_p",
          "sampling.top_k": "top_k", "sampling.seed": "seed", "prompt_token_ids": "prompt",
          "sampling.frequency_penalty": "frequency_penalty", "sampling.presence_penalty": "presence_penalty",
          "sampling.repetition_penalty": "repetition_penalty", "sampling.logit_bias": "logit_bias",
          "sampling.min_p": "min_p", "min_new_tokens": "min_tokens",
          "sampling.allowed_token_ids": "allowed_token_ids", "prediction": "prediction.content"}


def http_error(exc: RequestError, params: dict[str, str]) -> ApiError:
    """A RequestError (which names a GenerateRequest field: `max_new_tokens: ...`, `stop[2]: ...`) as the 400
    naming the HTTP parameter behind it, in its message and `param` (so is the length a message compares it with:
    `min_tokens: must be <= max_tokens=16`)."""
    field = exc.field.split("[")[0]
    param = params.get(field) or params.get(field.split(".")[0], field)
    detail = str(exc).removeprefix(f"{exc.field}: ")
    for named in dict.fromkeys((field, "max_new_tokens")):
        detail = re.sub(rf"(?<![\w.]){re.escape(named)}\b", params.get(named, named), detail)
    return ApiError(400, f"{param}{exc.field.removeprefix(field)}: {detail}", param)


def completion_prompts(body: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts: one, or a batch (a list of texts, or of token-ID lists, as lm-eval and other
    harnesses send them), each answered by n choices, prompt by prompt (a choice's index is its prompt's index
    times n plus its own), as OpenAI and vLLM answer a batch."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return list(prompt)
    return [prompt]


def generate_request(body: SamplingBody, prompt: str | list[int], max_tokens: int | None,
                     logprobs: int | None) -> generation_pb2.GenerateRequest:
    """The GenerateRequest this body asks for (the router validates it, naming proto fields)."""
    request = generation_pb2.GenerateRequest(max_new_tokens=max_tokens or 0, ignore_eos=body.ignore_eos,
                                             min_new_tokens=body.min_tokens,
                                             include_stop_str_in_output=body.include_stop_str_in_output,
                                             keep_special_tokens=not body.skip_special_tokens,
                                             bad_words=body.bad_words or [],
                                             stop=[body.stop] if isinstance(body.stop, str) else body.stop or [],
                                             stop_token_ids=body.stop_token_ids or [])
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.prompt_token_ids.extend(prompt)
    request.sampling.CopyFrom(sampling_params(body))
    if body.speculation is not None:
        request.speculation.disable = body.speculation.disable
        if body.speculation.k is not None:
            request.speculation.k = body.speculation.k
    if logprobs is not None:
        request.logprobs = logprobs
    if body.prediction is not None:
        request.prediction = body.prediction.text
    asked = [n for n in (logprobs if getattr(body, "echo", False) else None, body.prompt_logprobs) if n is not None]
    if asked:                           # an echo's and vLLM's prompt_logprobs: the most alternatives either asks
        request.prompt_logprobs = max(asked)
    try:
        asked = structured_output(body)
    except ValueError as exc:
        param, message = exc.args
        raise ApiError(400, f"{param}: {message}", param) from None
    if asked is not None:
        request.structured_output.CopyFrom(asked[1])
    return request


def sampling_params(body: SamplingBody) -> generation_pb2.SamplingParams:
    sampling = generation_pb2.SamplingParams(temperature=body.temperature, top_k=body.top_k, min_p=body.min_p,
                                             allowed_token_ids=body.allowed_token_ids or [],
                                             frequency_penalty=body.frequency_penalty,
                                             presence_penalty=body.presence_penalty,
                                             logit_bias={int(token): bias for token, bias in
                                                         (body.logit_bias or {}).items()})
    for name in ("top_p", "seed", "repetition_penalty"):          # optional fields: unset unless given
        if getattr(body, name) is not None:
            setattr(sampling, name, getattr(body, name))
    return sampling


def with_seed(request: generation_pb2.GenerateRequest, index: int) -> generation_pb2.GenerateRequest:
    """Choice `index` of n: a seeded request's choices use seed, seed + 1, ... (unseeded: the router's)."""
    if index == 0 or not request.sampling.HasField("seed"):
        return request
    copy = generation_pb2.GenerateRequest()
    copy.CopyFrom(request)
    copy.sampling.seed = (request.sampling.seed + index) % 2 ** 64
    return copy
