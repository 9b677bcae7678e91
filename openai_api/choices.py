"""The answers of completions and chat completions: choices whole or as stream chunks (server-sent events), with
usage, logprobs in each endpoint's format, and a `specpool` object carrying the spec-decode stats."""
from __future__ import annotations

import itertools
import json
import math
import time

from openai_api import tools
from openai_api.functions import deprecated_message
from openai_api.reasoning import HarmonyParser, HarmonyStream, ReasoningParser, ReasoningStream
from openai_api.tools import ToolPlan, ToolStream
from protos.specpool.v1 import generation_pb2

FINISH = {generation_pb2.FINISH_REASON_LENGTH: "length", generation_pb2.FINISH_REASON_STOP: "stop",
          generation_pb2.FINISH_REASON_EOS: "stop"}
NO_LOGPROB = -9999.0     # JSON has no -inf (a token outside top-k / top-p), as vLLM answers


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else NO_LOGPROB


def usage(states: list, per_prompt: int = 1) -> dict:
    """OpenAI's usage: each prompt counted once (its `per_prompt` choices are consecutive), the completions of every
    choice; of each prompt, the most tokens any of its choices found in the target's prefix cache
    (`prompt_tokens_details.cached_tokens`); with a prediction, its tokens that the outputs repeat and the others
    (`completion_tokens_details`)."""
    groups = [states[at:at + per_prompt] for at in range(0, len(states), per_prompt)]
    prompt, completion = sum(group[0].prompt_len for group in groups), sum(state.generated for state in states)
    cached = sum(max(state.stats.cached_prompt_tokens for state in group) for group in groups)
    counted = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
               "prompt_tokens_details": {"cached_tokens": cached}}
    if any(state.prediction for state in states):      # Predicted Outputs (router/prediction.py)
        counted["completion_tokens_details"] = {
            "accepted_prediction_tokens": sum(state.stats.accepted_prediction_tokens for state in states),
            "rejected_prediction_tokens": sum(state.stats.rejected_prediction_tokens for state in states)}
    return counted


def spec_stats(states: list) -> dict:
    """The choices' spec-decode stats together; acceptance_rate is null when nothing was drafted."""
    passes, drafted, accepted, answers = (sum(getattr(s.stats, name) for s in states) for name in
                                          ("target_passes", "draft_tokens", "accepted_tokens", "target_answers"))
    return {"target_passes": passes, "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None, "target_answers": answers}


class Completions:
    """/v1/completions: choices carry `text`; logprobs in the legacy format; with `echo`, the prompt before the
    output, its tokens' logprobs before the output's (the first token's null, as OpenAI answers)."""
    object, chunk_object, id_prefix = "text_completion", "text_completion", "cmpl-"

    def __init__(self, decode, text_of=None, echo: list | bool = False, top: int | None = None):
        self.decode = decode           # token ID -> its text, special tokens shown (logprobs' `tokens`)
        self.text_of = text_of or (lambda ids: "".join(map(decode, ids)))   # token IDs -> the text they add
        self.echo = echo               # per choice, its prompt's text echoed before its output (True: token IDs)
        self.top = top                 # alternatives per token in the legacy logprobs (an echo's prompt has more
                                       # when prompt_logprobs asks for more)
        self.prompt_top: int | None = None    # vLLM's prompt_logprobs asked for: alternatives per prompt token
        self.states: list = []         # the choices' RequestStates (bind): an echo's prompt tokens and logprobs
        self.per_prompt = 1            # choices per prompt (n), consecutive in `states`
        self.prompt_entries: dict[int, list] = {}    # prompt index -> its vllm_prompt_logprobs, once built
        self.streamed: dict[int, int] = {}    # choice index -> characters of its tokens already streamed

    def bind(self, states: list, prompt_top: int | None = None, per_prompt: int = 1) -> None:
        self.states, self.prompt_top, self.per_prompt = states, prompt_top, per_prompt

    def vllm_prompt_logprobs(self, prompt: int = 0) -> list:
        """vLLM's prompt_logprobs of prompt `prompt` (built once each): null for its first token, then per token
        {token ID: {logprob, rank, decoded_token}} of the token itself (rank: among the whole vocabulary) and its
        prompt_top alternatives (ranks 1, 2, ...; a token that is one of them, as vLLM, at its place there, which
        differs from its rank only where logprobs tie)."""
        def entry(token_id: int, logprob: float, rank: int) -> tuple[str, dict]:
            return str(token_id), {"logprob": finite(logprob), "rank": rank, "decoded_token": self.decode(token_id)}
        if prompt not in self.prompt_entries:
            self.prompt_entries[prompt] = [None] + [dict([entry(e.token_id, e.logprob, e.rank)] + [
                entry(t.token_id, t.logprob, rank) for rank, t in enumerate(e.top[:self.prompt_top], 1)])
                for e in self.states[prompt * self.per_prompt].prompt_logprobs or []]
        return self.prompt_entries[prompt]

    def response_fields(self) -> dict:
        """Keys of the whole response beside `choices` (chat's prompt_logprobs are there, as vLLM answers)."""
        return {}

    def logprobs(self, entries: list, start: int = 0) -> dict:
        """Legacy logprobs; `text_offset` counts from the completion's start (`start`: the characters of the
        tokens before these), as OpenAI and vLLM do in a stream too. An entry that is a bare token ID (an echoed
        prompt's first) has null logprobs."""
        ids = [e if isinstance(e, int) else e.token_id for e in entries]
        tokens = [self.decode(token) for token in ids]
        offsets = list(itertools.accumulate((len(self.text_of([token])) for token in ids), initial=start))
        return {"tokens": tokens,
                "token_logprobs": [None if isinstance(e, int) else finite(e.logprob) for e in entries],
                "top_logprobs": [None if isinstance(e, int) else {self.decode(t.token_id): finite(t.logprob)
                                                                  for t in e.top[:self.top]} for e in entries],
                "text_offset": offsets[:-1]}

    def choice(self, index: int, text: str, entries: list | None, finish_reason: str | None) -> dict:
        return self._choice(index, *self._echoed(index, text, entries), finish_reason)

    def chunk_choice(self, index: int, text: str, entries: list | None, finish_reason: str | None) -> dict:
        """A stream chunk of choice `index`, its text_offsets following on from its earlier chunks' (its first
        carries the echo)."""
        if index not in self.streamed:
            text, entries = self._echoed(index, text, entries)
        choice = self._choice(index, text, entries, finish_reason, self.streamed.setdefault(index, 0))
        if entries:
            last = entries[-1]
            width = len(self.text_of([last if isinstance(last, int) else last.token_id]))
            self.streamed[index] = choice["logprobs"]["text_offset"][-1] + width
        return choice

    def _echoed(self, index: int, text: str, entries: list | None) -> tuple[str, list | None]:
        if self.echo is False:
            return text, entries
        state = self.states[index]
        ids = state.tokens[:state.prompt_len]
        prompt = self.text_of(ids) if self.echo[index] is True else self.echo[index]
        return prompt + text, None if entries is None else [ids[0], *(state.prompt_logprobs or [])] + entries

    def _choice(self, index: int, text: str, entries: list | None, finish_reason: str | None,
                start: int = 0) -> dict:
        prompt = {} if self.prompt_top is None else {
            "prompt_logprobs": self.vllm_prompt_logprobs(index // self.per_prompt)}
        return {"index": index, "text": text,
                "logprobs": self.logprobs(entries, start) if entries is not None else None,
                "finish_reason": finish_reason, **prompt}

    def opening(self, index: int) -> list[dict]:
        return []

    def logged_id(self, request_id: str, given: str) -> str:
        """The id the request log names the request by: the answer's `id` (the client's X-Request-Id, `given`, in
        it when sent)."""
        return self.id_prefix + request_id

    def whole(self, request_id: str, model: str, choices: list) -> dict:
        """The answer read whole."""
        return {**envelope(self, request_id, model, choices), **self.response_fields(),
                "usage": self.usage(self.states, self.per_prompt), "specpool": spec_stats(self.states)}

    def usage(self, states: list, per_prompt: int = 1) -> dict:
        """OpenAI's usage of these choices (module `usage`)."""
        return usage(states, per_prompt)

    def events(self, request_id: str, model: str, usage_on: str = "") -> "ChoiceEvents":
        return ChoiceEvents(self, request_id, model, usage_on)


class ChatCompletions(Completions):
    """/v1/chat/completions: choices carry a `message` (a `delta` when streaming); logprobs per token; the
    reasoning split from the content (openai_api/reasoning.py), with a reasoning parser; the tool calls the content
    holds (openai_api/tools.py), if the request has tools."""
    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl-"

    def __init__(self, decode, tool_plan: ToolPlan | None = None, deprecated: bool = False,
                 reasoning: ReasoningParser | HarmonyParser | None = None):
        super().__init__(decode)
        self.tools = tool_plan
        self.deprecated = deprecated     # asked with `functions`: calls answered as `function_call`
        self.reasoning = reasoning
        self.streams: dict[int, ToolStream] = {}     # choice index -> its stream's tool calls so far
        self.thoughts: dict[int, ReasoningStream | HarmonyStream] = {}   # choice index -> its stream's split

    def _token(self, token_id: int, logprob: float) -> dict:
        text = self.decode(token_id)
        return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode())}

    def logprobs(self, entries: list) -> dict:
        return {"content": [{**self._token(e.token_id, e.logprob),
                             "top_logprobs": [self._token(t.token_id, t.logprob) for t in e.top]} for e in entries]}

    def choice(self, index: int, text: str, entries: list | None, finish_reason: str | None) -> dict:
        reasoning, text = self.reasoning.split(text) if self.reasoning else (None, text)
        message, finish_reason = tools.message(self.tools, text, finish_reason) if self.tools else (
            {"role": "assistant", "content": text}, finish_reason)
        return self._message_choice(index, "message", with_reasoning(message, reasoning), entries, finish_reason)

    def _message_choice(self, index: int, key: str, message: dict, entries: list | None,
                        finish_reason: str | None) -> dict:
        if self.deprecated:
            message, finish_reason = deprecated_message(message, finish_reason)
        return {"index": index, key: message, "logprobs": self.logprobs(entries) if entries is not None else None,
                "finish_reason": finish_reason}

    def chunk_choice(self, index: int, text: str, entries: list | None, finish_reason: str | None) -> dict:
        reasoning, text = self._thought(index, text, finish_reason is not None)
        if not self.tools:
            delta = {"content": text} if text else {}
        else:
            stream = self.streams.setdefault(index, ToolStream(self.tools))
            delta = stream.feed(text)
            if finish_reason is not None:
                last, finish_reason = stream.finish(finish_reason)
                delta = tools.merged(delta, last)
        return self._message_choice(index, "delta", with_reasoning(delta, reasoning), entries, finish_reason)

    def _thought(self, index: int, text: str, last: bool) -> tuple[str | None, str]:
        """A streamed piece of choice `index` split into its reasoning (None: none to send) and content (all of it
        without a reasoning parser); at the `last` piece, with what the split still held."""
        if not self.reasoning:
            return None, text
        thoughts = self.thoughts.setdefault(index, self.reasoning.stream())
        reasoning, text = thoughts.feed(text)
        if last:
            more, rest = thoughts.finish()
            reasoning, text = reasoning if more is None else (reasoning or "") + more, text + rest
        return reasoning, text

    def opening(self, index: int) -> list[dict]:
        return [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}]

    def response_fields(self) -> dict:
        return {} if self.prompt_top is None else {"prompt_logprobs": self.vllm_prompt_logprobs()}

    def usage(self, states: list, per_prompt: int = 1) -> dict:
        """With a reasoning parser, `completion_tokens_details.reasoning_tokens` too: the output tokens that reason."""
        counted = super().usage(states, per_prompt)
        if not self.reasoning:
            return counted
        thought = sum(self.reasoning.reasoning_tokens(self.output_pieces(state)) for state in states)
        return {**counted, "completion_tokens_details": {**counted.get("completion_tokens_details", {}),
                                                         "reasoning_tokens": thought}}

    def output_pieces(self, state) -> list[str]:
        """Each output token's text, as the reasoning parser counts tokens over it."""
        return [self.text_of([token]) for token in state.tokens[state.prompt_len:]]


def with_reasoning(message: dict, reasoning: str | None) -> dict:
    """A message (or delta) with its reasoning, if any: as `reasoning` (vLLM's) and `reasoning_content` (DeepSeek's)."""
    if reasoning is None:
        return message
    return {**message, **({"content": None} if message.get("content") == "" else {}), "reasoning": reasoning,
            "reasoning_content": reasoning}             # no answer after the reasoning: null content, as vLLM


def envelope(kind: Completions, request_id: str, model: str, choices: list, chunk: bool = False) -> dict:
    return {"id": kind.id_prefix + request_id, "object": kind.chunk_object if chunk else kind.object,
            "created": int(time.time()), "model": model, "choices": choices}


def event(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class ChoiceEvents:
    """A stream's server-sent events: a chunk per piece of output of each choice, then usage if asked (`usage_on`
    "last"; on "every chunk" too, so far: vLLM's continuous_usage_stats), then [DONE]; an error after the first
    chunk as an error event (the status line has gone)."""

    def __init__(self, kind: Completions, request_id: str, model: str, usage_on: str = ""):
        self.kind, self.request_id, self.model, self.usage_on = kind, request_id, model, usage_on

    def _chunk(self, choice: dict) -> str:          # vLLM's continuous usage: the chunk's choice's so far
        usage_field = {"usage": usage([self.kind.states[choice["index"]]])      # its counts only: no per-chunk
                       if self.usage_on == "every chunk" else None}                 # pass over the output's text
        return event({**envelope(self.kind, self.request_id, self.model, [choice], chunk=True),
                      **(usage_field if self.usage_on else {})})

    def start(self) -> list[str]:
        return [self._chunk(opening) for index in range(len(self.kind.states)) for opening in self.kind.opening(index)]

    def chunk(self, index: int, chunk) -> list[str]:
        logprobs = chunk.logprobs if self.kind.states[index].top_logprobs is not None else None
        return [self._chunk(self.kind.chunk_choice(index, chunk.text, logprobs, FINISH.get(chunk.finish_reason)))]

    def failed(self, error) -> list[str]:
        return [event(error.body()), *self.end()]

    def end(self) -> list[str]:
        states = self.kind.states
        last = [event({**envelope(self.kind, self.request_id, self.model, [], chunk=True),
                       "usage": self.kind.usage(states, self.kind.per_prompt), "specpool": spec_stats(states)})]
        return (last if self.usage_on else []) + [event("[DONE]")]
