"""Predicted Outputs (OpenAI's `prediction`; GenerateRequest.prediction, router/prediction.py): prompt lookup copies
drafts from the prediction too, so a request whose output follows it takes far fewer target passes, and the output
is exactly what it is without one.

Unit: the lookup proposes the prediction's next tokens while the output follows it, resumes in it after an edit at
the n-gram after where the output was (a repeated line included), steps over a token changed alone, yields to a longer match in the context, and
stops at its end; the accepted and rejected counts; the predicted requests' own controller regimes; the target
engine drafting from a prediction its session start carried. End to end (the demo pair over gRPC and HTTP): greedy
output identical to the target alone with an exact, an edited and an unrelated prediction, adaptive and at a fixed
K, the exact one in a quarter of the target passes (adaptive) or every draft accepted (K = 4); a seeded sampled request's tokens the same with a prediction as
without; bad predictions refused naming the field, and OpenAI's usage counts."""
import random

import grpc
import httpx
import pytest

from engine.ngram import INDEX_STEP, Match, NgramIndex
from protos.specpool.v1 import generation_pb2, worker_pb2
from router.controller import RoundTimings
from router.k_selection import KSelector, delivery_kind, regime
from router.metrics import Metrics
from router.prediction import PredictionTrial, method_for, prediction_usage, trial_for
from router.request_state import MODEL, NGRAM, RequestState, Round
from router.round_plan import prompt_lookup
from settings.schema import SpeculationConfig
from tests.test_openai_http import PROMPT, demo_target, greedy_alone, served_over_http

PROMPT_IDS = [1, 2, 3, 4, 5]
TRIAL_ROUNDS = 8            # draft.prediction_trial_rounds' default


def index(prediction, min_n=2, max_n=4) -> NgramIndex:
    return NgramIndex(min_n, max_n, prediction, output_from=len(PROMPT_IDS))


def test_lookup_proposes_the_prediction_while_the_output_follows_it_and_stops_at_its_end():
    predicted = list(range(10, 30))
    lookup = index(predicted)
    assert lookup.propose(PROMPT_IDS, 6) == predicted[:6]                       # no output yet: its beginning
    assert lookup.propose(PROMPT_IDS + predicted[:9], 6) == predicted[9:15]
    assert lookup.propose(PROMPT_IDS + predicted[:17], 6) == predicted[17:]     # no more than it has
    assert lookup.propose(PROMPT_IDS + predicted, 6) == []                      # nothing past its end


def test_after_an_edit_lookup_resumes_in_the_prediction_where_the_output_was():
    line = [40, 41, 42, 43]
    predicted = line + [50, 51] + line + [60, 61, 62] + line + [70, 71, 72]      # a line three times
    lookup = index(predicted)
    output = predicted[:6] + line[:2] + [99]                  # the second line, edited
    assert lookup.propose(PROMPT_IDS + output, 4) == [43, 60, 61, 62]   # guessed: 99 in 42's place
    output += line[2:]                                        # no: inserted; back on the line: [.., 42, 43]
    assert lookup.propose(PROMPT_IDS + output, 4) == [60, 61, 62, 40]   # its second place, not its first
    output += [60, 61, 62] + line
    assert lookup.propose(PROMPT_IDS + output, 4) == [70, 71, 72]       # the third, the cursor moving on


def test_a_match_after_an_edit_counts_the_tokens_followed_since_and_a_long_prediction_is_indexed_as_lookups_come():
    predicted = list(range(1000, 1000 + 3 * INDEX_STEP))                     # no n-gram twice
    lookup = index(predicted)
    output = predicted[:10] + [5, 6] + predicted[20:22]                      # an edit, then a 2-gram from 20
    assert lookup.match(PROMPT_IDS + output) == Match(22, 2, predicted=True)
    assert lookup.match(PROMPT_IDS + output + predicted[22:23]) == Match(23, 3, predicted=True)
    assert lookup.match(PROMPT_IDS + output + predicted[22:25]) == Match(25, 4, predicted=True)   # at most max_n
    far = index(predicted)
    output = predicted[:3] + [5] + predicted[2 * INDEX_STEP + 50:2 * INDEX_STEP + 54]
    assert far.match(PROMPT_IDS + output) is None                             # not indexed that far yet
    assert far.match(PROMPT_IDS + output + [6]) is None
    assert far.match(PROMPT_IDS + output + [6] + predicted[2 * INDEX_STEP + 60:2 * INDEX_STEP + 62]) == \
        Match(2 * INDEX_STEP + 62, 2, predicted=True)                          # its third lookup, 768 indexed


def test_a_token_changed_alone_is_stepped_over_and_two_in_a_row_leave_the_prediction():
    predicted = list(range(100, 140))
    renamed = predicted[:10] + [7] + predicted[11:15]                        # one token changed (a rename)
    assert index(predicted).match(PROMPT_IDS + renamed) == Match(15, 4, predicted=True)
    lookup = index(predicted)                                                # after a 2-gram's anchor, a rename:
    assert lookup.match(PROMPT_IDS + [7, 8] + predicted[20:22]) == Match(22, 2, predicted=True)
    assert lookup.match(PROMPT_IDS + [7, 8] + predicted[20:23] + [9]) == Match(24, 3, predicted=True)   # 2 + 1
    assert index(predicted).propose(PROMPT_IDS + renamed[:11], 3) == predicted[11:14]   # guessed before it shows
    assert index(predicted).match(PROMPT_IDS + predicted[:10] + [7, 8]) is None       # two: left it (no n-gram)
    assert index(predicted).match(PROMPT_IDS + [7] + predicted[1:5]) == Match(5, 4, predicted=True)   # n-gram


def test_a_longer_context_match_beats_the_prediction_and_an_equal_one_loses_to_it():
    context = PROMPT_IDS + [7, 8, 9, 1, 2, 3] + [200, 7, 8, 9]        # [7, 8, 9] seen before, followed by 1
    assert index([201, 8, 9, 30, 31]).propose(context, 2) == [1, 2]        # context: 3 tokens; prediction: 2
    assert index([200, 7, 8, 9, 30, 31]).propose(context, 2) == [30, 31]   # 4 against 3... and equal sizes too:
    assert index([9, 7, 8, 9, 30], max_n=3).propose(context, 2) == [30]


@pytest.mark.parametrize("output, counts", [(list(range(10)), (10, 0)), ([50, 51], (0, 10)),
                                            (list(range(4)) + [77, 78] + list(range(6, 12)), (8, 2))],
                         ids=["identical", "unrelated", "edited"])
def test_accepted_and_rejected_prediction_tokens(output, counts):
    assert prediction_usage(list(range(10)), output) == counts
    assert prediction_usage([], output) == (0, 0)


def test_requests_with_a_prediction_learn_in_regimes_of_their_own():
    selector = KSelector(SpeculationConfig(k=3), Metrics(), random.Random(0), ngram_tokens=8, prediction_tokens=24)
    plain, predicted = (RequestState(session_id=i, tokens=[1, 2], prompt_len=2, max_new_tokens=8,
                                     sampling=generation_pb2.SamplingParams(top_p=1.0), fixed_k=None, draft_mode=0,
                                     max_context=0, prediction=prediction) for i, prediction in ((1, ()), (2, (5,))))
    assert (regime(plain), regime(predicted)) == ("greedy", "greedy predicted")
    assert selector.controller(predicted, NGRAM) is selector.pools[(NGRAM, "greedy predicted")]
    assert selector.pools[(NGRAM, "greedy predicted")].config.k_max == 24      # draft.prediction_max_tokens
    assert selector.pools[(NGRAM, "greedy")].config.k_max == 8                 # draft.ngram_max_tokens
    selector.pools[(MODEL, "greedy predicted")].observe(3, 3, None)
    assert selector.pools[(MODEL, "greedy")].rounds == 0
    assert method_for("model", [5], None) == "model+ngram" and method_for("ngram", [5], None) == "ngram"
    assert method_for("model", [], None) == "model" and method_for("model", [5], 0) == "model"   # K = 0: as without


def timed_round(seconds: float, committed: int, predicted: bool = False) -> Round:
    """A round that committed `committed` tokens in `seconds` of wall time, its drafts copied from the prediction
    (an n-gram round) or not (a model round)."""
    drafts = [9] * 4
    return Round(drafts, committed - 1, [7] * committed, RoundTimings(), parts={"verify_compute": seconds},
                 source=NGRAM if predicted else MODEL, predicted=predicted)


def trial_verdicts(trial: PredictionTrial, rounds: list[Round]) -> list[bool]:
    return [trial.useless(round_) for round_ in rounds]


def test_a_prediction_is_judged_useless_only_once_its_rounds_delivered_less_than_the_others_over_a_trial():
    slow, fast = timed_round(0.02, 1, predicted=True), timed_round(0.01, 3)        # 50 against 300 tokens/s
    verdicts = trial_verdicts(PredictionTrial(TRIAL_ROUNDS), [timed_round(5.0, 1)] + [slow, fast] * 12)
    first = verdicts.index(True)
    assert not any(verdicts[:first]) and first == 1 + 2 * TRIAL_ROUNDS - 1     # at the 8th of each
    # ... and not before both kinds have their trial behind them, however slow the prediction's rounds are
    assert not any(trial_verdicts(PredictionTrial(TRIAL_ROUNDS), [fast] + [slow] * 30 + [fast] * (TRIAL_ROUNDS - 1)))
    # a prediction the output follows delivers more, and is kept
    follows = timed_round(0.03, 25, predicted=True)
    assert not any(trial_verdicts(PredictionTrial(TRIAL_ROUNDS), [fast] + [follows, fast] * 40))
    # the first round (the prefill) counts towards neither: here it alone would make the others look slow
    assert trial_verdicts(PredictionTrial(TRIAL_ROUNDS), [timed_round(60.0, 1)] + [slow, fast] * 10)[-1]
    assert not trial_verdicts(PredictionTrial(TRIAL_ROUNDS), [fast, timed_round(60.0, 1)] + [slow, fast] * 10)[-1]


def predicted_request(session_id: int = 2, method: str = "model+ngram") -> RequestState:
    prediction = (50, 51, 52, 53, 54, 55)
    return RequestState(session_id=session_id, tokens=list(PROMPT_IDS), prompt_len=len(PROMPT_IDS),
                        max_new_tokens=64, sampling=generation_pb2.SamplingParams(top_p=1.0), fixed_k=None,
                        draft_mode=0, max_context=0, method=method, prediction=prediction,
                        prediction_trial=trial_for(list(prediction), None, TRIAL_ROUNDS),
                        ngram=NgramIndex(2, 4, prediction, len(PROMPT_IDS)))


def test_a_useless_prediction_is_dropped_and_the_request_drafts_from_the_model_and_its_context_alone():
    metrics = Metrics()
    selector = KSelector(SpeculationConfig(k=3), metrics, random.Random(0), ngram_tokens=8, prediction_tokens=24)
    state = predicted_request()
    selector.attach(state)
    state.lookup_alone = True                 # as the selector runs some: such a request holds no draft replica
    assert state.ngram.propose(state.tokens, 3) == [50, 51, 52] and "prediction_token_ids" in state.target_start
    rounds = [timed_round(0.5, 1)] + [timed_round(0.02, 1, predicted=True), timed_round(0.01, 3)] * 10
    for round_ in rounds:
        selector.observe(state, round_)
        state.tokens += [7] * len(round_.committed)
    assert state.prediction_dropped and not state.predicting and regime(state) == "greedy"
    assert state.method == "model+ngram" and state.stats.prediction_dropped_at == 1 + 4 * (TRIAL_ROUNDS - 1) + 1
    assert selector.controller(state, NGRAM) is selector.pools[(NGRAM, "greedy")]
    assert selector.active[state.session_id][0] == "greedy" and state.lookup_alone     # (it still has none)
    assert metrics.predictions_dropped._value.get() == 1
    assert "prediction_token_ids" not in state.target_start               # a re-prefill carries it no more
    assert state.ngram.propose(PROMPT_IDS, 3) == []                       # nothing copied from it on the router
    lookup = prompt_lookup(state, selector, 8, with_model=True)
    assert lookup.drop_prediction                                         # ... nor on the target
    assert not prompt_lookup(predicted_request(3), selector, 8, with_model=True).drop_prediction
    assert trial_for([5], 4, 8) is None and trial_for([], None, 8) is None   # its own K: no trial
    assert trial_for([5], None, 0) is None and trial_for([5], None, 8).rounds == 8    # 0: never dropped


def test_a_dropped_predictions_plain_rounds_feed_delivery_figures_only_where_a_model_plus_ngram_pool_reads_them():
    """A request with a prediction drafts model+ngram on a model pool too, and keeps it once it drops the
    prediction. Its predicted rounds feed its regime's delivery figures on either pool; its plain rounds feed the
    plain regime's only on a model+ngram pool, whose new requests lookup_way sends by them. On a model pool nothing
    reads them, and status would show figures of requests that are not there."""
    for method, kept in (("model", False), ("model+ngram", True)):
        selector = KSelector(SpeculationConfig(k=3), Metrics(), random.Random(0), ngram_tokens=8,
                             prediction_tokens=24, method=method)
        state = predicted_request()
        selector.attach(state)
        kind = delivery_kind(state)
        selector.observe(state, timed_round(0.01, 3, predicted=True))
        assert selector.delivered[(kind, "greedy predicted")].rounds == 1.0
        selector.drop_prediction(state)
        selector.observe(state, timed_round(0.01, 3))
        assert (selector.delivered[(kind, "greedy")].rounds == 1.0) is kept, method
    selector.update_config(SpeculationConfig(k=3), method="model")          # a reload to draft.method model
    selector.observe(state, timed_round(0.01, 3))
    assert selector.delivered[(kind, "greedy")].rounds == 1.0               # fed no more


def test_the_target_drafts_from_the_prediction_its_session_start_carried(byte_engines, reference_generate):
    """A verify call with `lookup` on a session whose start carried a prediction verifies the prediction's next
    tokens (they are the target's own greedy output here, so all are accepted), and commits what the target alone
    would."""
    _, target, _ = byte_engines
    prompt = [72, 101, 108, 108, 111]
    expected = reference_generate(prompt, 12)
    lookup = worker_pb2.PromptLookup(min_n=2, max_n=3, max_tokens=8)
    start = worker_pb2.VerifyRequest(session_id=77, new_token_ids=prompt, prediction_token_ids=expected,
                                     sampling=generation_pb2.SamplingParams(top_p=1.0), prompt_length=len(prompt),
                                     lookup=lookup)
    verdict = target.verify(start)
    assert list(verdict.draft_token_ids) == expected[:8] and verdict.num_accepted == 8
    assert verdict.next_token_id == expected[8]
    target.release(77)


def test_a_lookup_that_drops_the_prediction_mid_session_copies_from_it_no_more(byte_engines, reference_generate):
    """Two sessions start alike, the prediction's first token the target's own and the rest foreign tokens; on the
    second call, a lookup that does not drop it steps over the changed token and copies on in the prediction, one
    that drops it copies nothing of it (from then on)."""
    _, target, _ = byte_engines
    prompt = [72, 101, 108, 108, 111]
    first = reference_generate(prompt, 1)[0]
    prediction = [first] + list(range(200, 216))
    for session_id, drop in ((78, False), (79, True)):
        lookup = worker_pb2.PromptLookup(min_n=2, max_n=3, max_tokens=4)
        verdict = target.verify(worker_pb2.VerifyRequest(
            session_id=session_id, new_token_ids=prompt, prediction_token_ids=prediction, lookup=lookup,
            sampling=generation_pb2.SamplingParams(top_p=1.0), prompt_length=len(prompt)))
        assert list(verdict.draft_token_ids) == prediction[:4] and verdict.num_accepted == 1
        lookup.drop_prediction, position = drop, len(prompt) + 1
        for step in range(2):
            verdict = target.verify(worker_pb2.VerifyRequest(session_id=session_id, position=position,
                                                             new_token_ids=[verdict.next_token_id], lookup=lookup))
            position += 1 + verdict.num_accepted
            lookup.drop_prediction = False                      # dropped for good: the next call need not say so
            if not drop and step == 0:
                assert list(verdict.draft_token_ids) == prediction[2:6]     # 200 stepped over as a rename
                break
            assert not set(verdict.draft_token_ids) & set(prediction[1:]), (step, list(verdict.draft_token_ids))
        target.release(session_id)


# --- end to end, the demo pair ---

@pytest.fixture(scope="module")
def served(start_service):
    return served_over_http(start_service, http={"store_responses": 0})


@pytest.fixture(scope="module")
def target():
    return demo_target()


def generate(served, prediction=None, k=None, n=96, **sampling) -> generation_pb2.GenerateResponse:
    request = generation_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=n)
    if prediction is not None:
        request.prediction_token_ids.extend(prediction)
    if k is not None:
        request.speculation.k = k
    for key, value in sampling.items():
        setattr(request.sampling, key, value)
    return served.stub.Generate(request, timeout=120)


def edited(tokens: list[int]) -> list[int]:
    """The tokens with a few in the middle changed and one dropped: a predicted file with an edit in it."""
    middle = len(tokens) // 2
    return tokens[:middle] + [(t + 1) % 700 for t in tokens[middle:middle + 4]] + tokens[middle + 5:]


@pytest.mark.parametrize("k", [None, 4], ids=["adaptive", "K=4"])
def test_greedy_output_is_the_target_alone_with_any_prediction_and_an_exact_one_takes_few_passes(
        served, target, k):
    expected = greedy_alone(target, PROMPT, 96)
    without = generate(served, k=k)
    assert list(without.token_ids) == expected
    for name, prediction in (("exact", expected), ("edited", edited(expected)), ("unrelated", list(range(3, 99)))):
        response = generate(served, prediction, k)
        assert list(response.token_ids) == expected, name
        stats = response.stats
        assert stats.accepted_prediction_tokens + stats.rejected_prediction_tokens == len(prediction), name
        if name == "exact":                 # adaptive: a few passes of ~31 drafts; K = 4: 5 tokens a pass
            assert (stats.accepted_prediction_tokens, stats.rejected_prediction_tokens) == (96, 0)
            most = without.stats.target_passes / 4 if k is None else 96 / (k + 1) + 2
            assert stats.target_passes <= most, (stats.target_passes, without.stats.target_passes)
        if name == "edited":                # 4 tokens changed and 1 dropped: 91 of its 95 repeated
            assert stats.rejected_prediction_tokens <= 4 and stats.target_passes < without.stats.target_passes


@pytest.mark.parametrize("method", ["model", "model+ngram"])
def test_a_prediction_dropped_mid_request_leaves_the_output_the_target_alones_and_is_drafted_from_no_more(
        served, target, monkeypatch, method):
    """The trial's verdict forced at the request's second round (PredictionTrial.useless; the router runs in this
    process) with the exact prediction: the output is still the target alone's, the stats say where it was dropped,
    and the rest takes more passes than the few of a prediction the output follows (13-17 against 3-7 here). The
    decode run under way ends at the drop, and every later lookup run tells the target (which then copies no more
    of it: pinned above)."""
    def at_second_round(trial, round_):
        trial.seen = getattr(trial, "seen", 0) + 1
        return trial.seen == 2
    expected = greedy_alone(target, PROMPT, 96)
    before = served.reload(draft={"method": method})
    try:
        kept = generate(served, expected)
        monkeypatch.setattr(PredictionTrial, "useless", at_second_round)
        runs = spy_on_decode_runs(monkeypatch)
        dropped = generate(served, expected)
    finally:
        served.reload(**before)
    assert list(kept.token_ids) == list(dropped.token_ids) == expected
    assert kept.stats.prediction_dropped_at == 0 and 0 < dropped.stats.prediction_dropped_at < 96
    assert dropped.stats.target_passes > 2 * kept.stats.target_passes, (dropped.stats, kept.stats)
    assert not any(run["went_on"] for run in runs)          # the run under way when it was dropped ended there
    after = [run["lookup"] for run in runs if run["after_drop"] and run["lookup"] is not None]
    assert after and all(lookup.drop_prediction for lookup in after)     # ... and every lookup run after told so


def spy_on_decode_runs(monkeypatch) -> list[dict]:
    """Record each decode run the router starts (router.speculation.resilient_run): its lookup, whether the request
    had dropped its prediction when it began, and whether the router asked it for more after a drop."""
    from router import speculation
    runs, real = [], speculation.resilient_run

    async def spying(state, *args):
        run = {"lookup": args[-1], "after_drop": state.prediction_dropped, "went_on": False}
        runs.append(run)
        async for rounds in real(state, *args):
            yield rounds
            run["went_on"] |= state.prediction_dropped and not run["after_drop"]
    monkeypatch.setattr(speculation, "resilient_run", spying)
    return runs


def test_a_seeded_sampled_request_answers_the_same_tokens_with_a_prediction(served):
    """A greedy draft's verification is coupled to plain decoding (router/server.py): whatever the drafts, a seed
    gives the same tokens, so prediction drafts leave the output's distribution exactly the target's."""
    for seed in (1, 2, 3):
        plain = generate(served, temperature=0.8, seed=seed)
        for prediction in (list(plain.token_ids), edited(list(plain.token_ids))):
            assert list(generate(served, prediction, temperature=0.8, seed=seed).token_ids) == \
                list(plain.token_ids), seed


@pytest.mark.parametrize("fields, named", [({"prediction": "x", "prediction_token_ids": [1]}, "prediction"),
                                           ({"prediction_token_ids": [1, 10 ** 6]}, "prediction_token_ids[1]"),
                                           ({"prediction_token_ids": [1] * 70000}, "prediction_token_ids")])
def test_a_bad_prediction_is_invalid_argument_naming_the_field(served, fields, named):
    request = generation_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=4, **fields)
    with pytest.raises(grpc.RpcError) as raised:
        served.stub.Generate(request, timeout=60)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details().startswith(f"{named}: "), raised.value.details()
    assert list(generate(served, n=4).token_ids)                      # and it serves on


def test_over_http_a_prediction_changes_no_text_and_usage_counts_it(served, target):
    _, tokenizer = target
    messages = [{"role": "user", "content": PROMPT}]
    plain = served.client.chat.completions.create(model=served.model, messages=messages, max_tokens=48,
                                                  temperature=0)
    text = plain.choices[0].message.content
    predicted_tokens = len(tokenizer(text, add_special_tokens=False).input_ids)
    for content in (text, [{"type": "text", "text": text[:7]}, {"type": "text", "text": text[7:]}]):
        answer = served.client.chat.completions.create(model=served.model, messages=messages, max_tokens=48,
                                                       temperature=0, prediction={"type": "content",
                                                                                  "content": content})
        assert answer.choices[0].message.content == text
        details = answer.usage.completion_tokens_details
        assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == predicted_tokens
        assert details.accepted_prediction_tokens >= 0.9 * answer.usage.completion_tokens
    completion = served.client.completions.create(model=served.model, prompt=PROMPT, max_tokens=32, temperature=0)
    again = served.client.completions.create(model=served.model, prompt=PROMPT, max_tokens=32, temperature=0,
                                             extra_body={"prediction": {"type": "content",
                                                                        "content": completion.choices[0].text}})
    assert again.choices[0].text == completion.choices[0].text
    assert again.usage.completion_tokens_details.accepted_prediction_tokens > 0
    assert plain.usage.completion_tokens_details is None                  # no prediction, no such counts


@pytest.mark.parametrize("prediction, param", [({"type": "url", "content": "x"}, "prediction.type"),
                                               ({"type": "content", "content": 5}, "prediction.content"),
                                               ({"type": "content"}, "prediction.content")])
def test_over_http_a_malformed_prediction_is_a_400_naming_it(served, prediction, param):
    body = {"model": served.model, "prompt": PROMPT, "max_tokens": 4, "prediction": prediction}
    answer = httpx.post(f"{served.base_url}/completions", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param, answer.json()



def test_beam_search_takes_a_prediction_and_neither_uses_nor_counts_it(served):
    body = {"model": served.model, "prompt": PROMPT, "max_tokens": 6, "n": 2, "use_beam_search": True}
    plain = httpx.post(f"{served.base_url}/completions", json=body, timeout=120).json()
    predicted = httpx.post(f"{served.base_url}/completions", timeout=120,
                           json={**body, "prediction": {"type": "content", "content": "self):\n"}}).json()
    assert [c["text"] for c in predicted["choices"]] == [c["text"] for c in plain["choices"]]
    assert "completion_tokens_details" not in predicted["usage"]
