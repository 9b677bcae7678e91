"""Beam search over HTTP (vLLM's `use_beam_search`, in completions and chat completions).

vLLM's beam search, run the way vLLM's OpenAI server runs it: outside the engine, one step at a time. Each step asks
the target for one greedy token of every live beam, with its 2W most likely next tokens (W = `n`, the beam width).
Every beam then grows by each of those. A beam that ends on EOS is complete; the W best of the rest live on. After
`max_tokens` steps the W best beams, complete or not, are the answer, best first. A beam's score is its summed
log-probability over its length to the power `length_penalty`. The length counts the prompt, and not an EOS that
ends the beam, as vLLM counts it.

Each step is a request of its own through the router (K = 0, one token, read whole). Its prompt is the beam's
tokens, so the target's prefix cache finds all but the last block of it. Beam search does not sample:
temperature, top-p and seeds change nothing, as in vLLM. Streaming, logprobs and the parameters that shape sampling
or stopping are refused beside it, naming the parameter.

    beams = await search(step, width=4, max_tokens=16, prompt_len=7, eos_ids={2}, length_penalty=1.0)
"""
from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Awaitable, Callable

from openai_api.protocol import ApiError
from protos.specpool.v1 import generation_pb2

MAX_WIDTH = 10          # 2W alternatives a step: the router's most logprobs (20)
ALLOWED = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "use_beam_search",
           "length_penalty", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "echo",
           "temperature", "seed", "user", "speculation", "add_generation_prompt", "continue_final_message",
           "chat_template_kwargs", "reasoning_effort", "prediction"}     # (a prediction changes no output: unused)

Step = Callable[[tuple], Awaitable[list[tuple[int, float]]]]    # a beam's tokens -> [(next token, logprob)]


@dataclass(frozen=True)
class Beam:
    tokens: tuple = ()           # generated so far (an EOS that ended it included)
    cum_logprob: float = 0.0
    ended: bool = False          # on EOS


def score(beam: Beam, prompt_len: int, length_penalty: float) -> float:
    """vLLM's get_beam_search_score: the summed logprob over the length (the prompt's included, the ending EOS not)
    to the power length_penalty."""
    return beam.cum_logprob / ((prompt_len + len(beam.tokens) - beam.ended) ** length_penalty)


async def search(step: Step, width: int, max_tokens: int, prompt_len: int, eos_ids, length_penalty: float = 1.0
                 ) -> list[Beam]:
    """The `width` best beams after max_tokens steps, best first; each step grows every live beam by its 2 x width
    most likely next tokens (`step`), all live beams' steps at once."""
    def key(beam: Beam) -> float:
        return score(beam, prompt_len, length_penalty)
    alive, ended = [Beam()], []
    for _ in range(max_tokens):
        grown = await asyncio.gather(*(step(beam.tokens) for beam in alive))
        candidates = []
        for beam, alternatives in zip(alive, grown):
            for token, logprob in alternatives:
                child = Beam(beam.tokens + (token,), beam.cum_logprob + logprob, token in eos_ids)
                (ended if child.ended else candidates).append(child)
        alive = sorted(candidates, key=key, reverse=True)[:width]
        if not alive:
            break
    return sorted(ended + alive, key=key, reverse=True)[:width]


def check(body) -> None:
    """A 400 naming the first parameter that beam search does not take (one sent at other than its default), or a
    beam wider than MAX_WIDTH."""
    for name in sorted(body.model_fields_set - ALLOWED):
        if getattr(body, name) != type(body).model_fields[name].default:
            raise ApiError(400, f"{name}: not with use_beam_search (beam search takes the prompt, n, max_tokens, "
                                f"length_penalty, ignore_eos, include_stop_str_in_output and skip_special_tokens)",
                           name)
    if body.n > MAX_WIDTH:
        raise ApiError(400, f"n: at most {MAX_WIDTH} with use_beam_search, the beam width (got {body.n})", "n")


def router_step(router, width: int, spent: list) -> Callable:
    """A step through `router`: one greedy token of the beam, read whole, with its 2 x width alternatives; each
    step's state goes on `spent` (its stats). At most router.max_active_requests steps run at once, so that a beam
    search alone never overfills admission."""
    running = asyncio.Semaphore(max(1, router.config.router.max_active_requests))

    async def step(prompt: list[int], tokens: tuple) -> list[tuple[int, float]]:
        request = generation_pb2.GenerateRequest(prompt_token_ids=[*prompt, *tokens], max_new_tokens=1,
                                                 logprobs=2 * width, ignore_eos=True)
        request.sampling.temperature = 0.0
        request.speculation.disable = True
        async with running:
            state = await router.admit(request, streamed=False)
            spent.append(state)
            async for _ in router.run(state):
                pass
        return [(top.token_id, top.logprob) for top in state.logprobs[0].top]
    return step


async def beam_states(router, body, base) -> list:
    """The `n` best beams of one prompt, best first, as RequestStates like `base`'s (the request as admitted, never
    run), each holding its beam's tokens; the first carries the steps' stats summed (its prompt's cached tokens
    those of the first step)."""
    spent, prompt = [], base.tokens[:base.prompt_len]
    step = router_step(router, body.n, spent)
    beams = await search(lambda tokens: step(prompt, tokens), body.n, base.max_new_tokens, base.prompt_len,
                         set() if body.ignore_eos else base.eos_ids, body.length_penalty)
    states = [dataclasses.replace(base, tokens=[*prompt, *(beam.tokens if body.include_stop_str_in_output or not
                                                           beam.ended else beam.tokens[:-1])],
                                  finish_reason=generation_pb2.FINISH_REASON_EOS if beam.ended else
                                  generation_pb2.FINISH_REASON_LENGTH, stats=generation_pb2.GenerationStats(),
                                  prediction=())           # a beam search drafts nothing: no prediction counted
              for beam in beams]
    for state in spent:
        for name in ("target_passes", "target_answers", "target_calls"):
            setattr(states[0].stats, name, getattr(states[0].stats, name) + getattr(state.stats, name))
    if spent:
        states[0].stats.cached_prompt_tokens = spent[0].stats.cached_prompt_tokens
    return states
