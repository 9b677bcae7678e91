"""The family matrix through the whole stack (Ray, gRPC, router, TP group), in one Ray instance: a hybrid model
(Gemma3: sliding and global layers) at TP 2 and K 3, Mistral with a sliding window at TP 1 and K 1, and Qwen3-Next
(linear-attention layers with a recurrent state, rolled back to checkpoints) at TP 1 and K 3, serve concurrent
short and long requests, the long ones many times past their 8-token window, each identical to the target alone;
a model with no TP plan is refused at start-up in
one line and leaves Ray and its resources as they were. The other families run at engine level in
tests/test_model_families.py."""
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray

from protos.specpool.v1 import generation_pb2
from router.service import Service
from target_worker.tp_support import ModelRefused
from tests.conftest import service_config
from tests.model_families import RECURRENT, reference

MAX_NEW = 16


def test_a_model_with_no_tp_plan_is_refused_and_ray_keeps_running(ray_local, family_models):
    import asyncio

    draft, target = family_models["gpt2"]
    config = service_config((draft, target), target={"tensor_parallel_size": 2})
    from settings.schema import config_from_dict
    with pytest.raises(ModelRefused) as refused:
        asyncio.run(Service(config_from_dict(config)).start())
    assert str(refused.value) == (f"target model {target!r} cannot be served at tensor_parallel_size 2: "
                                  "GPT2LMHeadModel has no tensor-parallel plan in transformers")
    assert ray.is_initialized() and ray.get(ray.put(1)) == 1
    assert not [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]


@pytest.fixture(scope="module", params=[("gemma3-hybrid", 2, 3), ("mistral-sliding", 1, 1),
                                        ("qwen3-next-linear", 1, 3)],
                ids=["gemma3-hybrid-tp2-k3", "mistral-sliding-tp1-k1", "qwen3-next-linear-tp1-k3"])
def sliding_service(request, start_service, family_models):
    family, tp, k = request.param
    return family, start_service(service_config(family_models[family], target={"tensor_parallel_size": tp},
                                                speculation={"k": k}))


def test_sliding_models_batch_short_and_long_requests_identically(sliding_service, family_models):
    """The issue's case: three 5-token requests batched with a long one (windows of 8), twice over: none fails,
    each is identical to the target alone. The long one's 200 tokens run past the 167 columns a sliding layer holds
    (engine.cache_layers: the window and the default rollback of 160), so its sliding layers drop columns."""
    family, service = sliding_service
    prompts = [[11, 12, 13, 14, 15], [40, 41, 42, 43, 44], [7] * 5, [(5 * i) % 250 for i in range(200)]] * 2
    expected = reference(family_models[family][1], prompts, MAX_NEW)
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: service.stub.Generate(
            generation_pb2.GenerateRequest(prompt_token_ids=p, max_new_tokens=MAX_NEW)), prompts))
    for answer, tokens, prompt in zip(answers, expected, prompts):
        assert list(answer.token_ids) == (tokens[:tokens.index(256) + 1] if 256 in tokens else tokens)
        assert answer.stats.draft_tokens > 0
        if family in RECURRENT:     # the target started the session once: its rollbacks went to checkpoints (a
            assert answer.stats.target_prefix_cache.looked_up == len(prompt)    # re-prefill looks the context up)
