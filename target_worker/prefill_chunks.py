"""Chunked prefill: a call with more new tokens than `target.prefill_chunk_tokens` (a long prompt) runs as several
forwards of at most that many tokens, each its own trip through the Batcher, so that the calls waiting meanwhile
(other requests' rounds and decode steps) run between them instead of after the whole prompt. No torch here.

The engine computes a chunk and answers Prefilled with the call for the rest; the servicer submits that call
again (TargetServicer._whole, DecodeRun.advance) until a chunk is the last and the call gets its verdict.
"""
from __future__ import annotations

from dataclasses import dataclass

from protos.specpool.v1 import generation_pb2, worker_pb2


@dataclass
class Prefilled:
    """The answer to a call whose new tokens were more than a prefill chunk: the worker now holds their first chunk,
    and `rest` is the call for the others (from the position after the chunk), to submit again so that other calls
    run between the chunks. `prefix_cache`: what a session start found in the prefix cache, for its last answer."""
    rest: worker_pb2.VerifyRequest
    prefix_cache: generation_pb2.PrefixCacheStats | None = None


def rest_of(request: worker_pb2.VerifyRequest, held: int) -> worker_pb2.VerifyRequest:
    """The call for what the worker does not hold yet of `request`'s new tokens, now that it holds `held` tokens."""
    rest = worker_pb2.VerifyRequest()
    rest.CopyFrom(request)
    del rest.new_token_ids[:held - request.position]
    rest.position = held
    rest.ClearField("sampling")               # sampling travels only with position 0
    return rest
