"""Predicted Outputs (OpenAI's `prediction`; GenerateRequest.prediction): the output a request expects, such as the
file it is editing. Prompt lookup copies drafts from it as well as from the context (engine/ngram.py), so where the
output follows it the target verifies long runs of drafts in one pass; the output is exactly what it would be
without it. A request with a prediction drafts from the draft model and from lookup (model+ngram) where the pool's
method is the model alone, and its statistics are kept apart from other requests' (router.k_selection.regime).

A prediction that proves useless is dropped (PredictionTrial): the request then drafts from the draft model and
its own context, and its rounds count towards the plain regimes again.

    ids = await prediction_ids(request, tokenizer, limits)     # [] without one; RequestError naming the field
    accepted, rejected = prediction_usage(ids, output_ids)     # OpenAI's completion_tokens_details (count_prediction)
    trial = trial_for(ids, fixed_k, rounds)                    # per request; KSelector.observe asks useless()
"""
from __future__ import annotations

import asyncio
import difflib
import functools
from dataclasses import dataclass, field

from protos.specpool.v1 import generation_pb2
from router.k_selection import Delivered
from router.request_state import Round
from router.text import encode
from router.validation import ModelLimits, RequestError, check_token_ids


INLINE_TOKENS = 1024     # a prediction and an output this short are compared on the event loop (about 1 ms here)
TRIAL_WINDOW = 16        # a trial weighs each kind of round over about its last this many, at least


@dataclass
class PredictionTrial:
    """Whether a request's prediction is worth drafting from, judged on the request's own rounds, since what the
    predicted regimes' statistics learn mixes good predictions with bad. A useless prediction (one the output does
    not follow) still yields chance n-gram matches, drafted at the predicted regime's long K and nearly all
    rejected (a shuffled one cost a heavy-pair request 0.87x in session 49's run, 0.95-1.01x in later ones: README,
    Predicted outputs). So the trial keeps what the request's rounds that drafted from the prediction have delivered
    (committed tokens per second of their wall time) and what its other rounds have (the draft model's, lookups in
    its own context, plain decoding), each over about its last `window` rounds, measured side by side as the
    request runs. Once both have `rounds` rounds behind them (draft.prediction_trial_rounds), a prediction whose
    rounds delivered less is useless. A prediction the output follows drafts nearly every round and delivers far
    more, so it is never judged, or kept. The request's first round (its prefill) counts towards neither."""
    rounds: int                 # draft.prediction_trial_rounds (> 0)
    predicted: Delivered = field(default_factory=Delivered)
    other: Delivered = field(default_factory=Delivered)
    started: bool = False       # the first round has been seen

    @functools.cached_property
    def window(self) -> int:
        """The rounds each side's delivery is weighed over (Delivered's window): TRIAL_WINDOW, or 2 x `rounds`."""
        return max(TRIAL_WINDOW, 2 * self.rounds)

    @functools.cached_property
    def weight(self) -> float:
        """The weight (Delivered.rounds) of `rounds` rounds."""
        return self.window * (1 - (1 - 1 / self.window) ** self.rounds)

    def useless(self, round_: Round) -> bool:
        """Count one of the request's rounds (router.request_state.Round, `predicted` where its drafts were copied
        from the prediction); whether the prediction has now proved useless."""
        first, self.started = not self.started, True
        if first or not round_.parts:
            return False
        kind = self.predicted if round_.predicted else self.other
        kind.add(len(round_.committed), sum(round_.parts.values()), self.window)
        judged = min(self.predicted.rounds, self.other.rounds) >= self.weight - 1e-9
        return judged and self.predicted.rate < self.other.rate


async def prediction_ids(request: generation_pb2.GenerateRequest, tokenizer, limits: ModelLimits) -> list[int]:
    """The request's prediction as token IDs (text encoded as the output would be written: no special tokens added,
    off the event loop when long), checked: not both forms, in the vocabulary, at most the model's context."""
    if request.prediction and request.prediction_token_ids:
        raise RequestError("prediction", "set prediction or prediction_token_ids, not both")
    limit = limits.max_context
    if request.prediction:
        if limit and limits.max_token_chars and len(request.prediction) > limit * limits.max_token_chars:
            raise RequestError("prediction", f"{len(request.prediction)} characters is over the limit of {limit} "
                               f"tokens (a token here is at most {limits.max_token_chars} characters)")
        ids = await encode(tokenizer, request.prediction, special=False)
        field = "prediction"
    else:
        ids, field = list(request.prediction_token_ids), "prediction_token_ids"
    if limit and len(ids) > limit:
        raise RequestError(field, f"{len(ids)} tokens is over the model's context of {limit}")
    check_token_ids(field, ids, limits.vocab_size)
    return ids


def method_for(method: str, prediction: list[int], fixed_k: int | None) -> str:
    """draft.method for a request: model+ngram where the pool drafts with the model alone and the request predicts
    its output (so lookup may copy from the prediction); the pool's otherwise, and for a request at K = 0, which
    drafts nothing (a plain run to its end)."""
    return "model+ngram" if prediction and method == "model" and fixed_k != 0 else method


def trial_for(prediction: list[int], fixed_k: int | None, rounds: int) -> PredictionTrial | None:
    """A request's PredictionTrial of `rounds` (draft.prediction_trial_rounds): none without a prediction, where
    `rounds` is 0, or for a request with its own K, whose drafts follow a rule of its tokens alone (so that a seeded
    request in sampled-draft mode gives one output; a trial's verdict depends on timing)."""
    return PredictionTrial(rounds) if prediction and rounds and fixed_k is None else None


def prediction_usage(prediction: list[int], output: list[int]) -> tuple[int, int]:
    """(accepted, rejected) prediction tokens: those of the prediction that appear in the output, in order (the
    matching blocks difflib finds), and the others."""
    if not prediction:
        return 0, 0
    accepted = sum(block.size for block in difflib.SequenceMatcher(None, prediction, output).get_matching_blocks())
    return accepted, len(prediction) - accepted


async def count_prediction(state) -> None:
    """A finished request's accepted and rejected prediction tokens, into its stats (before its last answer goes
    out: router.stopping.output_chunks); compared on a thread when long (4,000 tokens each: 6 ms here)."""
    if not state.prediction:
        return
    work = functools.partial(prediction_usage, list(state.prediction), state.tokens[state.prompt_len:])
    inline = len(state.prediction) + state.generated <= INLINE_TOKENS
    counts = work() if inline else await asyncio.to_thread(work)
    state.stats.accepted_prediction_tokens, state.stats.rejected_prediction_tokens = counts
