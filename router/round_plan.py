"""Planning a request's next round: its proposal source and K (plan_round), whether it is a decode run instead
(run_plan), and the overlap choices made before it (prefill_alone, predraft_k).

Proposal sources (`draft.method`). A round's drafts come from the draft model (the draft worker) or from prompt
lookup (engine/ngram.py: the continuation of an earlier occurrence of the context's last n tokens, computed in
the router with no call, or by the target itself in a decode run). An n-gram proposal is deterministic, so it is
verified exactly as a greedy draft (q one-hot: no hidden states travel, and the target verifies any request whose
drafts come without them that way, whatever the pool's draft mode). With `model+ngram` the policy picks, each
round that has a match, the source its statistics model faster; n-gram rounds send no pre-draft. A model+ngram
request may run on prompt lookup alone, where that has delivered more than both sources together (KSelector). While
the draft worker is unreachable, rounds use n-gram proposals where the context has a match (instead of plain
decoding).
"""
from __future__ import annotations

from engine.ngram import Match
from protos.specpool.v1 import worker_pb2
from router.request_state import MODEL, NGRAM, KPolicy, Proposal, RequestState, clamp_k
from router.worker_client import DraftClient


PLAIN_PROBE_STEPS = 4   # the tokens of a decode run that probes plain decoding while the draft model holds K > 0


def choose_k(state: RequestState, policy: KPolicy, source: int = MODEL) -> int:
    return state.fixed_k if state.fixed_k is not None else policy.choose_k(state, source)


def plan_round(state: RequestState, draft: DraftClient | None, policy: KPolicy,
               planned: int | None = None) -> tuple[int, int]:
    """This round's proposal source (planned_source) and K. `planned`: a model K already chosen."""
    # a request that fell back to prompt lookup: its rounds count towards no delivery (KSelector)
    state.fell_back |= state.method != "ngram" and not state.lookup_alone and not model_allowed(state, draft)
    source = planned_source(state, draft, policy)
    if source is None:
        return (MODEL if state.method != "ngram" else NGRAM), 0
    k = planned if source == MODEL and planned is not None else choose_k(state, policy, source)
    return source, clamp_k(state, k)


def planned_source(state: RequestState, draft: DraftClient | None, policy: KPolicy) -> int | None:
    """The proposal source a round planned now takes, None where there is none. Candidates: the draft model
    (methods model and model+ngram, while the draft worker is reachable) and prompt lookup (methods ngram and
    model+ngram, or as the fallback while the draft worker is not), when the context's suffix occurred before."""
    found = state.ngram.match(state.tokens) if lookup_allowed(state, draft) else None
    candidates = [s for s, ok in ((MODEL, model_allowed(state, draft)), (NGRAM, found is not None)) if ok]
    if not candidates:
        return None
    # A request with its own K takes n-gram drafts whenever they match: a rule that depends only on the tokens
    # (and on whether the draft worker is up), so a seeded request in sampled-draft mode (whose K is pinned for
    # that reason) gives one output while its draft worker serves.
    pick = len(candidates) > 1 and state.fixed_k is None
    return policy.choose_source(state, candidates, found.size) if pick else candidates[-1]


def lookup_first(state: RequestState, draft: DraftClient | None, policy: KPolicy) -> bool:
    """Whether a round that a pre-draft hit makes a model round would have been planned on prompt lookup
    (planned_source). Such a round pre-drafts nothing, so that the next one is planned again: otherwise each
    pre-draft hit chains the request to the draft model, as an exact prediction was for six rounds after one round
    that measured the draft model (3 tokens a pass instead of 32)."""
    return planned_source(state, draft, policy) == NGRAM


def ngram_round_k(state: RequestState, policy: KPolicy, k: int) -> int:
    """K of an n-gram round the router drafts itself: at most the drafts the policy finds worth proposing after
    a match as long as the one at hand, as a decode run's lookup drafts (KPolicy.match_k; none on its probe). A
    request with its own K drafts up to it after any match."""
    found = state.ngram.match(state.tokens)
    if state.fixed_k is not None or found is None:
        return k
    return policy.match_k(state, found.size, k)


def model_allowed(state: RequestState, draft: DraftClient | None) -> bool:
    """Whether rounds may take the draft model's drafts: methods model and model+ngram (but not a model+ngram
    request the policy runs on prompt lookup alone, RequestState.lookup_alone), while it is reachable."""
    return state.method != "ngram" and not state.lookup_alone and draft is not None and draft.healthy


def lookup_allowed(state: RequestState, draft: DraftClient | None) -> bool:
    """Whether rounds may take prompt-lookup drafts: methods ngram and model+ngram, or as the fallback while the
    draft worker is down (and only for a request that has an n-gram index)."""
    return state.ngram is not None and (state.method != "model" or not model_allowed(state, draft))


def run_plan(state: RequestState, draft: DraftClient | None, policy: KPolicy, source: int,
             k: int) -> tuple[int, worker_pb2.PromptLookup | None]:
    """Whether the round planned (source, K) is a decode run instead: (the tokens the run may commit in one target
    call, the prompt lookup its steps do: None for plain decoding); (1, None): a round as usual. Runs are: a
    round at K = 0 (plain decoding or, where prompt lookup may propose, the target looking up its own drafts at
    every step); every round of a request whose only proposer is prompt lookup (draft.method ngram, or the
    fallback while the draft worker is down), likewise; and an n-gram round of model+ngram, whose run ends at the
    first step that finds no match while the draft model holds a K > 0 (the next round may use it; at K = 0 the
    next round would be a lookup run again, so the run goes on: one call fewer per miss). The target looks those
    drafts up itself, with no round trip per round. A run is at most decode_steps tokens long, so that the
    policy plans again (a plain run: policy.plain_run_steps, longer under load; the policy's probe of plain
    decoding, plain_probe: PLAIN_PROBE_STEPS), but a request pinned to K = 0 with no lookup has nothing to plan:
    its run goes on to its end. decode_steps 1 turns runs off."""
    if policy.decode_steps <= 1:
        return 1, None
    probe = k == 0 and plain_probe(state, draft, policy)
    tokens = clamp_k(state, (PLAIN_PROBE_STEPS if probe else policy.decode_steps) - 1) + 1
    lookup, model = lookup_allowed(state, draft), model_allowed(state, draft)
    if not lookup:
        if state.fixed_k == 0:             # nothing to plan again: the run goes on to the request's end
            return clamp_k(state, state.max_new_tokens) + 1, None
        if k:
            return 1, None
        return (tokens if probe else clamp_k(state, policy.plain_run_steps(state) - 1) + 1), None
    if not model or k == 0:
        k = clamp_k(state, choose_k(state, policy, NGRAM))
        return tokens, prompt_lookup(state, policy, k, with_model=model)
    if source != NGRAM:
        return 1, None
    model_k = state.fixed_k if state.fixed_k is not None else policy.held_k(state, MODEL)
    return tokens, prompt_lookup(state, policy, k, with_model=True, planned_on=state.ngram.match(state.tokens),
                                 end_on_miss=model_k > 0)


def plain_probe(state: RequestState, draft: DraftClient | None, policy: KPolicy) -> bool:
    """Whether a round planned at K = 0 is the policy's probe of plain decoding (KController._probe_k): the
    draft model is up and its controller holds K > 0. Its run lasts PLAIN_PROBE_STEPS tokens, enough to time
    plain decoding: a whole run (decode_steps) at the K the policy had just rejected cost a heavy-pair request
    a third of its speed (a 96-token request at 39 tokens/s, against 51-84 for the 17 others that drew none)."""
    return state.fixed_k is None and model_allowed(state, draft) and policy.held_k(state, MODEL) > 0


def prompt_lookup(state: RequestState, policy: KPolicy, k: int, with_model: bool,
                  planned_on: Match | None = None, end_on_miss: bool = False) -> worker_pb2.PromptLookup:
    """The target's prompt lookup for a decode run: the request's n-gram sizes, up to k drafts per step (fewer
    after a match whose length the policy finds worth fewer), after matches at least as long as the policy finds
    worth it against the alternative (the draft model `with_model`, else plain decoding); the run ends at a step
    that finds no match if `end_on_miss`. A run `planned_on` a match is an n-gram round of model+ngram: it also
    drafts after matches as short as that one (a probe may have picked it). A request with its own K drafts up to
    it after any match (a rule of its tokens alone, as plan_round's). A request whose prediction was dropped tells
    the target to draft from it no more."""
    least, by_match = (0, []) if state.fixed_k is not None else policy.lookup_limits(state, k, with_model)
    if planned_on is not None:
        least = min(least, planned_on.size)
    return worker_pb2.PromptLookup(min_n=state.ngram.min_n, max_n=state.ngram.max_n, max_tokens=k,
                                   end_on_miss=end_on_miss, min_match=least, max_tokens_by_match=by_match,
                                   drop_prediction=state.prediction_dropped)


def prefill_alone(state: RequestState, policy: KPolicy, ready: Proposal | None, k: int) -> bool:
    """Whether this model round at K (> 0) is a request's first and runs at K = 0 instead, pre-drafting K beside
    the target's prefill (speculation.prefill_first): the draft's prefill and drafts then cost the first token
    nothing, and if the draft's guess of that token is right the next round's drafts are ready (or staged). Not in
    sampled-draft mode: a sampled draft's draws depend on the rounds' K, so a seeded request's tokens would then
    depend on whether overlap is on (in greedy-draft mode verification is coupled to plain decoding: any K gives
    the same tokens)."""
    return (policy.prefill_first and k > 0 and ready is None and state.generated == 0 and state.target_synced == 0
            and state.draft_mode != worker_pb2.DRAFT_MODE_SAMPLED)


def predraft_k(policy: KPolicy, planned: int | None) -> int:
    """K of the pre-draft for the next round, planned at K `planned` (None: no overlap): 0, no pre-draft, where
    that round drafts more than a pre-draft may carry (speculation.overlap_tokens): it runs in turn at its K."""
    return planned if planned is not None and planned <= policy.predraft_k else 0
