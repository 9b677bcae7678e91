"""End to end with prompt-lookup proposals (draft.method ngram and model+ngram) through gRPC, Ray actors and
the router: greedy output token-for-token identical to transformers generate() of the target alone at TP 1 and
TP 2, one at a time and concurrently (batched); per-source stats; sampled requests (sampled-draft mode, n-gram
rounds verified as greedy drafts beside sampled model rounds) follow the target's exact distribution.
(model+ngram at TP 1, one at a time and batched: tests/test_e2e_draft_loading.py, on its TP 1 service.)"""
from concurrent.futures import ThreadPoolExecutor

import pytest

from protos.specpool.v1 import generation_pb2
from tests.conftest import service_config
from tests.distribution import chi_square_p_value, first_two_joint

NGRAM, MODEL = generation_pb2.PROPOSAL_SOURCE_NGRAM, generation_pb2.PROPOSAL_SOURCE_MODEL
PROMPTS = [list(b"abcabcabcabc"), [10, 20, 30, 40, 10, 20, 30, 40, 10, 20], [72, 101, 108, 108, 111]]
MAX_NEW = 40


@pytest.fixture(scope="module", params=[(1, "ngram"), (2, "model+ngram")], ids=["tp1-ngram", "tp2-model+ngram"])
def service(request, start_service, byte_pair):
    tp, method = request.param
    return start_service(service_config(byte_pair, target={"tensor_parallel_size": tp},
                                        draft={"method": method, "ngram_min": 1, "ngram_max": 3}))


def greedy_request(prompt, k=None):
    request = generation_pb2.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=MAX_NEW)
    if k is not None:
        request.speculation.k = k
    return request


def check_sources(stats, method: str) -> None:
    sources = list(stats.source_per_round)
    assert len(sources) == stats.target_passes
    assert [s for s, k in zip(sources, stats.k_per_round) if k == 0] == \
        [generation_pb2.PROPOSAL_SOURCE_NONE] * list(stats.k_per_round).count(0)
    assert sum(s.draft_tokens for s in stats.sources) == stats.draft_tokens
    assert sum(s.accepted_tokens for s in stats.sources) == stats.accepted_tokens
    if method == "ngram":
        assert set(sources) <= {NGRAM, generation_pb2.PROPOSAL_SOURCE_NONE}


@pytest.mark.parametrize("k", [None, 2, 5])
def test_greedy_identical_to_target_generate(service, reference_generate, k):
    method = service.service.config.draft.method
    ngram_rounds = 0
    for prompt in PROMPTS:
        response = service.stub.Generate(greedy_request(prompt, k))
        assert list(response.token_ids) == reference_generate(prompt, MAX_NEW), (prompt, k)
        check_sources(response.stats, method)
        ngram_rounds += list(response.stats.source_per_round).count(NGRAM)
        if method == "ngram":                  # the target looks its drafts up itself: a few calls, many rounds
            assert response.stats.target_calls < response.stats.target_passes
    assert ngram_rounds > 0
    assert service.service.pools.draft_actors == [] if method == "ngram" else True


def test_concurrent_requests_each_match_alone(service, reference_generate):
    requests = [(prompt, k) for prompt in PROMPTS for k in (None, 3)] * 2
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda pk: service.stub.Generate(greedy_request(*pk)), requests))
    for (prompt, _), response in zip(requests, results):
        assert list(response.token_ids) == reference_generate(prompt, MAX_NEW)


# ---- sampled requests ---------------------------------------------------------------------------------------

PROMPT = [0, 1, 2, 0, 1, 2, 0, 1]        # its suffix "0 1" occurred before: the first round is an n-gram one
SAMPLES = 2400


@pytest.fixture(scope="module")
def exact_joint(tiny_pair):
    return first_two_joint(tiny_pair[1], PROMPT)


def first_two(stub, seed: int) -> tuple:
    request = generation_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=3)
    request.sampling.temperature = 1.0
    request.sampling.seed = seed
    response = stub.Generate(request)
    tokens = list(response.token_ids)
    return (tokens[0], tokens[1] if len(tokens) > 1 else None), list(response.stats.source_per_round)


@pytest.mark.parametrize("method", ["model+ngram", "ngram"])
def test_sampled_first_tokens_follow_target_distribution(start_service, tiny_pair, exact_joint, method):
    """model+ngram: n-gram rounds beside sampled model rounds; ngram: the target looks its drafts up itself."""
    service = start_service(service_config(tiny_pair, draft={"method": method},
                                           speculation={"k": 2, "draft_sampling": "sampled"}))
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda s: first_two(service.stub, s), range(SAMPLES)))
    outcomes = [outcome for outcome, _ in results]
    cells = sorted(exact_joint, key=lambda c: (c[0], -1 if c[1] is None else c[1]))
    counts = [outcomes.count(cell) for cell in cells]
    assert chi_square_p_value(counts, [exact_joint[c] for c in cells]) > 1e-4
    assert len({t0 for t0, _ in outcomes}) > 3
    rounds = [source for _, sources in results for source in sources]
    assert rounds.count(NGRAM) > SAMPLES // 2 and (MODEL in rounds) == (method == "model+ngram")


def test_reloaded_to_ngram_on_a_draft_pool_service(service, reference_generate):
    """draft.method is hot-reloadable while a draft pool runs: the TP 2 model+ngram service serves ngram too."""
    router = service.service.router
    if not router.drafts:
        pytest.skip("started with method ngram: no draft pool to switch back to")
    service.reload_draft_method("ngram")
    try:
        for prompt in PROMPTS:
            response = service.stub.Generate(greedy_request(prompt))
            assert list(response.token_ids) == reference_generate(prompt, MAX_NEW)
            check_sources(response.stats, "ngram")
    finally:
        service.reload_draft_method("model+ngram")
    assert router.config.draft.method == "model+ngram"
