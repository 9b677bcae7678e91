"""What a request's GenerationStats count: its rounds, each proposal source's drafts and acceptance per position,
and the workers' prefix-cache lookups."""
from __future__ import annotations

from protos.specpool.v1 import generation_pb2
from router.request_state import NONE, RequestState, Round


def record_start(state: RequestState, response, pool: str) -> None:
    """What a session start's answer from the `pool` worker says: its prefix-cache lookup, if it has one, added to
    the request's stats (the target's first one says how much of the prompt it found cached); the prompt's logprobs,
    the first time the target answers them."""
    if not response.HasField("prefix_cache"):         # not a session start's answer
        return
    if pool == "target" and state.prompt_top_logprobs is not None and state.prompt_logprobs is None:
        state.prompt_logprobs = list(response.prompt_logprobs)      # [] for a one-token prompt
    field = f"{pool}_prefix_cache"
    if pool == "target" and not state.stats.HasField(field):
        state.stats.cached_prompt_tokens = min(response.prefix_cache.found, state.prompt_len)
    lookups = getattr(state.stats, field)
    lookups.looked_up += response.prefix_cache.looked_up
    lookups.found += response.prefix_cache.found


def record(stats: generation_pb2.GenerationStats, round_: Round) -> None:
    stats.target_passes += 1
    stats.draft_tokens += round_.k
    stats.accepted_tokens += round_.accepted
    stats.staged_rounds += round_.staged
    stats.handed_off_rounds += round_.handed == "draft"
    stats.handoffs_from_router += round_.handed == "router"
    stats.k_per_round.append(round_.k)
    stats.source_per_round.append(round_.source if round_.k else NONE)
    if round_.k:
        record_source(stats, round_)


def record_source(stats: generation_pb2.GenerationStats, round_: Round) -> None:
    """Proposed, accepted and per-position counts of the round's source."""
    entry = next((s for s in stats.sources if s.source == round_.source), None)
    if entry is None:
        entry = stats.sources.add(source=round_.source)
    entry.rounds += 1
    entry.draft_tokens += round_.k
    entry.accepted_tokens += round_.accepted
    for counts, upto in ((entry.proposed_per_position, round_.k), (entry.accepted_per_position, round_.accepted)):
        counts.extend([0] * (upto - len(counts)))
        for j in range(upto):
            counts[j] += 1
