"""End to end through gRPC, Ray actors and the router: greedy output is token-for-token identical
to transformers generate() of the target alone, for K in {1, 3, 6}, TP=1 and TP=2 (prompts in chunks),
streaming and unary, and under concurrency with sessions evicted (re-prefill), also where prompts share a prefix that both
pools' prefix caches hold (the ranks of a TP group finding the same blocks)."""
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.specpool.v1 import generation_pb2
from tests.conftest import service_config

PROMPTS = [[72, 101, 108, 108, 111], [10, 200, 3, 77, 150, 42, 9, 1, 2, 3, 4], [33]]
MAX_NEW = 24


@pytest.fixture(scope="module", params=[(1, False), (2, True)], ids=["tp1-in-turn", "tp2-overlap"])
def service(request, start_service, byte_pair):
    # max_sessions=2 makes workers evict sessions under concurrency, exercising re-prefill. TP 1 drafts and
    # verifies in turn, TP 2 overlaps them (speculation.overlap, the default) and computes every prompt and
    # re-prefill longer than 4 tokens in chunks of 4 (*.prefill_chunk_tokens), on both pools and both ranks.
    tp, overlap = request.param
    chunk = 4 if tp == 2 else 0
    target = {"tensor_parallel_size": tp, "max_sessions": 2, "prefill_chunk_tokens": chunk}
    return start_service(service_config(byte_pair, target=target, draft={"max_sessions": 2, "prefill_chunk_tokens": chunk},
                                        speculation={"k": 3, "overlap": overlap}))


def greedy_request(prompt, k, max_new=MAX_NEW):
    request = generation_pb2.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=max_new)
    request.speculation.k = k
    return request


def check_round_accounting(tokens, stats, finish_reason, chunks=None):
    """What the stats guarantee. Each round drafts k_per_round[i] tokens and commits its accepted drafts
    plus the target's own token; only the last round may be cut short, by EOS or a stop token (K is
    clamped so that no round drafts past max_new_tokens, so a LENGTH finish is never a cut)."""
    ks = list(stats.k_per_round)
    assert stats.target_passes == len(ks) >= 1
    assert stats.draft_tokens == sum(ks)
    assert 0 <= stats.accepted_tokens <= stats.draft_tokens
    cut = stats.accepted_tokens + stats.target_passes - len(tokens)     # committed by the rounds, not returned
    if finish_reason == generation_pb2.FINISH_REASON_LENGTH:
        assert cut == 0, (cut, ks)
    else:
        assert finish_reason in (generation_pb2.FINISH_REASON_EOS, generation_pb2.FINISH_REASON_STOP)
        assert 0 <= cut <= ks[-1], (cut, ks)
    if chunks is not None and set(ks) != {0}:    # a stream sends one chunk per round: 1 to K + 1 tokens
        assert len(chunks) == len(ks)
        assert all(1 <= len(c.token_ids) <= k + 1 for c, k in zip(chunks, ks)), ks
    elif chunks is not None:    # decode-run rounds the target answered together travel as one chunk
        assert len(chunks) <= len(ks) and all(c.token_ids for c in chunks)


def stream_tokens(stub, request):
    chunks = list(stub.GenerateStream(request))
    tokens = [t for chunk in chunks for t in chunk.token_ids]
    return tokens, chunks


@pytest.mark.parametrize("k", [0, 1, 3, 6])
@pytest.mark.parametrize("mode", ["unary", "stream"])
def test_greedy_identical_to_target_generate(service, reference_generate, k, mode):
    for prompt in PROMPTS:
        expected = reference_generate(prompt, MAX_NEW)
        request = greedy_request(prompt, k)
        if mode == "unary":
            response = service.stub.Generate(request)
            tokens, stats, finish, chunks = list(response.token_ids), response.stats, response.finish_reason, None
        else:
            tokens, chunks = stream_tokens(service.stub, request)
            stats, finish = chunks[-1].stats, chunks[-1].finish_reason
            assert all(c.finish_reason == 0 for c in chunks[:-1]) and chunks[-1].finish_reason != 0
        assert tokens == expected, (prompt, k)
        assert set(stats.k_per_round) <= {k, *range(k)}          # K is clamped only near the end
        check_round_accounting(tokens, stats, finish, chunks)


def test_plain_target_decoding_with_k0(service, reference_generate):
    response = service.stub.Generate(greedy_request(PROMPTS[0], 0))
    assert list(response.token_ids) == reference_generate(PROMPTS[0], MAX_NEW)
    assert response.stats.draft_tokens == 0 and set(response.stats.k_per_round) == {0}
    assert response.stats.target_passes == len(response.token_ids)
    assert response.stats.target_calls == 1          # pinned to K = 0: one decode run to the end, many passes
    check_round_accounting(list(response.token_ids), response.stats, response.finish_reason)


def test_prompt_logprobs_are_the_target_alones_at_tp1_and_tp2(service, byte_pair, reference_generate):
    """Prompt logprobs (tests/test_prompt_logprobs.py) from a TP 2 group whose ranks prefill in chunks of 4, as from
    TP 1: the target alone's log_softmax at each prompt position (to 1e-4), and the output unchanged."""
    import torch
    from transformers import AutoModelForCausalLM
    prompt = PROMPTS[1]
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(byte_pair[1]).eval()
        alone = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), -1)
    request = greedy_request(prompt, 3)
    request.prompt_logprobs = 2
    response = service.stub.Generate(request)
    assert list(response.token_ids) == reference_generate(prompt, MAX_NEW)
    assert [e.token_id for e in response.prompt_logprobs] == prompt[1:]
    expected = alone.gather(-1, torch.tensor(prompt[1:]).view(-1, 1)).squeeze(-1)
    assert torch.allclose(torch.tensor([e.logprob for e in response.prompt_logprobs]), expected, atol=1e-4)
    assert [[t.token_id for t in e.top] for e in response.prompt_logprobs] == alone.topk(2, -1).indices.tolist()


def test_a_run_read_whole_comes_in_two_messages_and_a_streamed_one_in_one_per_step(service, reference_generate):
    """Pinned to K = 0, a request is one decode run to its end. Streamed with answer_delay_ms 0, each step is its
    own message; read whole (Generate) with unstreamed_answer_delay_ms longer than the run, the run answers its
    session's first token at once and everything else with its last step. The tokens are the same."""
    expected = reference_generate(PROMPTS[1], MAX_NEW)
    before = service.reload(speculation={"answer_delay_ms": 0, "unstreamed_answer_delay_ms": 10_000})
    try:
        streamed, chunks = stream_tokens(service.stub, greedy_request(PROMPTS[1], 0))
        whole = service.stub.Generate(greedy_request(PROMPTS[1], 0))
    finally:
        service.reload(**before)
    assert streamed == list(whole.token_ids) == expected
    assert chunks[-1].stats.target_answers == len(chunks) == len(expected)
    assert whole.stats.target_answers == min(2, len(expected)) and whole.stats.target_calls == 1


def test_concurrent_requests_each_match_alone(service, reference_generate):
    requests = [(prompt, k) for prompt in PROMPTS for k in (1, 4)] * 2
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda pk: service.stub.Generate(greedy_request(*pk)), requests))
    for (prompt, _), response in zip(requests, results):
        assert list(response.token_ids) == reference_generate(prompt, MAX_NEW)
        check_round_accounting(list(response.token_ids), response.stats, response.finish_reason)


def test_health_serving_and_reflection(service):
    channel = grpc.insecure_channel(service.address)
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(service="")).status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    answer = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in answer.list_services_response.service}
    assert {"specpool.v1.Generation", "grpc.health.v1.Health"} <= names
    channel.close()


def test_text_prompt_and_stop_tokens(service, reference_generate, byte_pair):
    from router.text import load_tokenizer
    prompt_text = "Hello"
    expected = reference_generate(load_tokenizer(byte_pair[1]).encode(prompt_text).ids, MAX_NEW)
    response = service.stub.Generate(generation_pb2.GenerateRequest(prompt=prompt_text, max_new_tokens=MAX_NEW))
    assert list(response.token_ids) == expected
    stop = expected[5]
    response = service.stub.Generate(generation_pb2.GenerateRequest(prompt=prompt_text, max_new_tokens=MAX_NEW,
                                                                    stop_token_ids=[stop]))
    assert list(response.token_ids) == expected[:expected.index(stop) + 1]
    assert response.finish_reason == generation_pb2.FINISH_REASON_STOP
    check_round_accounting(list(response.token_ids), response.stats, response.finish_reason)


@pytest.fixture(scope="module")
def self_drafted(start_service, byte_pair):
    """The target drafting for itself: every draft and guess is right, so nearly every round's drafts come from
    the previous round's pre-draft (the byte pair's own draft rarely agrees with its target)."""
    return start_service(service_config((byte_pair[1], byte_pair[1]), speculation={"k": 3, "overlap": True}))


@pytest.mark.parametrize("k", [1, 4])
def test_overlapped_rounds_that_hit_stay_identical_to_target_generate(self_drafted, reference_generate, k):
    for prompt in PROMPTS:
        tokens, chunks = stream_tokens(self_drafted.stub, greedy_request(prompt, k))
        stats = chunks[-1].stats
        assert tokens == reference_generate(prompt, MAX_NEW)
        check_round_accounting(tokens, stats, chunks[-1].finish_reason, chunks)
        assert stats.predrafts >= stats.predraft_hits >= stats.target_passes - 3 > 0, stats


SHARED = [(7 * i + 3) % 250 for i in range(40)]         # 2 blocks of 16 tokens and 8 more


def test_prompts_sharing_a_prefix_reuse_it_and_stay_identical_to_target_generate(service, reference_generate):
    """After one request with the shared prefix, requests whose prompts begin with it find its first blocks in both
    pools' prefix caches (concurrently, with sessions evicted and re-prefilled under max_sessions = 2), and their
    tokens are still the target's own."""
    prompts = [SHARED + [1, 2, 3], SHARED + [9], SHARED[:20] + [5] * 10]
    metric = service.service.router.metrics.registry.get_sample_value
    hits_before = metric("specpool_prefix_cache_hits_total", {"pool": "target"}) or 0
    first = service.stub.Generate(greedy_request(prompts[0], 3))
    assert list(first.token_ids) == reference_generate(prompts[0], MAX_NEW)
    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda p: service.stub.Generate(greedy_request(p, 3)), prompts * 2))
    for prompt, response in zip(prompts * 2, responses):
        assert list(response.token_ids) == reference_generate(prompt, MAX_NEW), prompt
        cached = 16 if prompt is prompts[2] else 32
        assert response.stats.cached_prompt_tokens == cached
        assert response.stats.target_prefix_cache.found >= cached
        assert response.stats.target_prefix_cache.looked_up >= len(prompt)
        assert response.stats.draft_prefix_cache.found >= cached
    found = sum(r.stats.target_prefix_cache.found for r in [first, *responses])
    assert metric("specpool_prefix_cache_hits_total", {"pool": "target"}) - hits_before == found
