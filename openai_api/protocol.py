"""Request bodies of the OpenAI API (the fields specpool honours, plus vLLM-style `top_k` and
`speculation`), their translation into a specpool.v1.GenerateRequest, and OpenAI's error shape."""
from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, Field

from protos.specpool.v1 import generation_pb2


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.kind, self.code = status, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class Speculation(BaseModel):
    k: int | None = Field(default=None, ge=0)
    disable: bool = False


class SamplingBody(BaseModel):
    """Fields common to both endpoints."""
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float | None = None
    top_k: int = Field(default=0, ge=0)
    seed: int | None = Field(default=None, ge=0, lt=2 ** 64)
    stop: Union[str, list[str], None] = None
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculation: Speculation | None = None
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingBody):
    prompt: Union[str, list[int], list[str]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: Literal[False] = False


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: str
    content: Union[str, list[ContentPart], None] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(SamplingBody):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


DEFAULT_CHAT_MAX_TOKENS = 256

# specpool.v1 request fields -> the OpenAI parameter a user sent
PARAMS = {"max_new_tokens": "max_tokens", "sampling.temperature": "temperature", "sampling.top_p": "top_p",
          "sampling.top_k": "top_k", "prompt_token_ids": "prompt", "speculation.k": "speculation.k"}


def openai_param(field: str, prompt_param: str = "prompt") -> str:
    """The OpenAI parameter behind a RequestError's field (`stop[2]` -> `stop`)."""
    name = PARAMS.get(field.split("[")[0], field.split("[")[0])
    return prompt_param if name == "prompt" else name


def completion_prompt(body: CompletionRequest) -> str | list[int]:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise ApiError(400, "prompt: one prompt per request (got a batch of "
                           f"{len(prompt)}); use n for several completions", "prompt")
        return prompt[0]
    return prompt


def generate_request(body: SamplingBody, prompt: str | list[int], max_tokens: int | None,
                     logprobs: int | None) -> generation_pb2.GenerateRequest:
    """The GenerateRequest this body asks for (the router validates it, naming proto fields)."""
    request = generation_pb2.GenerateRequest(max_new_tokens=max_tokens or 0,
                                             stop=[body.stop] if isinstance(body.stop, str) else body.stop or [])
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.prompt_token_ids.extend(prompt)
    request.sampling.temperature, request.sampling.top_k = body.temperature, body.top_k
    if body.top_p is not None:
        request.sampling.top_p = body.top_p
    if body.seed is not None:
        request.sampling.seed = body.seed
    if body.speculation is not None:
        request.speculation.disable = body.speculation.disable
        if body.speculation.k is not None:
            request.speculation.k = body.speculation.k
    if logprobs is not None:
        request.logprobs = logprobs
    return request


def with_seed(request: generation_pb2.GenerateRequest, index: int) -> generation_pb2.GenerateRequest:
    """Choice `index` of n: a seeded request's choices use seed, seed + 1, ... (unseeded: the router's)."""
    if index == 0 or not request.sampling.HasField("seed"):
        return request
    copy = generation_pb2.GenerateRequest()
    copy.CopyFrom(request)
    copy.sampling.seed = (request.sampling.seed + index) % 2 ** 64
    return copy
