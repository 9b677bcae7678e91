"""The family matrix: tiny random models of the families users bring (tests/model_families.py), served by the
engines with batching on, give greedy output identical to the target alone, with contexts several times longer
than the sliding window (8 tokens) and drafts that are partly rejected (so caches roll back past the window).

Engine level (no Ray): the draft and target engines of a worker run every round of several requests as one
batch. TP 2 runs the target engine on two gloo ranks in two processes, as a TP group's ranks run it. A model
with no TP plan is refused before any rank loads. The whole stack (Ray, gRPC, router) runs in
tests/test_families_e2e.py.
"""
from __future__ import annotations

import pytest

from engine.sessions import SessionLost
from engine.prefill_chunks import Prefilled
from protos.specpool.v1 import generation_pb2, worker_pb2
from tests.model_families import FAMILIES, NO_TP_PLAN, RECURRENT, RESTARTED, SLIDING, UNPADDED, reference

PROMPTS = [list(range(40, 43)), [7, 9, 11, 200, 13] * 3, list(range(60, 90)), [33] * 20]
KS = [1, 3, 4, 2]
MAX_NEW = 16


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models: one thread is as fast, and far faster than two on a machine whose cores are busy."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


LONG_CONTEXT = {"ROLLBACK_TOKENS": 4, "GROW_FROM": 4}


@pytest.fixture(autouse=True)
def long_context_caches(monkeypatch):
    """The cache layers as at long contexts (engine.cache_layers): sliding-window layers hold the window and 4
    columns more (ROLLBACK_TOKENS; the deepest rollback here is a draft's K = 4 drafts), so that these contexts run
    far past what they hold, and every layer's appends past 4 columns go in place (GROW_FROM). The TP 2 ranks too:
    tp_rank is given them."""
    for name, value in LONG_CONTEXT.items():
        monkeypatch.setattr(f"engine.cache_layers.{name}", value)


GREEDY = generation_pb2.SamplingParams(temperature=0.0, top_p=1.0)


def speculate(draft, target, prompts: list[list[int]], ks: list[int], max_new: int, batched: bool = True,
              sampling=GREEDY, mode: int = worker_pb2.DRAFT_MODE_GREEDY, restart: bool = False):
    """Speculative decoding of every prompt (greedy unless told): each round is one propose_batch and one
    verify_batch over all unfinished requests, as a worker batches concurrent calls (batched=False: one call at a
    time). Returns each request's new tokens and every round's (drafts, number accepted). `restart`: a session a
    worker lost starts again from its committed tokens, as the router starts it (its round: None)."""
    held = [0] * len(prompts)                  # what both workers hold of each request: its committed tokens
    tokens, rounds = [list(p) for p in prompts], []
    while live := [i for i, p in enumerate(prompts) if len(tokens[i]) - len(p) < max_new]:
        calls = [dict(session_id=i, position=held[i], new_token_ids=tokens[i][held[i]:],
                      sampling=sampling if held[i] == 0 else None) for i in live]
        left = [max_new - len(tokens[i]) + len(prompts[i]) for i in live]     # K stops short of max_new
        proposals = [worker_pb2.ProposeRequest(**call, k=min(ks[i], n - 1), mode=mode)
                     for i, n, call in zip(live, left, calls)]
        drafted = draft.propose_batch(proposals) if batched else [draft.propose(p) for p in proposals]
        if restart and lost_rows(live, drafted, held, rounds):
            continue
        verifies = [worker_pb2.VerifyRequest(**call, draft_token_ids=d.draft_token_ids,
                                             draft_hidden_states=d.draft_hidden_states)
                    for call, d in zip(calls, drafted)]
        verdicts = target.verify_batch(verifies) if batched else [target.verify(v) for v in verifies]
        while rests := [(n, v.rest) for n, v in enumerate(verdicts) if isinstance(v, Prefilled)]:  # prefill chunks
            for (n, _), verdict in zip(rests, target.verify_batch([rest for _, rest in rests])):
                verdicts[n] = verdict
        if restart and lost_rows(live, verdicts, held, rounds):
            continue
        for i, d, v in zip(live, drafted, verdicts):
            assert isinstance(v, worker_pb2.VerifyResponse), v
            rounds.append((list(d.draft_token_ids), v.num_accepted))
            held[i] = len(tokens[i])
            tokens[i] += list(d.draft_token_ids[:v.num_accepted]) + [v.next_token_id]
    return [t[len(p):] for t, p in zip(tokens, prompts)], rounds


def lost_rows(live: list[int], answers: list, held: list[int], rounds: list) -> bool:
    """Whether any of the rows' answers is SessionLost: those sessions start again (held 0, a None round)."""
    lost = [i for i, answer in zip(live, answers) if isinstance(answer, SessionLost)]
    for i in lost:
        held[i] = 0
        rounds.append(None)
    return bool(lost)


@pytest.mark.parametrize("family", [name for name in FAMILIES if name not in RECURRENT | RESTARTED])
@pytest.mark.filterwarnings("error::FutureWarning")     # no API transformers has deprecated (past_key_values=...)
def test_batched_speculation_is_identical_to_the_target_alone(family_models, family):
    from draft_worker.proposer import DraftEngine
    from engine.modeling import windowed
    from target_worker.verifier import TargetEngine

    draft_path, target_path = family_models[family]
    engines = lambda: (DraftEngine(draft_path), TargetEngine(target_path, draft_path))   # noqa: E731
    draft, target = engines()
    batched = family not in UNPADDED
    assert windowed(target.model) == (family in SLIDING) and target.batched == draft.batched == batched
    out, rounds = speculate(draft, target, PROMPTS, KS, MAX_NEW)
    assert out == reference(target_path, PROMPTS, MAX_NEW)
    rows = len(PROMPTS) if batched else 1
    assert target.stats.max_batch == rows and draft.stats.max_batch == rows
    accepted, drafted = sum(n for _, n in rounds), sum(len(d) for d, _ in rounds)
    assert 0 < accepted < drafted                 # some drafts accepted, some rolled back
    assert speculate(*engines(), PROMPTS, KS, MAX_NEW, batched=False) == (out, rounds)   # every row as if alone


@pytest.mark.parametrize("family", ["llama", "deepseek-v3.2-dsa", "glm5-dsa"])
def test_a_prefix_cache_changes_no_answer(family_models, family):
    """Sessions that start on cached blocks (engine/prefix_cache.py; DSA's blocks hold the indexer's keys too), one
    call at a time so that each start finds what the ones before it left, get every draft and verdict they get
    with no cache, and do find blocks."""
    from draft_worker.proposer import DraftEngine
    from target_worker.verifier import TargetEngine
    from tests.test_prefix_cache import SHARED

    draft_path, target_path = family_models[family]
    prompts = [SHARED + [11, 12, 13], SHARED + [11, 12, 13], SHARED[:33] + [200, 201], [3, 4, 5]]
    plain = speculate(DraftEngine(draft_path), TargetEngine(target_path, draft_path), prompts, KS, MAX_NEW,
                      batched=False)
    target = TargetEngine(target_path, draft_path, prefix_cache_tokens=1024)
    attach, found = target.prefixes.attach, []
    target.prefixes.attach = lambda *args: found.append(attach(*args)) or found[-1]
    cached = speculate(DraftEngine(draft_path, prefix_cache_tokens=1024), target, prompts, KS, MAX_NEW, batched=False)
    assert cached == plain and found[:4] == [0, 32, 32, 0]        # each session's start: the tokens it found


@pytest.mark.parametrize("family", sorted(RESTARTED))
def test_a_session_whose_cache_cannot_roll_back_starts_again_and_stays_identical(family_models, family):
    """DeepSeek V4's layers keep a window that transformers cannot crop back past: such a rollback is SessionLost
    (not a failed request), and the router starts the session again from its committed tokens, as it does for any
    lost session; the greedy output is the target alone's."""
    from draft_worker.proposer import DraftEngine
    from target_worker.verifier import TargetEngine

    draft_path, target_path = family_models[family]
    draft, target = DraftEngine(draft_path), TargetEngine(target_path, draft_path)
    out, rounds = speculate(draft, target, PROMPTS, KS, MAX_NEW, restart=True)
    assert out == reference(target_path, PROMPTS, MAX_NEW)
    assert rounds.count(None) > 0                   # some sessions were started again


@pytest.mark.parametrize("family", sorted(RECURRENT))
def test_recurrent_layers_roll_back_to_checkpoints_identically_to_the_target_alone(family_models, family):
    """Layers with a recurrent state (linear attention), which transformers cannot crop: every rollback of rejected
    drafts goes back to a checkpoint and computes the accepted ones again (engine.recurrent_states), on both
    engines, so the greedy output is the target alone's with no session lost (speculate asserts every verdict);
    each session keeps a bounded number of checkpoints. Such a model runs one row per forward."""
    from draft_worker.proposer import DraftEngine
    from engine.recurrent_states import MAX_CHECKPOINTS
    from target_worker.verifier import TargetEngine

    draft_path, target_path = family_models[family]
    draft, target = DraftEngine(draft_path), TargetEngine(target_path, draft_path)
    assert not target.batched and not draft.batched
    out, rounds = speculate(draft, target, PROMPTS, KS, MAX_NEW)
    assert out == reference(target_path, PROMPTS, MAX_NEW)
    accepted, drafted = sum(n for _, n in rounds), sum(len(d) for d, _ in rounds)
    assert 0 < accepted < drafted
    for engine in (draft, target):
        assert all(len(s.checkpoints) <= MAX_CHECKPOINTS for s in engine.sessions._sessions.values())


def test_a_rolled_back_recurrent_session_holds_what_one_that_never_saw_the_drafts_holds(family_models):
    """engine.recurrent_states on its own: a session that saw 4 drafts and rolls back to 2 of them (restored to the
    checkpoint before the drafts' forward, the 2 computed again) holds the recurrent states and keys of a session
    that only ever saw those 2, and predicts the same next token."""
    import torch

    from engine.modeling import RaggedBatch, load_model, replayer
    from engine.sampling import Sampling
    from engine.sessions import SessionStore

    model = load_model(family_models["qwen3-next-linear"][1])
    store = SessionStore(replay=replayer(model))
    prompt, drafts = PROMPTS[2], [5, 6, 7, 8]

    def forward(session, tokens: list[int]) -> torch.Tensor:
        batch = RaggedBatch(model, [session])
        logits = batch.forward([tokens], keep=1)
        batch.unpack()
        session.tokens += tokens
        return logits[0, -1]
    rolled, straight = (store.open(i, 0, Sampling()) for i in (1, 2))
    for session, tokens in ((rolled, prompt), (rolled, drafts), (straight, prompt), (straight, drafts[:2])):
        forward(session, tokens)
    assert store.open(1, len(prompt) + 2, None) is rolled and rolled.length == straight.length == len(prompt) + 2
    assert [c.length for c in rolled.checkpoints] == [0, len(prompt)]    # none holding a rejected draft
    recurrent = [i for i, layer in enumerate(rolled.cache.layers) if hasattr(layer, "recurrent_states")]
    assert recurrent
    for i in recurrent:
        for kind in ("recurrent_states", "conv_states"):
            assert torch.allclose(getattr(rolled.cache.layers[i], kind)[0], getattr(straight.cache.layers[i], kind)[0],
                                  atol=1e-6)
    for i in set(range(len(rolled.cache.layers))) - set(recurrent):
        assert torch.allclose(rolled.cache.layers[i].keys, straight.cache.layers[i].keys, atol=1e-6)
    assert forward(rolled, [9]).argmax() == forward(straight, [9]).argmax()


def test_a_recurrent_draft_rolls_a_pre_draft_back_to_the_tokens_the_router_committed(family_models):
    """A pre-draft (overlap) sends the round's unverified drafts as context, with `committed` the tokens verified:
    a rejection then rolls the draft back below that context, to a checkpoint it kept, and it drafts what a fresh
    session of the same tokens drafts (no session lost)."""
    from draft_worker.proposer import DraftEngine

    draft_path = family_models["qwen3-next-linear"][0]
    draft, prompt = DraftEngine(draft_path), PROMPTS[2]
    first = list(draft.propose(worker_pb2.ProposeRequest(session_id=1, position=0, new_token_ids=prompt,
                                                         sampling=GREEDY, k=4)).draft_token_ids)
    draft.propose(worker_pb2.ProposeRequest(session_id=1, position=len(prompt) + 3, new_token_ids=first[3:],
                                            k=5, committed=len(prompt)))
    again = draft.propose(worker_pb2.ProposeRequest(session_id=1, position=len(prompt) + 1, new_token_ids=[7],
                                                    k=3))
    fresh = DraftEngine(draft_path).propose(worker_pb2.ProposeRequest(
        session_id=2, position=0, new_token_ids=prompt + first[:1] + [7], sampling=GREEDY, k=3))
    assert list(again.draft_token_ids) == list(fresh.draft_token_ids)


@pytest.mark.parametrize("family", sorted(SLIDING))
def test_prompts_in_chunks_across_the_window_are_identical_to_the_target_alone(family_models, family):
    """Prompts of 3-30 tokens computed in chunks of 6 (target.prefill_chunk_tokens), longer than the window of 8
    only together: chunks of different rows batched, the window spanning chunks."""
    from draft_worker.proposer import DraftEngine
    from target_worker.verifier import TargetEngine

    draft_path, target_path = family_models[family]
    chunked, plain = (TargetEngine(target_path, draft_path, prefill_chunk_tokens=chunk) for chunk in (6, 0))
    out, rounds = speculate(DraftEngine(draft_path), chunked, PROMPTS, KS, MAX_NEW)
    assert out == reference(target_path, PROMPTS, MAX_NEW)
    assert speculate(DraftEngine(draft_path), plain, PROMPTS, KS, MAX_NEW) == (out, rounds)
    assert chunked.stats.forward_passes == plain.stats.forward_passes + 4    # the 30-token prompt: 5 chunks


@pytest.mark.parametrize("mode", [worker_pb2.DRAFT_MODE_GREEDY, worker_pb2.DRAFT_MODE_SAMPLED],
                         ids=["greedy-draft", "sampled-draft"])
@pytest.mark.parametrize("family", sorted(SLIDING))
def test_seeded_sampling_batched_is_identical_to_each_request_alone(family_models, family, mode):
    """Temperature 0.9 with a seed: every draft, verdict and token of the batched rounds is what the same calls
    give one at a time, so each row attends to exactly its own window."""
    from draft_worker.proposer import DraftEngine
    from target_worker.verifier import TargetEngine

    draft_path, target_path = family_models[family]
    sampled = generation_pb2.SamplingParams(temperature=0.9, top_p=1.0, seed=7)
    runs = [speculate(DraftEngine(draft_path), TargetEngine(target_path, draft_path), PROMPTS, KS, MAX_NEW,
                      batched, sampled, mode) for batched in (True, False)]
    assert runs[0] == runs[1]
    accepted, drafted = sum(n for _, n in runs[0][1]), sum(len(d) for d, _ in runs[0][1])
    assert drafted > 0 and (accepted < drafted or mode == worker_pb2.DRAFT_MODE_SAMPLED)   # greedy drafts roll back


@pytest.mark.parametrize("family", sorted(SLIDING))
def test_decode_steps_on_one_batch_are_identical_to_the_target_alone(family_models, family):
    """K = 0 steps (a decode run's) of every prompt as one batch, MAX_NEW of them, past the window: each forward
    after the first batched one runs on the batch the last one left, uncopied, and the tokens are the target's."""
    from target_worker.verifier import TargetEngine

    draft_path, target_path = family_models[family]
    target = TargetEngine(target_path, draft_path)
    tokens, held, reused = [list(p) for p in PROMPTS], [0] * len(PROMPTS), []
    for _ in range(MAX_NEW):
        before = target._batch
        answers = target.verify_batch([worker_pb2.VerifyRequest(session_id=i, position=held[i],
                                                                new_token_ids=t[held[i]:],
                                                                sampling=GREEDY if held[i] == 0 else None)
                                       for i, t in enumerate(tokens)])
        reused.append(before is not None and target._batch is before)
        for i, answer in enumerate(answers):
            held[i] = len(tokens[i])
            tokens[i].append(answer.next_token_id)
    assert [t[len(p):] for t, p in zip(tokens, PROMPTS)] == reference(target_path, PROMPTS, MAX_NEW)
    assert reused == [False, False] + [True] * (MAX_NEW - 2)       # prefills alone, then one batch, run on


# ---- a failure stays in its own row ------------------------------------------------------------------------

def started_target(family_models, family: str = "mistral-sliding"):
    """A target engine holding every prompt's session (its prompt, prefilled), as after each session's start."""
    from target_worker.verifier import TargetEngine

    draft_path, target_path = family_models[family]
    target = TargetEngine(target_path, draft_path)
    for i, prompt in enumerate(PROMPTS):
        target.verify(worker_pb2.VerifyRequest(session_id=i, position=0, new_token_ids=prompt, sampling=GREEDY))
    return target


def verify_round(target) -> list:
    """One batched round: every session rolls back its last prompt token and verifies 3 drafts after it."""
    return target.verify_batch([worker_pb2.VerifyRequest(session_id=i, position=len(p) - 1, new_token_ids=p[-1:],
                                                         draft_token_ids=[5, 6, 7]) for i, p in enumerate(PROMPTS)])


@pytest.mark.parametrize("breakage", ["forward", "rollback"])
def test_a_session_that_fails_fails_alone(family_models, breakage):
    """One session's cache breaks (its forward raises), or cannot roll back (as transformers' sliding cache could
    not): that request alone gets the error, or SessionLost (the router re-prefills it, as for DeepSeek V4), and
    its session is dropped; every other row of the batch gets exactly the answer it gets with nothing broken."""
    expected = verify_round(started_target(family_models))
    target = started_target(family_models)
    cache = target.sessions._sessions[1].cache
    if breakage == "forward":
        cache.layers[0].keys = cache.layers[0].keys[..., :3]          # wrong head size: the forward raises
    else:
        def crop(_):
            raise RuntimeError("'crop' was called, but the current layer does not track past states")
        cache.crop = crop
    results = verify_round(target)
    assert isinstance(results[1], SessionLost if breakage == "rollback" else (RuntimeError, IndexError)), results[1]
    others = [(r.num_accepted, r.next_token_id) for i, r in enumerate(results) if i != 1]
    assert others == [(r.num_accepted, r.next_token_id) for i, r in enumerate(expected) if i != 1]
    assert 1 not in target.sessions._sessions
    again = target.verify_batch([worker_pb2.VerifyRequest(session_id=1, position=3, new_token_ids=[1])])
    assert isinstance(again[0], SessionLost)


# ---- tensor parallelism -------------------------------------------------------------------------------------

def tp_rank(rank: int, port: int, families: dict, out, settings: dict) -> None:
    """One rank of a TP 2 group in its own process: every family with a TP plan speculates with its target sharded
    over the group (both ranks run the same calls, as a TP group's follower runs rank 0's); rank 0 reports.
    `settings`: engine.cache_layers' LONG_CONTEXT, as the test process has them."""
    import torch

    import engine.cache_layers
    from draft_worker.proposer import DraftEngine
    from target_worker import tensor_parallel
    from target_worker.verifier import TargetEngine

    torch.set_num_threads(1)
    for name, value in settings.items():
        setattr(engine.cache_layers, name, value)
    tensor_parallel.init_group(rank, 2, "127.0.0.1", port, "cpu")
    results = {}
    for name, (draft_path, target_path) in families.items():
        target = TargetEngine(target_path, draft_path, tp_plan="auto")
        held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in target.model.parameters())
        results[name] = (speculate(DraftEngine(draft_path), target, PROMPTS, KS, MAX_NEW)[0], held)
    if rank == 0:
        out.put(results)
    # Both ranks leave the group together: a rank that exits while the other still holds the group can die in
    # gloo's teardown ("terminate called without an active exception", exit code -6).
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def test_tp2_speculation_is_identical_to_the_target_alone(family_models):
    import torch.multiprocessing as mp

    from target_worker.tensor_parallel import host_store

    store = host_store("127.0.0.1")     # held here while the ranks join it: no other process can take its port
    port = store.port
    families = {name: paths for name, paths in family_models.items() if name not in NO_TP_PLAN | RESTARTED}
    context = mp.get_context("spawn")
    out = context.Queue()
    ranks = [context.Process(target=tp_rank, args=(rank, port, families, out, LONG_CONTEXT)) for rank in range(2)]
    for process in ranks:
        process.start()
    try:
        results = out.get(timeout=600)
        for process in ranks:
            process.join(60)
    finally:
        for process in ranks:       # a rank that failed leaves the other waiting in the group: end it
            if process.is_alive():
                process.terminate()
    assert [p.exitcode for p in ranks] == [0, 0]
    from transformers import AutoModelForCausalLM
    for name, (draft_path, target_path) in families.items():
        tokens, held = results[name]
        assert held < AutoModelForCausalLM.from_pretrained(target_path).num_parameters(), name   # rank 0 holds a shard
        assert tokens == reference(target_path, PROMPTS, MAX_NEW), name


@pytest.mark.parametrize("family,tp,reason", [
    ("gpt2", 2, "GPT2LMHeadModel has no tensor-parallel plan in transformers"),
    ("llama", 3, "its 4 attention heads do not divide by 3")])
def test_a_model_that_cannot_be_sharded_is_refused_in_one_line(family_models, family, tp, reason):
    from target_worker.tp_support import ModelRefused, check_tensor_parallel

    target = family_models[family][1]
    with pytest.raises(ModelRefused) as refused:
        check_tensor_parallel(target, tp)
    assert str(refused.value) == f"target model {target!r} cannot be served at tensor_parallel_size {tp}: {reason}"
    check_tensor_parallel(target, 1)
