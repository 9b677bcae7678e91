"""Checks on a GenerateRequest. Each failure names the offending field, and the servicer turns it
into INVALID_ARGUMENT; nothing is silently clamped or truncated."""
from __future__ import annotations

import math
from dataclasses import dataclass

from protos.specpool.v1 import generation_pb2

MAX_REQUEST_ID_CHARS = 256
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256
MAX_BAD_WORDS = 64          # bad_words per request (each at most MAX_STOP_CHARS)
MAX_TOP_LOGPROBS = 20
MAX_PENALTY = 2.0         # frequency_penalty and presence_penalty: OpenAI's range
MAX_LOGIT_BIAS = 100.0    # logit_bias values: OpenAI's range


def _float32(value: float) -> float:
    """`value` as a float field holds it: a bound on such a field is compared with the field rounded the same way
    (0.01 sent over HTTP arrives as 0.0099999998)."""
    return generation_pb2.SamplingParams(temperature=value).temperature


REPETITION_PENALTY = (_float32(0.01), 100.0)   # logits times or over at most 100: float32 stays finite


class RequestError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    max_context: int          # 0: unknown, no limit checked
    k_max: int
    max_prompt_tokens: int = 0  # 0: only the context window limits it
    max_new_tokens: int = 0     # 0: only the context window limits it
    max_token_chars: int = 0    # most characters one token stands for (0: unknown, no check before encoding)
    eos_ids: frozenset = frozenset()   # the model's EOS tokens

    @property
    def prompt_token_limit(self) -> int:
        """Most prompt tokens: max_prompt_tokens, and room for one new token in the context (0: no limit)."""
        limits = [n for n in (self.max_prompt_tokens, self.max_context - 1 if self.max_context else 0) if n > 0]
        return min(limits, default=0)


def check_token_ids(field: str, token_ids, vocab_size: int) -> None:
    for i, token in enumerate(token_ids):
        if not 0 <= token < vocab_size:
            raise RequestError(f"{field}[{i}]", f"{token} is outside the vocabulary [0, {vocab_size})")


def check_prompt_text(request: generation_pb2.GenerateRequest, limits: ModelLimits) -> None:
    """Before encoding: a text so long that even at the longest token it is over the limit is refused
    without being tokenized (tokenizing 4 MB takes seconds)."""
    limit = limits.prompt_token_limit
    if limits.max_token_chars and limit and len(request.prompt) > limit * limits.max_token_chars:
        raise RequestError("prompt", f"{len(request.prompt)} characters is over the limit of {limit} tokens "
                           f"(a token here is at most {limits.max_token_chars} characters)")


def check_prompt(request: generation_pb2.GenerateRequest, prompt_ids: list[int], limits: ModelLimits) -> None:
    if request.prompt and request.prompt_token_ids:
        raise RequestError("prompt", "set prompt or prompt_token_ids, not both")
    if not prompt_ids:
        raise RequestError("prompt", "must not be empty")
    limit = limits.prompt_token_limit
    if limit and len(prompt_ids) > limit:       # before the per-token check, which is O(length)
        raise RequestError("prompt", f"{len(prompt_ids)} tokens is over the limit of {limit} "
                           f"(router.max_prompt_tokens {limits.max_prompt_tokens or 'unset'}, "
                           f"the model's context {limits.max_context})")
    check_token_ids("prompt_token_ids", prompt_ids, limits.vocab_size)


def check_lengths(request: generation_pb2.GenerateRequest, prompt_len: int, limits: ModelLimits) -> None:
    if request.max_new_tokens < 1:
        raise RequestError("max_new_tokens", "must be >= 1")
    if limits.max_new_tokens and request.max_new_tokens > limits.max_new_tokens:
        raise RequestError("max_new_tokens", f"{request.max_new_tokens} is over the limit of {limits.max_new_tokens}")
    if limits.max_context and prompt_len + request.max_new_tokens > limits.max_context:
        raise RequestError("max_new_tokens", f"prompt ({prompt_len} token{'s' * (prompt_len != 1)}) + max_new_tokens "
                           f"({request.max_new_tokens}) exceeds the model's context of {limits.max_context}")
    if request.min_new_tokens > request.max_new_tokens:
        raise RequestError("min_new_tokens", f"must be <= max_new_tokens={request.max_new_tokens} "
                           f"(got {request.min_new_tokens})")


def check_sampling(sampling: generation_pb2.SamplingParams) -> None:
    if not math.isfinite(sampling.temperature) or sampling.temperature < 0:
        raise RequestError("sampling.temperature", f"must be a finite number >= 0 (got {sampling.temperature})")
    if sampling.HasField("top_p") and not 0 < sampling.top_p <= 1:
        raise RequestError("sampling.top_p", f"must be in (0, 1] (got {sampling.top_p})")
    if sampling.top_k < 0:
        raise RequestError("sampling.top_k", f"must be >= 0 (got {sampling.top_k})")
    if not 0 <= sampling.min_p <= 1:            # NaN too
        raise RequestError("sampling.min_p", f"must be in [0, 1] (got {sampling.min_p})")
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(sampling, name)
        if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
            raise RequestError(f"sampling.{name}", f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (got {value})")
    low, high = REPETITION_PENALTY
    if sampling.HasField("repetition_penalty") and not low <= sampling.repetition_penalty <= high:
        raise RequestError("sampling.repetition_penalty", f"must be in [{low:g}, {high:g}] (got "
                           f"{sampling.repetition_penalty})")


def validate(request: generation_pb2.GenerateRequest, prompt_ids: list[int], limits: ModelLimits) -> None:
    """Raise RequestError for the first invalid field of the request."""
    check_prompt(request, prompt_ids, limits)
    check_lengths(request, len(prompt_ids), limits)
    check_sampling(request.sampling)
    check_logit_bias(request.sampling, limits.vocab_size)
    check_allowed_tokens(request, limits)
    if request.speculation.HasField("k") and request.speculation.k > limits.k_max:
        raise RequestError("speculation.k", f"must be <= k_max={limits.k_max} (got {request.speculation.k})")
    check_token_ids("stop_token_ids", request.stop_token_ids, limits.vocab_size)
    check_outputs(request)
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:
        raise RequestError("request_id", f"must be at most {MAX_REQUEST_ID_CHARS} characters")


def check_logit_bias(sampling: generation_pb2.SamplingParams, vocab_size: int) -> None:
    for token, bias in sorted(sampling.logit_bias.items()):
        if not 0 <= token < vocab_size:
            raise RequestError("sampling.logit_bias", f"token {token} is outside the vocabulary [0, {vocab_size})")
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise RequestError("sampling.logit_bias", f"token {token}: the bias must be in [-{MAX_LOGIT_BIAS:g}, "
                               f"{MAX_LOGIT_BIAS:g}] (got {bias})")


def check_allowed_tokens(request: generation_pb2.GenerateRequest, limits: ModelLimits) -> None:
    """In the vocabulary; not beside a structure (whose masks could leave no token), nor only the tokens that
    min_new_tokens keeps out."""
    allowed = request.sampling.allowed_token_ids
    if not allowed:
        return
    check_token_ids("sampling.allowed_token_ids", allowed, limits.vocab_size)
    if request.HasField("structured_output"):
        raise RequestError("sampling.allowed_token_ids", "cannot be combined with structured_output")
    ends = set(request.stop_token_ids) | (set() if request.ignore_eos else set(limits.eos_ids))
    if request.min_new_tokens and set(allowed) <= ends:
        raise RequestError("sampling.allowed_token_ids", "only EOS or stop tokens, which min_new_tokens keeps out")


def check_outputs(request: generation_pb2.GenerateRequest) -> None:
    """Stop strings, bad words and logprobs (the output's and the prompt's)."""
    if len(request.stop) > MAX_STOP_STRINGS:
        raise RequestError("stop", f"at most {MAX_STOP_STRINGS} stop strings (got {len(request.stop)})")
    for i, stop in enumerate(request.stop):
        if not 1 <= len(stop) <= MAX_STOP_CHARS:
            raise RequestError(f"stop[{i}]", f"must be 1 to {MAX_STOP_CHARS} characters (got {len(stop)})")
    if len(request.bad_words) > MAX_BAD_WORDS:
        raise RequestError("bad_words", f"at most {MAX_BAD_WORDS} words (got {len(request.bad_words)})")
    for i, word in enumerate(request.bad_words):
        if not 1 <= len(word) <= MAX_STOP_CHARS:
            raise RequestError(f"bad_words[{i}]", f"must be 1 to {MAX_STOP_CHARS} characters (got {len(word)})")
    for name in ("logprobs", "prompt_logprobs"):
        if request.HasField(name) and getattr(request, name) > MAX_TOP_LOGPROBS:
            raise RequestError(name, f"must be <= {MAX_TOP_LOGPROBS} (got {getattr(request, name)})")
