"""Running out of device memory is one request's failure, not the worker's. The forward that could not allocate fails
its row alone: engine.batching.run_isolated releases the allocator's cached blocks and runs the batch again row by
row, and the call answers RESOURCE_EXHAUSTED saying what to change (engine.worker_server), the worker serving on.

    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")  ->  RESOURCE_EXHAUSTED, described()
"""
from __future__ import annotations

import torch

ADVICE = ("fewer concurrent requests, a shorter prompt or max_new_tokens, or a smaller max_sessions or "
          "prefix_cache_tokens for the pool leave it more")


def exhausted(exc: BaseException) -> bool:
    """Whether `exc` is an allocation that the device (or the host, on the CPU) could not make."""
    return isinstance(exc, torch.OutOfMemoryError)


def release_cached() -> None:
    """Hand the CUDA allocator's cached, unused blocks back, so that what runs next has them."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def described(exc: BaseException) -> str:
    """The status message of a call that ran out of memory: torch's first line, and what leaves more."""
    first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    return f"out of device memory for this request ({first.strip()}); {ADVICE}"
