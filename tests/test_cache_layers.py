"""The KV cache layers sessions hold (engine/cache_layers.py).

Full-attention layers grow in place: what they hold is what transformers' DynamicLayer holds after the same appends
and crops, appends between reallocations write into the same buffer, and nothing a layer handed out (a view of
what it held) is ever written over.

Sliding-window layers hold their window and the rollback, not the context: a session of a windowed family
(Mistral, Gemma 2, tests/model_families.py: a window of 8) keeps, on its sliding layers, only the columns a next
token can see plus ROLLBACK_TOKENS, and still computes exactly what the target alone does; a rollback within
ROLLBACK_TOKENS is exact, a deeper one starts the session again (SessionLost), and the prefix cache serves a chain
only where its sliding layers hold the window at its end.
"""
import pytest
import torch

import engine.cache_layers as cache_layers
from engine.modeling import extend_batch, load_model
from engine.prefix_cache import PrefixCache
from engine.sampling import Sampling
from engine.sessions import Session, SessionLost, SessionStore
from engine.cache_layers import GROW_FROM, SPARE_MIN, GrowingLayer, WindowLayer, servable
from tests.model_families import WINDOW, reference

DEFAULT_ROLLBACK = cache_layers.ROLLBACK_TOKENS            # before small_rollback sets it for each test
PROMPTS = [[(5 * i + 3) % 200 + 20 for i in range(40)], list(range(60, 85)), [33, 34] * 16]
STEPS = 30


@pytest.fixture(autouse=True)
def small_rollback(monkeypatch):
    """ROLLBACK_TOKENS 4, so that prompts of a few dozen tokens run far past what a sliding layer holds."""
    monkeypatch.setattr(cache_layers, "ROLLBACK_TOKENS", 4)


@pytest.fixture(scope="module")
def targets(family_models):
    """family -> (target model, its path), for a windowed family and a hybrid one (sliding and full layers)."""
    return {name: (load_model(family_models[name][1]), family_models[name][1])
            for name in ("mistral-sliding", "gemma2-hybrid")}


def greedy_steps(model, sessions: list[Session], contexts: list[list[int]], steps: int) -> list[list[int]]:
    """Prefill each context in one batched forward, then `steps` greedy steps of all of them batched."""
    rows, batch, new = extend_batch(model, sessions, contexts, [1] * len(sessions))[0], None, [[] for _ in sessions]
    for _ in range(steps):
        for out, logits in zip(new, rows):
            out.append(int(logits[-1].argmax()))
        rows, batch = extend_batch(model, sessions, [[out[-1]] for out in new], [1] * len(sessions), batch)
    return new


def held(session: Session) -> list[tuple[bool, int, int]]:
    """(sliding, first column held, columns held) of each layer of a session's cache."""
    return [(isinstance(layer, WindowLayer), getattr(layer, "dropped", 0), layer.keys.shape[2])
            for layer in session.cache.layers]


@pytest.mark.parametrize("family", ["mistral-sliding", "gemma2-hybrid"])
def test_sliding_layers_hold_the_window_and_the_rollback_not_the_context(targets, family):
    model, path = targets[family]
    sessions = [Session(sampling=Sampling()) for _ in PROMPTS]
    assert greedy_steps(model, sessions, PROMPTS, STEPS) == reference(path, PROMPTS, STEPS)
    keep = WINDOW - 1 + 4                                     # the window and the rollback, before a forward
    for session in sessions:
        layers = held(session)
        assert any(sliding for sliding, _, _ in layers) and (family == "mistral-sliding") == all(
            sliding for sliding, _, _ in layers)
        for sliding, first, count in layers:
            assert first + count == session.length                 # every layer ends at the session's last token
            if sliding:                                          # drops wait until SPARE_MIN columns are due
                assert keep + 1 <= count <= keep + SPARE_MIN and first > 0
            else:
                assert count == session.length


@pytest.mark.parametrize("depth, exact", [(5, True), (40, False)])
def test_a_rollback_is_exact_within_the_rollback_tokens_and_starts_the_session_again_past_them(targets, depth,
                                                                                                exact):
    """Drafts appended one forward each (as the draft drafts) and then all rejected: a rollback of `depth`. A
    layer holds at least ROLLBACK_TOKENS (4) columns beyond the window before each forward, and the forward's own;
    past what it holds (at most SPARE_MIN more), the session starts again."""
    model, path = targets["mistral-sliding"]
    prompt, drafts = PROMPTS[0], [7 + n % 50 for n in range(40)]
    store = SessionStore()
    session = store.open(1, 0, Sampling())
    extend_batch(model, [session], [prompt], [1])
    for token in drafts[:depth]:
        extend_batch(model, [session], [[token]], [1])
    if not exact:
        with pytest.raises(SessionLost, match="sliding window"):
            store.open(1, len(prompt), None)
        assert store.take(1) is None                         # dropped: the router starts it again at position 0
        return
    session = store.open(1, len(prompt), None)
    assert held(session)[0][1] > 0                           # the rollback went back into a trimmed layer
    logits = extend_batch(model, [session], [[reference(path, [prompt], 1)[0][0]]], [1])[0][0]
    fresh = Session(sampling=Sampling())
    expected = extend_batch(model, [fresh], [prompt + reference(path, [prompt], 1)[0]], [1])[0][0]
    assert torch.allclose(logits, expected, atol=1e-5)


def test_a_full_layer_grows_in_place_holding_what_a_dynamic_layer_holds_and_never_writing_over_a_view():
    from transformers.cache_utils import DynamicLayer

    torch.manual_seed(0)
    ours, theirs = GrowingLayer(), DynamicLayer()
    chunk = lambda n: (torch.randn(2, 3, n, 4), torch.randn(2, 3, n, 4))     # noqa: E731 - [B, heads, n, dim]
    for states in (chunk(GROW_FROM), chunk(1)):                # from GROW_FROM columns on, in place
        ours.update(*states)
        theirs.update(*states)
    buffer, handed = ours.keys.data_ptr(), ours.keys
    snapshot = handed.clone()
    for step in range(5):                                      # room for more: appended in place
        states = chunk(1)
        ours.update(*states)
        theirs.update(*states)
        assert ours.keys.data_ptr() == buffer
    ours.crop(-4)                                              # a rollback, then appends over those columns
    theirs.crop(-4)
    for states in (chunk(3), chunk(GROW_FROM // 4)):           # the second outgrows the buffer
        ours.update(*states)
        theirs.update(*states)
    assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
    assert torch.equal(handed, snapshot)                       # what it had handed out is as it was
    assert ours.get_seq_length() == theirs.get_seq_length() == GROW_FROM + 1 + 5 - 4 + 3 + GROW_FROM // 4


def test_the_default_rollback_covers_the_deepest_one_speculation_makes():
    """K drafts and a pre-draft of up to K + 1 tokens after them (speculation.overlap_tokens), K <= K_LIMIT."""
    from settings.schema import K_LIMIT
    assert DEFAULT_ROLLBACK >= K_LIMIT + (K_LIMIT + 1)


def test_a_chain_is_servable_only_where_its_last_blocks_hold_the_window():
    assert servable([True] * 4, window=8, block=4) == 4
    assert servable([False, False, True, True], window=8, block=4) == 4     # 8 tokens held >= 7
    assert servable([False, False, False, True], window=8, block=4) == 0    # 4 < 7, and nothing before it
    assert servable([True, True, False, True], window=8, block=4) == 2      # back to the first 2, held from 0
    assert servable([], window=8, block=4) == 0


def test_the_prefix_cache_serves_a_windowed_chat_turn_from_the_blocks_it_still_holds(targets):
    """A session prefilled (its prompt's blocks remembered then, every layer held), decoded and ended (its answer's
    early blocks no longer held on its sliding layers). The next turn (prompt, answer, more) finds the chain up to
    the answer's last full block, whose sliding layers hold the window, and answers what the target alone does."""
    model, path = targets["mistral-sliding"]
    cache, prompt = PrefixCache(max_tokens=1024, block=4), PROMPTS[0]
    first = Session(sampling=Sampling())
    assert cache.attach(model, first, prompt) == 0
    logits = extend_batch(model, [first], [prompt], [1])[0][0]
    cache.remember(first, prompt)
    answer = [int(logits[-1].argmax())]
    batch = None
    for _ in range(STEPS - 1):
        rows, batch = extend_batch(model, [first], [answer[-1:]], [1], batch)
        answer.append(int(rows[0][-1].argmax()))
    first.tokens, first.settled = prompt + answer, len(prompt) + len(answer) - 1   # the last token not computed yet
    cache.keep(first)
    assert answer == reference(path, [prompt], STEPS)[0]
    blocks = [cache._blocks[name] for name in cache.names(first.tokens, first.settled // 4)]   # in context order
    assert all(piece is not None for block in blocks[:len(prompt) // 4] for piece in block)
    assert any(piece is None for block in blocks[len(prompt) // 4:] for piece in block)
    turn = prompt + answer + [40, 41, 42]
    second = Session(sampling=Sampling())
    found = cache.attach(model, second, turn)
    assert found == first.settled // 4 * 4 and held(second)[0][1] > 0
    assert greedy_steps(model, [second], [turn[found:]], 8) == reference(path, [turn], 8)


def test_pre_draft_branches_fork_a_trimmed_session_exactly(family_models):
    """Branches forked off a session whose sliding layers were trimmed draft what the model alone drafts from
    their context, and so does the session's own row."""
    from draft_worker.proposer import DraftEngine
    from tests.test_predraft_branches import choices, greedy_from_scratch, request

    draft = DraftEngine(family_models["mistral-sliding"][0])
    prompt = PROMPTS[0]
    first = draft.propose(request(1, 0, prompt, 3))
    drafts, at = list(first.draft_token_ids), len(prompt) + 2         # the session holds the prompt + drafts[:-1]
    points = [(len(prompt) + j, first.runner_up_token_ids[j]) for j in range(3)]
    ahead = draft.propose(request(1, at, drafts[2:], 4, branches=points))
    context = prompt + drafts
    assert choices(ahead) == greedy_from_scratch(draft.model, context, 4)
    for (at, token), branch in zip(points, ahead.branch_drafts):
        assert choices(branch) == greedy_from_scratch(draft.model, context[:at] + [token], 3), at
    assert held(draft.sessions.take(1))[0][1] > 0
