"""Prefix caching (engine/prefix_cache.py): a session that starts with a context whose first blocks are cached
computes only the rest, and nothing it answers changes.

Unit: the lookup finds the longest cached run of a context's first blocks, short of its last token, and a block
only after the same prefix; eviction is least recently used, a chain's tail before its head, bounded in tokens.
Engine level (no Ray): a target and a draft with the cache answer exactly what the same engines without it answer,
greedy and seeded sampling, over several rounds, and say how much of each session start they found.
"""
import pytest
import torch

from engine.modeling import extend_batch, load_model
from engine.prefix_cache import PrefixCache
from engine.sampling import Sampling
from engine.sessions import Session
from protos.specpool.v1 import generation_pb2, worker_pb2
from tests.engine_rounds import run_rounds

BLOCK = 16
SHARED = [(7 * i + 3) % 250 for i in range(40)]      # 2 full blocks and 8 tokens
LONG = [(5 * i + 1) % 250 for i in range(90)]        # 5 full blocks and 10: past engine.batching.SHARED_LEAD


@pytest.fixture(scope="module")
def target_model(byte_pair):
    return load_model(byte_pair[1])


def prefilled(model, context: list[int]) -> Session:
    """A session that computed `context` itself."""
    session = Session(sampling=Sampling())
    extend_batch(model, [session], [context], [1])
    return session


def started(cache: PrefixCache, model, context: list[int]) -> tuple[Session, int]:
    """A session started on `context` with the cache: (the session, tokens found), its forward run and remembered."""
    session = Session(sampling=Sampling())
    found = cache.attach(model, session, context)
    extend_batch(model, [session], [context[found:]], [1])
    cache.remember(session, context)
    return session, found


def test_lookup_finds_the_longest_cached_run_of_first_blocks_short_of_the_last_token(target_model):
    cache = PrefixCache(max_tokens=1024, block=BLOCK)
    assert started(cache, target_model, SHARED)[1] == 0
    assert len(cache._blocks) == 2 and cache.tokens == 32 and cache.bytes > 0
    assert started(cache, target_model, SHARED + [1, 2])[1] == 32
    assert started(cache, target_model, SHARED[:33])[1] == 32
    assert started(cache, target_model, SHARED[:32])[1] == 16       # its last token is always computed
    assert started(cache, target_model, SHARED[:20] + [9] * 30)[1] == 16
    assert started(cache, target_model, [1] + SHARED[1:])[1] == 0


def test_a_block_is_found_only_after_the_same_prefix(target_model):
    cache = PrefixCache(max_tokens=1024, block=BLOCK)
    started(cache, target_model, SHARED)
    moved = [5] * BLOCK + SHARED[BLOCK:]          # block 2 as before, after another first block
    assert started(cache, target_model, moved)[1] == 0


def test_attached_keys_and_values_are_what_the_session_would_compute(target_model):
    cache = PrefixCache(max_tokens=1024, block=BLOCK)
    started(cache, target_model, SHARED)
    session = Session(sampling=Sampling())
    assert cache.attach(target_model, session, SHARED + [4]) == 32
    alone = prefilled(target_model, SHARED + [4])
    for mine, computed in zip(session.cache.layers, alone.cache.layers):
        torch.testing.assert_close(mine.keys, computed.keys[:, :, :32], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(mine.values, computed.values[:, :, :32], rtol=1e-5, atol=1e-6)
    logits, _ = extend_batch(target_model, [session], [SHARED[32:] + [4]], [9])
    expected, _ = extend_batch(target_model, [Session(sampling=Sampling())], [SHARED + [4]], [9])
    torch.testing.assert_close(logits[0], expected[0], rtol=1e-4, atol=1e-5)


def test_eviction_takes_the_least_recently_used_tail_first_within_the_token_bound(target_model):
    cache = PrefixCache(max_tokens=3 * BLOCK, block=BLOCK)
    first = SHARED + list(range(100, 110))           # 3 full blocks
    other = [9] * 2 * BLOCK + [1]                    # 2 full blocks
    started(cache, target_model, first)
    started(cache, target_model, other)
    assert cache.tokens == 3 * BLOCK
    assert started(cache, target_model, first)[1] == BLOCK            # its tail went first; its head stayed
    assert cache.tokens == 3 * BLOCK                                   # ... and now `other` went, all of it
    assert cache.attach(target_model, Session(sampling=Sampling()), first) == 3 * BLOCK
    assert cache.attach(target_model, Session(sampling=Sampling()), other) == 0
    assert cache.bytes == sum(k.nbytes + v.nbytes for layers in cache._blocks.values() for k, v in layers)


def test_off_or_a_session_holding_tokens_finds_nothing(target_model):
    off = PrefixCache(max_tokens=BLOCK - 1, block=BLOCK)
    assert started(off, target_model, SHARED)[1] == 0 and started(off, target_model, SHARED)[1] == 0
    assert len(off._blocks) == 0
    cache = PrefixCache(max_tokens=1024, block=BLOCK)
    started(cache, target_model, SHARED)
    holding = prefilled(target_model, [1, 2, 3])
    assert cache.attach(target_model, holding, SHARED) == 0 and holding.length == 3


# ---- engine level ----------------------------------------------------------------------------------------

PROMPTS = [SHARED + [11, 12, 13], SHARED + [11, 12, 13], SHARED[:33] + [200, 201], SHARED, [3, 4, 5]]


def session_rounds(draft, target, session_id: int, tokens: list[int], params, rounds: int) -> list:
    """`rounds` draft-and-verify rounds of a session starting on `tokens` (extended with what each commits): per
    round (drafts, accepted, next token, draft's cached tokens found, target's found, target's looked up)."""
    answers, held = [], 0
    for _ in range(rounds):
        start = params if held == 0 else None
        drafted = draft.propose(worker_pb2.ProposeRequest(session_id=session_id, position=held,
                                                          new_token_ids=tokens[held:], k=3, sampling=start))
        verdict = target.verify(worker_pb2.VerifyRequest(session_id=session_id, position=held,
                                                         new_token_ids=tokens[held:], sampling=start,
                                                         draft_token_ids=drafted.draft_token_ids))
        answers.append((list(drafted.draft_token_ids), verdict.num_accepted, verdict.next_token_id,
                        drafted.prefix_cache.found, verdict.prefix_cache.found, verdict.prefix_cache.looked_up))
        held = len(tokens) + verdict.num_accepted
        tokens += list(drafted.draft_token_ids[:verdict.num_accepted]) + [verdict.next_token_id]
    return answers


def play(draft, target, temperature: float, rounds: int = 4) -> list:
    """Each prompt's session in turn, `rounds` draft-and-verify rounds each; every answer, in order."""
    return [answer for session_id, prompt in enumerate(PROMPTS) for answer in session_rounds(
        draft, target, session_id, list(prompt),
        generation_pb2.SamplingParams(temperature=temperature, top_p=1.0, seed=session_id % 2), rounds)]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded-sampling"])
def test_engines_answer_the_same_with_and_without_the_cache(byte_pair, temperature):
    from draft_worker.proposer import DraftEngine
    from target_worker.verifier import TargetEngine
    draft_path, target_path = byte_pair
    plain = play(DraftEngine(draft_path), TargetEngine(target_path, draft_path), temperature)
    cached = play(DraftEngine(draft_path, prefix_cache_tokens=1024),
                  TargetEngine(target_path, draft_path, prefix_cache_tokens=1024), temperature)
    assert [a[:3] for a in cached] == [a[:3] for a in plain]
    starts = [a[3:] for a in cached[::4]]                        # each session's first round
    assert starts == [(0, 0, 43), (32, 32, 43), (32, 32, 35), (32, 32, 40), (0, 0, 3)]
    assert [a[3:] for a in plain[::4]] == [(0, 0, 43), (0, 0, 43), (0, 0, 35), (0, 0, 40), (0, 0, 3)]   # off


@pytest.mark.parametrize("prompt, found", [(LONG, [0, 80, 80]), (SHARED, [0, 0, 0])], ids=["long lead", "short lead"])
def test_a_session_start_finds_what_one_before_it_in_the_same_batch_put_there_where_its_lead_is_long(byte_pair,
                                                                                                    prompt, found):
    """The n choices of one request arrive together: a start whose first SHARED_LEAD tokens another start of the
    batch begins with runs in a forward after that one's, once it has put its blocks in (engine.batching.start_groups),
    on the draft and on the target alike; with a shorter shared lead all three run in one forward, computing it
    thrice (a forward costs more). Every choice answers the same either way."""
    from draft_worker.proposer import DraftEngine
    from target_worker.verifier import TargetEngine
    draft_path, target_path = byte_pair
    draft, target = DraftEngine(draft_path, prefix_cache_tokens=1024), TargetEngine(target_path, draft_path,
                                                                                    prefix_cache_tokens=1024)
    params = generation_pb2.SamplingParams(top_p=1.0)
    drafted = draft.propose_batch([worker_pb2.ProposeRequest(session_id=i, new_token_ids=prompt, k=2, sampling=params)
                                   for i in range(3)])
    verdicts = target.verify_batch([worker_pb2.VerifyRequest(session_id=i, new_token_ids=prompt, sampling=params,
                                                             draft_token_ids=d.draft_token_ids)
                                    for i, d in enumerate(drafted)])
    assert [d.prefix_cache.found for d in drafted] == [v.prefix_cache.found for v in verdicts] == found
    forwards = 2 if found[1] else 1                   # the first choice's, then the other two's: or all at once
    assert target.stats.forward_passes == forwards and draft.stats.forward_passes == 2 * forwards   # K = 2: 2 steps
    assert len({tuple(d.draft_token_ids) for d in drafted}) == 1
    assert len({(v.num_accepted, v.next_token_id) for v in verdicts}) == 1


def chat(draft, target, turns: list[list[int]], rounds: int = 3) -> list:
    """A conversation: each turn's session starts on everything before it (prompts and answers) plus the turn's
    own tokens, drafts and verifies `rounds` rounds, and is released. Every turn's answers and first lookups."""
    history, answers = [], []
    for number, turn in enumerate(turns):
        tokens = history + turn
        answers += session_rounds(draft, target, number, tokens, generation_pb2.SamplingParams(top_p=1.0), rounds)
        draft.release(number)
        target.release(number)
        history = tokens
    return answers


def test_the_next_turn_of_a_chat_finds_the_last_turns_prompt_and_answer(byte_pair):
    """A session's release leaves all it committed in the prefix cache (the target knows which of its drafts the
    router committed; the draft, the context it was last given), so a chat's next turn computes only its new
    tokens, and answers as without the cache."""
    from draft_worker.proposer import DraftEngine
    from target_worker.verifier import TargetEngine
    draft_path, target_path = byte_pair
    turns = [SHARED[:30], [100, 101, 102, 103, 104], [7] * 20]
    plain = chat(DraftEngine(draft_path), TargetEngine(target_path, draft_path), turns)
    cached = chat(DraftEngine(draft_path, prefix_cache_tokens=1024),
                  TargetEngine(target_path, draft_path, prefix_cache_tokens=1024), turns)
    assert [a[:3] for a in cached] == [a[:3] for a in plain]
    history = len(turns[0])
    for number, turn in enumerate(turns[1:], start=1):
        first = cached[3 * number]
        answered = sum(a[1] + 1 for a in cached[3 * (number - 1):3 * number])   # the last turn's committed tokens
        history += answered
        # the target holds all but the last token each turn committed; the draft, the context of its last call
        # (accepted drafts it had cached included: it knows which tokens its cache holds)
        last = cached[3 * number - 1]
        assert first[4] == (history - 1) // BLOCK * BLOCK, (number, first, history)
        assert first[3] == (history - last[1] - 1) // BLOCK * BLOCK, (number, first, history)
        history += len(turn)


def test_a_draft_session_knows_the_tokens_its_cache_holds_and_releases_them_accepted_drafts_included(byte_pair):
    """The draft caches each draft but its last; a round that accepts them leaves them in its cache for the next
    call, whose context starts past them. Its session's tokens follow the cache, so the context of its last call
    (penalties count it) is what its release puts in the prefix cache, and the next turn finds all of it."""
    from draft_worker.proposer import DraftEngine
    from target_worker.verifier import TargetEngine
    target_path = byte_pair[1]          # drafting with the target's own model: every greedy draft is accepted
    draft = DraftEngine(target_path, prefix_cache_tokens=1024)
    params = generation_pb2.SamplingParams(top_p=1.0)
    prompt = SHARED[:30]
    output = run_rounds(draft, TargetEngine(target_path, target_path), prompt, 4, 30, params,
                        worker_pb2.DRAFT_MODE_GREEDY)
    session = draft.sessions._sessions[1]
    context = prompt + output
    assert session.tokens == context[:session.length] and session.settled > len(prompt) + BLOCK
    draft.release(1)
    again = draft.propose(worker_pb2.ProposeRequest(session_id=2, new_token_ids=context, k=1, sampling=params))
    assert again.prefix_cache.found == session.settled // BLOCK * BLOCK
