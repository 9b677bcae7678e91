"""Prompt logprobs (GenerateRequest.prompt_logprobs; a completion's `echo` with `logprobs`): the target's raw
log_softmax at each prompt position, equal to the target alone's forward over the prompt, whether the prompt is
one forward or chunks, batched beside another session's round, with drafts in the start call, and in a decode run;
the verdicts and later rounds are those of a start that does not ask. The whole stack is in
tests/test_openai_http.py (echo) and below (gRPC)."""
import asyncio
from pathlib import Path

import pytest
import torch

from engine import prefill_chunks
from protos.specpool.v1 import generation_pb2, worker_pb2
from target_worker.server import TargetServicer
from target_worker.verifier import TargetEngine
from tests.test_prefill_chunks import start

TOP = 3
DEMO = Path(__file__).resolve().parent.parent / "deploy" / "models" / "demo-pair"
CODE = ("import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path, mode):\n        self.path = path\n"
        "        self.mode = mode\n\n    def read(self):\n        with open(self.path) as f:\n")


def whole(engine: TargetEngine, request) -> worker_pb2.VerifyResponse:
    """The call's answer, its chunks one after another as the servicer submits them (the start's lookup on it)."""
    async def submit(call):
        return engine.verify(call)
    return asyncio.run(prefill_chunks.whole(submit, request))


def rank_bounds(logprobs: torch.Tensor,     # [n, vocab]
                chosen: torch.Tensor,       # [n, 1]
                atol: float = 1e-4) -> tuple[list[int], list[int]]:
    """The ranks (tokens at least as likely) each chosen token may have where another computation of the logprobs
    differs by up to atol: a token that close to its own logprob may fall on either side of it."""
    return ((logprobs > chosen + atol).sum(-1) + 1).tolist(), (logprobs >= chosen - atol).sum(-1).tolist()


def alone(model, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor, tuple[list[int], list[int]]]:
    """The target alone's logprobs of prompt tokens 1.. given those before, its top-TOP ids there, and each prompt
    token's rank bounds (computed on the model's device, returned on the host)."""
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompt], device=model.device)).logits[0, :-1].float(), -1)
    chosen = logprobs.gather(-1, torch.tensor(prompt[1:], device=model.device).view(-1, 1))
    return chosen.squeeze(-1).cpu(), logprobs.topk(TOP, -1).indices.cpu(), rank_bounds(logprobs, chosen)


def assert_alones(answer, model, prompt: list[int]) -> None:
    chosen, top, (low, high) = alone(model, prompt)
    entries = answer.prompt_logprobs
    assert [e.token_id for e in entries] == prompt[1:]
    assert torch.allclose(torch.tensor([e.logprob for e in entries]), chosen, atol=1e-4)
    assert [[t.token_id for t in e.top] for e in entries] == top.tolist()
    assert all(a <= e.rank <= b for e, a, b in zip(entries, low, high)) and max(low) > TOP   # some outside the top


@pytest.fixture(scope="module")
def demo():
    """(the target alone, the prompt's token IDs, the target alone's next 4 greedy tokens): its drafts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(DEMO / "target").eval()
    prompt = AutoTokenizer.from_pretrained(DEMO / "target")(CODE).input_ids
    with torch.no_grad():
        greedy = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)[0, len(prompt):].tolist()
    return model, prompt, greedy


def engine(chunk: int = 0, prefix: int = 0) -> TargetEngine:
    return TargetEngine(str(DEMO / "target"), str(DEMO / "draft"), prefix_cache_tokens=prefix,
                        prefill_chunk_tokens=chunk)


def verdicts(target: TargetEngine, answer, prompt: list[int], drafts: list[int]) -> list[tuple]:
    """The start's verdict and two more rounds' (each with the drafts that follow the committed token)."""
    seen, position = [(answer.num_accepted, answer.next_token_id)], len(prompt) + answer.num_accepted
    for _ in range(2):
        answer = target.verify(worker_pb2.VerifyRequest(session_id=1, position=position, draft_token_ids=drafts,
                                                        new_token_ids=[answer.next_token_id]))
        seen.append((answer.num_accepted, answer.next_token_id))
        position += 1 + answer.num_accepted
    return seen


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "seeded-sampled"])
@pytest.mark.parametrize("chunk, prefix", [(0, 0), (32, 0), (32, 1024)], ids=["one-forward", "chunks", "cached"])
def test_prompt_logprobs_are_the_target_alones_and_leave_the_verdicts_as_they_were(demo, chunk, prefix, temperature):
    """With the target alone's own next tokens as drafts in the start call: prompt logprobs equal the target alone's
    (to 1e-4, top alternatives the same), and the verdict (greedy: every draft accepted) and two more rounds are
    those of the same start not asking. With the prefix cache holding the prompt (`cached`), a start that asks
    computes it anyway."""
    model, prompt, greedy = demo
    asking, plain = engine(chunk, prefix), engine(chunk, prefix)
    if prefix:
        whole(asking, start(9, 0.0, prompt=prompt, prompt_length=len(prompt)))        # the prompt now cached
    call = dict(prompt=prompt, draft_token_ids=greedy[:3], prompt_length=len(prompt))
    asked = whole(asking, start(1, temperature, prompt_logprobs=TOP, **call))
    expected = whole(plain, start(1, temperature, **call))
    assert_alones(asked, model, prompt)
    assert verdicts(asking, asked, prompt, greedy[:2]) == verdicts(plain, expected, prompt, greedy[:2])
    assert temperature or expected.num_accepted == 3
    assert not expected.prompt_logprobs and asked.prefix_cache.found == 0
    assert asked.prefix_cache.looked_up == 0 and expected.prefix_cache.looked_up == len(prompt)   # not a miss


def test_a_batched_start_answers_its_own_prompts_logprobs(demo):
    """Two session starts in one forward, prompts of different lengths, one asking: its prompt logprobs are its
    own, and the other's verdict is what it gets alone."""
    model, prompt, greedy = demo
    target, short = engine(), prompt[:20]
    both = target.verify_batch([start(1, 0.0, prompt=prompt, prompt_length=len(prompt), prompt_logprobs=TOP,
                                      draft_token_ids=greedy[:3]),
                                start(2, 0.0, prompt=short, prompt_length=len(short), draft_token_ids=[5, 6])])
    assert target.stats.forward_passes == 1
    assert_alones(both[0], model, prompt)
    assert both[0].num_accepted == 3
    other = engine().verify(start(2, 0.0, prompt=short, prompt_length=len(short), draft_token_ids=[5, 6]))
    assert (both[1].num_accepted, both[1].next_token_id) == (other.num_accepted, other.next_token_id)
    assert not both[1].prompt_logprobs


def test_a_decode_run_that_starts_asking_answers_them_first_and_commits_what_it_would(demo):
    model, prompt, _ = demo

    async def run(**asked):
        answers = []
        servicer = TargetServicer(engine(chunk=32), 1)
        last = await servicer._submit(start(1, 0.9, prompt=prompt, decode_steps=8, prompt_length=len(prompt),
                                            **asked), answers.append)
        return answers + [last]
    asked, plain = asyncio.run(run(prompt_logprobs=TOP)), asyncio.run(run())
    assert [a.next_token_id for a in asked] == [a.next_token_id for a in plain]
    assert_alones(asked[0], model, prompt)
    assert not any(a.prompt_logprobs for a in asked[1:])


def test_the_router_refuses_more_than_twenty_alternatives():
    from router.validation import RequestError, check_outputs
    check_outputs(generation_pb2.GenerateRequest(prompt_logprobs=20))
    with pytest.raises(RequestError, match=r"^prompt_logprobs: must be <= 20 \(got 21\)$"):
        check_outputs(generation_pb2.GenerateRequest(prompt_logprobs=21))
