"""The transformers baselines specpool is measured against, in process on the same pair: generate() of the
target alone, assisted generation with the draft at a fixed K, left-padded batches of prompts, and the time
of one single-token forward (for c = t_draft / t_target).

    python -m benchmarks.speedup --quick   # its "transformers ..." rows and sweep column come from here
"""
from __future__ import annotations

import statistics
import time

import torch


def load_hf(path: str, device: str = "cpu", dtype: str = "float32"):
    """(model in eval mode on `device` in `dtype`, tokenizer padding on the left) of the Hugging Face folder or hub ID
    `path`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return model.to(device).eval(), tokenizer


def synchronize(device) -> None:
    """Wait for the device's queued work (a no-op on the CPU), so that a host clock read after it is honest."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class TokenClock:
    """A generate() streamer that stamps each put() of new tokens (the first put() is the prompt), so
    transformers rows get time to first token and inter-token latency like the specpool rows."""

    def __init__(self):
        self.started, self.arrivals = time.perf_counter(), []

    def put(self, value) -> None:
        self.arrivals.append((time.perf_counter(), value.numel()))

    def end(self) -> None:
        pass

    def run(self) -> dict:
        """{"ttft", "itl", "waits"} in stream_one's format (an assisted round's tokens arrive together)."""
        times = [t for t, _ in self.arrivals[1:]]
        gaps = [(b - a) / n for (a, _), (b, n) in zip(self.arrivals[1:], self.arrivals[2:]) for _ in range(n)]
        waits = [b - a for (a, _), (b, _) in zip(self.arrivals[1:], self.arrivals[2:])]
        return {"ttft": times[0] - self.started if times else 0.0, "itl": gaps, "waits": waits}


def assisted_kwargs(assistant, k: int) -> dict:
    """generate() keyword arguments for assisted generation with exactly `k` draft tokens per round."""
    assistant.generation_config.num_assistant_tokens = k
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.assistant_confidence_threshold = 0.0
    return {"assistant_model": assistant}


@torch.inference_mode()
def hf_run(target, tokenizer, batches, max_new: int, assistant=None, k: int = 0,
           clocks: list | None = None, generate_kwargs: dict | None = None) -> tuple[float, int]:
    """(seconds, new tokens) of generate() over batches of prompts (left-padded), greedy; assisted
    (batches of one prompt only) when `assistant` is given. With `clocks` (batches of one prompt), a
    TokenClock per generate() is appended to it. `generate_kwargs` go to generate() as they are (e.g.
    prompt_lookup_num_tokens)."""
    kwargs = assisted_kwargs(assistant, k) if assistant is not None else {}
    kwargs.update(generate_kwargs or {})
    started, tokens = time.perf_counter(), 0
    for batch in batches:
        inputs = tokenizer(batch, return_tensors="pt", padding=True).to(target.device)
        if clocks is not None:
            clocks.append(TokenClock())
            kwargs["streamer"] = clocks[-1]
        out = target.generate(**inputs, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, **kwargs)
        tokens += out[:, inputs.input_ids.shape[1]:].numel()
    synchronize(target.device)
    return time.perf_counter() - started, tokens


@torch.inference_mode()
def forward_seconds(model, context: int = 64, steps: int = 20, tokens: int = 1) -> float:
    """Median time of one decoding step over `tokens` new tokens (a verify pass of tokens - 1 drafts) with a KV
    cache of `context` tokens."""
    from transformers import DynamicCache

    from engine.modeling import cache_keyword
    cache, keyword = DynamicCache(config=model.config), cache_keyword(type(model))
    model(torch.zeros(1, context, dtype=torch.long, device=model.device), **{keyword: cache}, use_cache=True)
    times = []
    for _ in range(steps):
        synchronize(model.device)
        started = time.perf_counter()
        model(torch.zeros(1, tokens, dtype=torch.long, device=model.device), **{keyword: cache}, use_cache=True)
        synchronize(model.device)
        times.append(time.perf_counter() - started)
        cache.crop(-tokens)
    return statistics.median(times)
