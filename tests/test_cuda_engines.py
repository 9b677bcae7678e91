"""The CUDA path (run on a GPU machine; skipped where there is none): the engines alone, then the whole stack
(router, Ray actors, gRPC) serving from CUDA, at TP 1 on one GPU and at TP 2 over NCCL where there are two.

    python -m pytest -q tests/test_cuda_engines.py
"""
import contextlib
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from protos.specpool.v1 import generation_pb2, worker_pb2
from tests.conftest import service_config
from tests.engine_rounds import run_rounds

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def cuda_engines(byte_pair):
    from draft_worker.proposer import DraftEngine
    from target_worker.verifier import TargetEngine
    return (DraftEngine(byte_pair[0], device="cuda"), TargetEngine(byte_pair[1], byte_pair[0], device="cuda"))


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_on_cuda_matches_target_generate(cuda_engines, byte_pair, k):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(byte_pair[1]).cuda().eval()
    prompt = [5, 6, 7, 8, 9]
    expected = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=20, do_sample=False)
    got = run_rounds(*cuda_engines, prompt, k, 20, generation_pb2.SamplingParams(top_p=1.0, seed=1),
                     worker_pb2.DRAFT_MODE_GREEDY)
    assert got == expected[0, len(prompt):].tolist()


def test_sampled_draft_on_cuda_is_seed_deterministic(cuda_engines):
    sampling = generation_pb2.SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=3)
    runs = [run_rounds(*cuda_engines, [1, 2, 3], 3, 16, sampling, worker_pb2.DRAFT_MODE_SAMPLED) for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 16


# ---- the whole stack on CUDA ----------------------------------------------------------------------
PROMPTS = [[72, 101, 108, 108, 111], [10, 200, 3, 77, 150, 42, 9, 1, 2, 3, 4], [33]]
MAX_NEW = 24


@pytest.fixture(scope="module")
def cuda_reference(byte_pair):
    """Greedy transformers generate() of the target alone on CUDA, per prompt (cut after EOS)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(byte_pair[1]).cuda().eval()
    eos = model.generation_config.eos_token_id
    expected = {}
    for prompt in PROMPTS:
        out = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=MAX_NEW, do_sample=False)
        tokens = out[0, len(prompt):].tolist()
        expected[tuple(prompt)] = tokens[:tokens.index(eos) + 1] if eos in tokens else tokens
    return expected


def on_cuda(byte_pair, tp: int = 1) -> dict:
    """Both pools on one GPU (half each), or at TP 2 a GPU per target rank and the draft on the CPU."""
    gpu = {"device": "cuda", "num_gpus": 0.5 if tp == 1 else 1.0, "max_batch_size": 4}
    draft = gpu if tp == 1 else {"max_batch_size": 4}
    return service_config(byte_pair, draft=draft, target={**gpu, "tensor_parallel_size": tp}, speculation={"k": 4})


SEEDED = generation_pb2.SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=11)


def all_at_once(stub, k: int, sampling: generation_pb2.SamplingParams | None = None) -> dict:
    """Every prompt at once (so that the workers batch them) at K = k, greedy unless `sampling`: prompt -> tokens."""
    def one(prompt):
        request = generation_pb2.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=MAX_NEW, sampling=sampling)
        request.speculation.k = k
        return tuple(prompt), list(stub.Generate(request, timeout=300).token_ids)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return dict(pool.map(one, PROMPTS))


@contextlib.contextmanager
def serving(config: dict):
    """A service from `config`, stopped (its GPUs given back to Ray) when the block ends."""
    from tests.conftest import RunningService
    service = RunningService(config)
    try:
        yield service
    finally:
        service.stop()


def test_service_on_one_gpu_is_identical_to_the_target_alone(ray_local, byte_pair, cuda_reference):
    with serving(on_cuda(byte_pair)) as service:
        for overlap in (False, True):
            service.reload(speculation={"overlap": overlap})
            for k in (0, 4):
                assert all_at_once(service.stub, k) == cuda_reference, (overlap, k)
            # a greedy draft's verification draws what plain decoding draws: seeded tokens independent of K
            assert all_at_once(service.stub, 4, SEEDED) == all_at_once(service.stub, 0, SEEDED), overlap


def test_sampled_draft_service_on_one_gpu_is_seed_deterministic(ray_local, byte_pair):
    """Sampled drafts ship their hidden states from the GPU, and the target recomputes q on its own."""
    with serving(on_cuda(byte_pair)) as service:
        service.reload(speculation={"draft_sampling": "sampled"})
        runs = [all_at_once(service.stub, 4, SEEDED) for _ in range(2)]
        assert runs[0] == runs[1] and all(runs[0].values())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="TP 2 over NCCL needs two GPUs")
def test_service_at_tp2_over_nccl_is_identical_to_the_target_alone(ray_local, byte_pair, cuda_reference):
    with serving(on_cuda(byte_pair, tp=2)) as service:
        assert all_at_once(service.stub, 4) == cuda_reference
