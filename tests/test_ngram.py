"""Prompt lookup (engine/ngram.py) and the loop's proposal sources (router/speculation.py), no Ray, no gRPC.

The lookup against a brute-force reference; then the loop with draft.method ngram and model+ngram against
in-memory workers that keep the position contract (tests/test_overlap.py's FakeWorker): output identical to
the target alone, n-gram rounds make no draft call, per-source stats add up, and a draft killed mid-request
hands its rounds to n-gram proposals with the tokens unchanged.
"""
import asyncio
import random

import pytest

from protos.specpool.v1 import generation_pb2, worker_pb2
from engine.ngram import NgramIndex, continuation
from router.request_state import MODEL, NGRAM, NONE, RequestState
from router.speculation import generate
from tests.test_overlap import FakeWorker, FixedK, down


# ---- the lookup ------------------------------------------------------------------------------------------------

def brute_force(tokens: list[int], min_n: int, max_n: int):
    """(start, n) of the most recent earlier occurrence of the longest suffix, by rescanning everything."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) < n:
            continue
        suffix = tokens[-n:]
        for end in range(len(tokens) - 2, n - 2, -1):           # n-grams ending at end, a token after them
            if tokens[end + 1 - n:end + 1] == suffix:
                return end + 1, n
    return None


def test_longest_match_wins():
    index = NgramIndex(1, 3)
    tokens = [5, 6, 7, 9, 6, 7, 1, 2, 7, 5, 6, 7]
    found = index.match(tokens)
    assert (found.start, found.size) == (3, 3)                 # "5 6 7" at 0..2 beats "6 7" at 4..5, "7" at 8
    assert index.propose(tokens, 4) == [9, 6, 7, 1]


def test_a_match_shorter_than_asked_for_proposes_nothing():
    index = NgramIndex(1, 3)
    tokens = [5, 6, 7, 9, 6, 7, 1, 2, 7, 5, 6, 7]               # its longest match: 3 tokens
    assert index.propose(tokens, 2, min_match=3) == [9, 6] and index.propose(tokens, 2, min_match=4) == []
    short = NgramIndex(1, 3)
    assert short.propose([4, 8, 2, 8], 2, min_match=2) == [] and short.propose([4, 8, 2, 8], 2) == [2, 8]


def test_drafts_after_a_match_are_capped_by_the_k_for_its_length():
    tokens = [5, 6, 7, 9, 6, 7, 1, 2, 7, 5, 6, 7]               # its longest match: 3 tokens (5 6 7 -> 9 6 7 ...)
    assert NgramIndex(1, 3).propose(tokens, 4, k_by_size=[4, 4, 2]) == [9, 6]
    assert NgramIndex(1, 3).propose(tokens, 1, k_by_size=[4, 4, 2]) == [9]     # within k
    assert NgramIndex(1, 3).propose(tokens, 4, k_by_size=[4, 4, 0]) == []      # none after a match of 3
    assert NgramIndex(2, 3).propose([1, 2, 3, 4, 9, 2, 3], 4, k_by_size=[1, 3]) == [4]      # a 2-token match


def test_most_recent_occurrence_is_used():
    tokens = [1, 2, 10, 1, 2, 20, 1, 2, 30, 1, 2]
    assert NgramIndex(2, 2).propose(tokens, 1) == [30]          # not 10 (the earliest) or 20


def test_no_match_and_too_short():
    index = NgramIndex(2, 4)
    assert index.match([1, 2, 3, 4, 5]) is None and index.propose([1, 2, 3, 4, 5], 3) == []
    assert NgramIndex(2, 4).match([7]) is None
    assert index.propose([1, 2, 3, 4, 5, 1, 2], 0) == []


def test_the_suffix_never_matches_itself():
    assert NgramIndex(1, 2).match([4, 4]) is not None           # "4" at 0 is followed by a token
    assert NgramIndex(2, 2).match([3, 4]) is None


def test_periodic_runs_continue_into_the_copy():
    tokens = [9, 1, 2, 1, 2]
    assert NgramIndex(2, 2).propose(tokens, 5) == [1, 2, 1, 2, 1]
    assert continuation([3, 3], 1, 4) == [3, 3, 3, 3]


def test_incremental_index_agrees_with_a_rescan_and_is_linear():
    rng = random.Random(0)
    tokens, index, writes = [], NgramIndex(2, 4), [0]

    class Counting(dict):
        def __setitem__(self, key, value):
            writes[0] += 1
            super().__setitem__(key, value)
    index._tables = {n: Counting() for n in index.sizes}
    for _ in range(600):
        tokens.extend(rng.choice([[rng.randrange(6)], [rng.randrange(6) for _ in range(rng.randrange(1, 5))]]))
        found, expected = index.match(tokens), brute_force(tokens, 2, 4)
        assert (found and (found.start, found.size)) == (expected or None), tokens
    assert writes[0] <= 3 * len(tokens)                         # each position indexed once per n-gram size


def test_bad_sizes_refused():
    with pytest.raises(ValueError):
        NgramIndex(3, 2)


# ---- the loop with proposal sources -----------------------------------------------------------------------------

PROMPT = [7, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11]
MAX_NEW = 80
VOCAB = 40


def truth(context: list[int]) -> int:
    """The target's greedy next token: mostly repeats the text 11 tokens back (so lookup often matches and is
    often right), with a twist every 17th position."""
    if len(context) % 17 == 0:
        return (sum(context) * 7) % VOCAB
    return context[-11]


def guess(context: list[int]) -> int:
    """The draft: right except at every fifth position."""
    return (truth(context) + 1) % VOCAB if len(context) % 5 == 0 else truth(context)


def reference() -> list[int]:
    tokens = list(PROMPT)
    for _ in range(MAX_NEW):
        tokens.append(truth(tokens))
    return tokens[len(PROMPT):]


class Draft(FakeWorker):
    def __init__(self, die_on_call: int = 0):
        super().__init__()
        self.die_on_call = die_on_call

    async def propose(self, session_id, tokens, synced, k, sampling, mode, timeout, **_):
        if self.calls + 1 == self.die_on_call:
            self.calls += 1
            raise down()
        context = self.sync(session_id, tokens, synced)
        await asyncio.sleep(0.001)
        drafts = []
        for _ in range(k):
            drafts.append(guess(context + drafts))
        context.extend(drafts[:-1])
        return worker_pb2.ProposeResponse(draft_token_ids=drafts), 0


class Target(FakeWorker):
    def __init__(self):
        super().__init__()
        self.hidden_seen = []

    async def verify(self, session_id, tokens, synced, drafts, hidden, sampling, timeout, **_):
        context = self.sync(session_id, tokens, synced)
        self.hidden_seen.append(bool(hidden))
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == truth(context + list(drafts[:accepted])):
            accepted += 1
        context.extend(drafts)
        return worker_pb2.VerifyResponse(num_accepted=accepted,
                                         next_token_id=truth(context[:len(tokens) + accepted])), 0


def request(method: str) -> RequestState:
    return RequestState(session_id=7, tokens=list(PROMPT), prompt_len=len(PROMPT), max_new_tokens=MAX_NEW,
                        sampling=generation_pb2.SamplingParams(top_p=1.0), fixed_k=None,
                        draft_mode=worker_pb2.DRAFT_MODE_GREEDY, max_context=0, method=method,
                        ngram=NgramIndex(2, 3))


def run(draft, target, policy, state) -> RequestState:
    async def main():
        async for _ in generate(state, draft, target, policy):
            pass
    asyncio.run(main())
    return state


def check_source_stats(state: RequestState, rounds: list) -> None:
    """stats.source_per_round follows the rounds; per-source totals and per-position counts add up."""
    stats = state.stats
    assert list(stats.source_per_round) == [r.source if r.k else NONE for r in rounds]
    for entry in stats.sources:
        mine = [r for r in rounds if r.k and r.source == entry.source]
        assert entry.rounds == len(mine) and entry.draft_tokens == sum(r.k for r in mine)
        assert entry.accepted_tokens == sum(r.accepted for r in mine)
        assert list(entry.proposed_per_position) == [sum(r.k > j for r in mine) for j in range(max(r.k for r in mine))]
        assert sum(entry.accepted_per_position) == entry.accepted_tokens
    assert sum(s.draft_tokens for s in stats.sources) == stats.draft_tokens


@pytest.mark.parametrize("overlap", [False, True], ids=["in-turn", "overlap"])
@pytest.mark.parametrize("method", ["ngram", "model+ngram"])
def test_output_identical_to_target_alone(method, overlap):
    draft, target, policy = Draft(), Target(), FixedK(4, overlap)
    state = run(draft if method != "ngram" else None, target, policy, request(method))
    assert state.tokens[len(PROMPT):] == reference()
    assert draft.reprefills == 0 and target.reprefills == 0
    sources = {r.source for r in policy.rounds if r.k}
    assert NGRAM in sources and not any(target.hidden_seen)    # n-gram drafts are verified as greedy drafts
    if method == "ngram":
        assert sources == {NGRAM} and draft.calls == 0
    else:
        assert MODEL in sources
        drafted = sum(1 for r in policy.rounds if r.source == MODEL and r.k and not r.predrafted)
        # n-gram rounds make no draft call (a pre-draft cancelled before it started makes none either)
        assert drafted <= draft.calls <= drafted + state.stats.predrafts
    ngram_rounds = [r for r in policy.rounds if r.source == NGRAM and r.k]
    assert sum(r.accepted for r in ngram_rounds) > len(ngram_rounds)      # lookup is right here, often
    check_source_stats(state, policy.rounds)


@pytest.mark.parametrize("overlap", [False, True], ids=["in-turn", "overlap"])
def test_draft_killed_rounds_switch_to_ngram_and_tokens_are_unchanged(overlap):
    draft, target, policy = Draft(die_on_call=4), Target(), FixedK(3, overlap)
    state = run(draft, target, policy, request("model"))
    assert state.tokens[len(PROMPT):] == reference()
    assert not draft.healthy and draft.calls == 4 and target.reprefills == 0
    sources = [r.source if r.k else NONE for r in policy.rounds]
    first = sources.index(NGRAM)
    assert set(sources[:first]) <= {MODEL} and MODEL in sources[:first]   # the draft model until it died...
    assert set(sources[first:]) <= {NGRAM, NONE}                         # ... then lookup, where it matched
    assert sources[first:].count(NGRAM) > sources[first:].count(NONE)
    check_source_stats(state, policy.rounds)


def test_model_only_without_a_lookup_index_falls_back_to_plain_decoding():
    state = request("model")
    state.ngram = None
    draft, policy = Draft(die_on_call=2), FixedK(3, False)
    run(draft, Target(), policy, state)
    assert state.tokens[len(PROMPT):] == reference()
    assert {r.source for r in policy.rounds[2:]} == {MODEL} and {r.k for r in policy.rounds[2:]} == {0}


# ---- config ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("draft, key", [({"method": "lookup"}, "draft.method"), ({"ngram_min": 0}, "draft.ngram_min"),
                                        ({"ngram_min": 3, "ngram_max": 2}, "draft.ngram_max"),
                                        ({"ngram_max_tokens": 0}, "draft.ngram_max_tokens")])
def test_config_errors_name_the_key(draft, key):
    from settings.schema import ConfigError, config_from_dict
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config_from_dict({"draft": draft})


def test_method_reloads_unless_it_needs_a_draft_pool_that_was_never_started():
    from router.reload import RestartRequired, check_reloadable
    from settings.schema import config_from_dict
    model, ngram, both = (config_from_dict({"draft": {"method": m}}) for m in ("model", "ngram", "model+ngram"))
    check_reloadable(model, ngram)
    check_reloadable(model, both)
    check_reloadable(ngram, config_from_dict({"draft": {"method": "ngram", "ngram_max": 6}}))
    with pytest.raises(RestartRequired, match=r"draft\.method"):
        check_reloadable(ngram, both)
    check_reloadable(ngram, both, draft_pool=True)          # started as model, reloaded to ngram, and back
    with pytest.raises(RestartRequired, match=r"draft\.model"):
        check_reloadable(model, config_from_dict({"draft": {"model": "elsewhere"}}))
