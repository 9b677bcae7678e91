"""The CUDA path (run on a GPU machine; skipped where there is none): the engines alone (float32, and bfloat16 up
to the dtype's ties), structured output and prompt logprobs, then the whole stack (router, Ray actors, gRPC)
serving from CUDA, at TP 1 on one GPU and at TP 2 over NCCL where there are two, with each proposal source.

    python -m pytest -q tests/test_cuda_engines.py
"""
import contextlib
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from protos.specpool.v1 import generation_pb2, worker_pb2
from tests.conftest import pair_engines, service_config
from tests.engine_rounds import run_rounds
from tests.test_low_precision import assert_ties_only
from tests.test_prefill_chunks import start
from tests.test_prompt_logprobs import CODE, TOP, assert_alones, whole
from tests.test_structured_output import POINT, assert_schema_greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEMO = Path(__file__).resolve().parent.parent / "deploy" / "models" / "demo-pair"
DEMO_PAIR = (str(DEMO / "draft"), str(DEMO / "target"))


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


@pytest.fixture(scope="module")
def demo_on_cuda():
    """The demo pair's engines on CUDA (a real BPE vocabulary, drafts that are accepted), its target alone there
    and its tokenizer."""
    from transformers import AutoTokenizer
    return (*pair_engines(DEMO_PAIR, device="cuda"), AutoTokenizer.from_pretrained(DEMO_PAIR[1]))


def test_structured_greedy_on_cuda_is_the_target_alones_under_the_schema(demo_on_cuda):
    """The grammar's mask applied to logits on the GPU, in the target's rows and the draft's."""
    assert_schema_greedy(*demo_on_cuda, 4)


def test_prompt_logprobs_on_cuda_are_the_target_alones(demo_on_cuda):
    _, target, model, tokenizer = demo_on_cuda
    prompt = tokenizer(CODE).input_ids
    assert_alones(whole(target, start(77, 0.0, prompt=prompt, prompt_length=len(prompt), prompt_logprobs=TOP)),
                  model, prompt)
    target.release(77)


@pytest.mark.parametrize("k", [1, 4])
def test_bfloat16_on_cuda_differs_from_the_target_alone_only_at_ties(k):
    """As tests/test_low_precision.py checks on the CPU: a difference from plain decoding in bfloat16 is a tie
    within one ulp, with the GPU's kernels for a verify pass and for a one-token pass."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draft_worker.proposer import DraftEngine
    from target_worker.verifier import TargetEngine
    draft, target = DEMO_PAIR
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16).cuda().eval()
    assert_ties_only("bfloat16", AutoTokenizer.from_pretrained(target), model,
                     DraftEngine(draft, dtype="bfloat16", device="cuda"),
                     TargetEngine(target, draft, dtype="bfloat16", draft_dtype="bfloat16", device="cuda"), k)


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


def test_ngram_and_model_plus_ngram_on_one_gpu_are_identical_to_the_target_alone(ray_local, byte_pair,
                                                                                 cuda_reference):
    """Prompt lookup on the GPU target (draft.method ngram: the target looks its drafts up itself), and each
    round's choice of source (model+ngram), hot-reloaded on a service with a draft pool."""
    with serving(on_cuda(byte_pair)) as service:
        for method in ("model+ngram", "ngram"):
            service.reload_draft_method(method)
            assert all_at_once(service.stub, 4) == cuda_reference, method


def test_structured_output_and_logprobs_through_the_stack_on_one_gpu_are_independent_of_k(ray_local):
    """On the demo pair, a JSON-schema request with logprobs and prompt logprobs, batched beside plain ones: its
    tokens and both logprobs are the same at K = 4 as at K = 0 (plain decoding on the GPU), and it is the schema's
    JSON."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(DEMO_PAIR[1])
    structured = generation_pb2.GenerateRequest(
        prompt_token_ids=tokenizer("x = ").input_ids, max_new_tokens=48, logprobs=2, prompt_logprobs=2,
        structured_output=generation_pb2.StructuredOutput(json_schema=json.dumps(POINT)))
    plain = [generation_pb2.GenerateRequest(prompt_token_ids=tokenizer(CODE).input_ids[:n], max_new_tokens=32)
             for n in (12, 30)]

    def answers(stub, k: int) -> list:
        for request in (structured, *plain):
            request.speculation.k = k
        with ThreadPoolExecutor(3) as pool:
            return list(pool.map(lambda request: stub.Generate(request, timeout=300), (structured, *plain)))

    def logprobs(entries) -> torch.Tensor:
        return torch.tensor([entry.logprob for entry in entries])
    with serving(on_cuda(DEMO_PAIR)) as service:
        at = {k: answers(service.stub, k) for k in (0, 4)}
    for one, other in zip(at[0], at[4]):
        assert list(one.token_ids) == list(other.token_ids)
    for field in ("logprobs", "prompt_logprobs"):
        assert torch.allclose(logprobs(getattr(at[0][0], field)), logprobs(getattr(at[4][0], field)), atol=1e-4)
    value = json.loads(tokenizer.decode(list(at[4][0].token_ids), skip_special_tokens=True))
    assert set(value) == {"name", "n"}


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
