"""Structured output (GenerateRequest.structured_output; HTTP response_format and vLLM's and SGLang's parameters):
the target's p at each position is its own distribution restricted to the tokens the grammar allows after that
row's prefix (engine/constraints.py), so greedy output is the target alone's under the grammar at every K, sampled
tokens follow the target alone's constrained distribution in both draft modes, and the draft, masking its own rows
alike, proposes what the target can accept. The router refuses a malformed structure naming its field."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from protos.specpool.v1 import generation_pb2, worker_pb2
from router.structured_output import compiled
from router.validation import RequestError
from tests.distribution import chi_square_p_value
from tests.engine_rounds import accepted_drafts, run_rounds, runs_of_rounds

POINT = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
         "required": ["name", "n"], "additionalProperties": False}
EOS_IDS = frozenset({0})
DEMO = Path(__file__).resolve().parent.parent / "deploy" / "models" / "demo-pair"


def grammar_of(eos_ids=EOS_IDS, **structure) -> worker_pb2.Grammar:
    return compiled(generation_pb2.GenerateRequest(structured_output=generation_pb2.StructuredOutput(**structure)),
                    eos_ids)


def constrained_greedy(model, tokenizer_path: str, grammar: worker_pb2.Grammar, prompt: list[int],
                       max_new: int) -> list[int]:
    """The target alone, greedy, each step's logits restricted by an llguidance matcher of its own (no specpool
    code), stopping after EOS; on the model's device."""
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer
    tokenizer = llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(tokenizer_path),
                                             n_vocab=model.config.vocab_size, eos_token=list(grammar.eos_token_ids))
    matcher, out = llguidance.LLMatcher(tokenizer, grammar.llguidance), []
    with torch.no_grad():
        while len(out) < max_new and not (out and out[-1] in grammar.eos_token_ids):
            logits = model(torch.tensor([prompt + out], device=model.device)).logits[0, -1]
            bias = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)
            allowed = (bias > 0).to(model.device)
            out.append(int(logits.masked_fill(~allowed, float("-inf")).argmax()))
            assert matcher.consume_token(out[-1])
    return out


@pytest.fixture(scope="module")
def demo():
    """The demo pair's engines in this process, its target alone and its tokenizer (a real BPE vocabulary)."""
    from transformers import AutoTokenizer
    from tests.conftest import pair_engines
    draft, target, model = pair_engines((str(DEMO / "draft"), str(DEMO / "target")))
    return draft, target, model, AutoTokenizer.from_pretrained(str(DEMO / "target"))


@pytest.mark.parametrize("k", [0, 1, 4])
def test_greedy_rounds_match_the_target_alone_under_a_json_schema(demo, k):
    """The output is the target alone's under the schema, token for token, and it is JSON the schema accepts."""
    assert_schema_greedy(*demo, k)


def assert_schema_greedy(draft, target, model, tokenizer, k: int) -> None:
    """Greedy rounds at K = k under POINT's schema give the target alone's constrained output (on the engines' and
    the model's device: tests/test_cuda_engines.py runs it on CUDA)."""
    grammar = grammar_of(json_schema=json.dumps(POINT))
    prompt = tokenizer("x = ").input_ids
    expected = constrained_greedy(model, target.model_path, grammar, prompt, 48)
    assert expected[-1] in EOS_IDS                           # complete within 48 tokens
    tokens = run_rounds(draft, target, prompt, k, len(expected), generation_pb2.SamplingParams(top_p=1.0),
                        worker_pb2.DRAFT_MODE_GREEDY, grammar=grammar)
    assert tokens == expected
    value = json.loads(tokenizer.decode(tokens, skip_special_tokens=True))
    assert set(value) == {"name", "n"} and isinstance(value["name"], str) and isinstance(value["n"], int)


@pytest.mark.parametrize("k", [0, 4])
def test_greedy_rounds_match_the_target_alone_under_a_schema_after_free_reasoning(demo, k):
    """With reasoning_end (a thinking model's `</think>`; here ", ", which the demo target writes after "x = 3"),
    the output runs free up to the marker and then follows the schema: the target alone's under the same grammar,
    token for token, and JSON the schema accepts after the marker."""
    draft, target, model, tokenizer = demo
    small = {**POINT, "properties": {**POINT["properties"], "n": {"type": "integer", "minimum": 0, "maximum": 99}},
             "x-guidance": {"whitespace_flexible": False}}      # so that the demo target completes it in 48 tokens
    grammar = grammar_of(json_schema=json.dumps(small), reasoning_end=", ")
    prompt = tokenizer("x = ").input_ids
    expected = constrained_greedy(model, target.model_path, grammar, prompt, 48)
    assert expected[-1] in EOS_IDS
    tokens = run_rounds(draft, target, prompt, k, len(expected), generation_pb2.SamplingParams(top_p=1.0),
                        worker_pb2.DRAFT_MODE_GREEDY, grammar=grammar)
    assert tokens == expected
    reasoning, _, answer = tokenizer.decode(tokens, skip_special_tokens=True).partition(", ")
    assert reasoning == "3" and set(json.loads(answer)) == {"name", "n"}


@pytest.mark.parametrize("start, text, accepted", [
    ("", 'It is 4.</think>{"a": 1}', True), ("", "<think>x</think>yes", False),      # the structure, at once
    ("", '{"a": 1}', False),                                  # the prompt opened the reasoning: it must end first
    ("", 'a</thinkb</think>{"a": 1}', True),                   # only the whole marker ends it
    ("", 'a</think>b</think>{"a": 1}', False),                  # ... and the first one does
    ("<think>", '<think>x</think>{"a": 1}', True), ("<think>", '{"a": 1}', True),     # optional, opened by <think>
    ("<think>", 'x</think>{"a": 1}', False)])
def test_a_structure_follows_the_reasoning_up_to_its_end_marker(start, text, accepted):
    from llguidance import LLMatcher
    from transformers import AutoTokenizer
    from router.structured_output import matcher_tokenizer
    from router.text import load_tokenizer
    grammar = grammar_of(json_schema=json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                                 "required": ["a"]}), reasoning_end="</think>", reasoning_start=start)
    matcher = LLMatcher(matcher_tokenizer(load_tokenizer(str(DEMO / "target")), 768, EOS_IDS), grammar.llguidance)
    ids = AutoTokenizer.from_pretrained(str(DEMO / "target")).encode(text, add_special_tokens=False)
    assert (matcher.consume_tokens(ids) and matcher.is_accepting()) == accepted


def test_a_marker_that_is_a_token_of_its_own_is_that_token_in_the_grammar():
    """Qwen3's and DeepSeek-R1's <think> and </think> are added tokens, which llguidance counts special, so that no
    text spells them: the grammar takes the tokens themselves (here the demo vocabulary with both added). While the
    model reasons, its mask allows </think> and not EOS; the token ends the reasoning and the structure follows;
    with reasoning_start the output opens with <think> or the structure, not with other text."""
    from llguidance import LLMatcher
    from tokenizers import AddedToken
    from router.structured_output import added_token, matcher_tokenizer
    from router.text import load_tokenizer
    tokenizer = load_tokenizer(str(DEMO / "target"))
    tokenizer.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    opens, ends = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")
    vocabulary = matcher_tokenizer(tokenizer, 770, EOS_IDS)

    def text(words: str) -> list[int]:
        return tokenizer.encode(words, add_special_tokens=False).ids
    for start in ("", "<think>"):
        request = generation_pb2.GenerateRequest(structured_output=generation_pb2.StructuredOutput(
            json_object=True, reasoning_end="</think>", reasoning_start=start))
        grammar = compiled(request, EOS_IDS, vocabulary, added_token(tokenizer)).llguidance
        matcher = LLMatcher(vocabulary, grammar)
        assert matcher.consume_tokens(([opens] if start else []) + text("I think"))
        mask = matcher.compute_logit_bias()
        assert mask[ends] and not mask[0]
        assert matcher.consume_tokens([ends] + text('{"a": 1}')) and matcher.is_accepting()
        assert LLMatcher(vocabulary, grammar).consume_tokens(text("I think")) == (not start)


def test_both_engines_build_the_grammar_tokenizer_at_load_not_at_the_first_structured_call(demo):
    """The first structured-output session of a newly loaded pair finds llguidance's tokenizer built (no cache miss
    while it runs), for the EOS tokens the router sends: the engine thread never builds it mid-serving."""
    from engine.constraints import grammar_tokenizer
    from tests.conftest import pair_engines
    grammar_tokenizer.cache_clear()
    draft, target, _ = pair_engines((str(DEMO / "draft"), str(DEMO / "target")))
    grammar = grammar_of(json_schema=json.dumps(POINT))
    assert tuple(grammar.eos_token_ids) == tuple(sorted(EOS_IDS))
    misses = grammar_tokenizer.cache_info().misses
    run_rounds(draft, target, demo[3]("x = ").input_ids, 2, 4, generation_pb2.SamplingParams(top_p=1.0),
               worker_pb2.DRAFT_MODE_GREEDY, grammar=grammar)
    assert grammar_tokenizer.cache_info().misses == misses


def test_the_draft_masks_its_rows_as_the_target_does(demo):
    """Drafting with the target's own model under the schema, every greedy draft is accepted: the draft restricts
    each of its rows to what the grammar allows after that row's own prefix, its earlier drafts included."""
    from draft_worker.proposer import DraftEngine
    _, target, _, tokenizer = demo
    draft = DraftEngine(target.model_path)
    grammar = grammar_of(json_schema=json.dumps(POINT))
    prompt = tokenizer("x = ").input_ids
    start = dict(sampling=generation_pb2.SamplingParams(top_p=1.0), prompt_length=len(prompt), grammar=grammar)
    assert accepted_drafts(draft, target, prompt, start, 3, 4) == 3 * 4


PROMPT, SAMPLES, REGEX = [0, 1, 2, 3], 2000, "[a-c][b-f]"


def test_lookup_drafts_end_at_the_first_token_the_grammar_forbids(demo):
    """A decode run drafting by prompt lookup under a JSON schema: the lookup copies the prompt, which goes on past
    its JSON (`\nq = {...`) where the schema allows only the end, so the target keeps each lookup's drafts up to the
    first token the grammar forbids there. Every draft it verifies is one the grammar allows after the output before
    it, and it commits what it commits drafting nothing."""
    from engine.constraints import Constraint, grammar_tokenizer
    from tests.test_decode_run import plain_and_looked_up, tokens_of
    _, target, _, tokenizer = demo
    grammar = grammar_of(json_schema=json.dumps(POINT))
    prompt = tokenizer('p = {"name": "ab", "n": 12}\nq = {"name": "ab", "n": 12}\nr = {"name": "ab", "n": 12}\n'
                       'x = ').input_ids

    call = worker_pb2.VerifyRequest(session_id=90, position=0, new_token_ids=prompt, decode_steps=32, grammar=grammar,
                                    sampling=generation_pb2.SamplingParams(top_p=1.0), prompt_length=len(prompt))
    plain, looked_up = plain_and_looked_up(target, call, 8)
    assert tokens_of(looked_up) == tokens_of(plain)
    replay = Constraint(grammar_tokenizer(target.model_path, target.model.config.vocab_size,
                                          tuple(grammar.eos_token_ids)), grammar.llguidance)
    output, drafted = [], 0
    for answer in looked_up:
        drafts = list(answer.draft_token_ids)
        assert replay.allowed_prefix(output, drafts) == len(drafts), (tokenizer.decode(output), drafts)
        output += tokens_of([answer])
        drafted += len(drafts)
    assert drafted > 0


def constrained_joint(model, prompt: list[int], first: str, second: str) -> dict:
    """P(t0, t1) of the target alone at temperature 1 with t0's letter in `first` and t1's in `second` (the tiny
    pair's token i is letter i)."""
    letters = "abcdefgh"
    with torch.no_grad():
        p0 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double(), -1)
        keep0 = [letters.index(c) for c in first]
        joint = {}
        for t0 in keep0:
            p1 = torch.softmax(model(torch.tensor([prompt + [t0]])).logits[0, -1].double(), -1)
            keep1 = [letters.index(c) for c in second]
            joint.update({(t0, t1): float(p0[t0] / p0[keep0].sum() * p1[t1] / p1[keep1].sum()) for t1 in keep1})
    return joint


@pytest.mark.parametrize("mode", [worker_pb2.DRAFT_MODE_SAMPLED, worker_pb2.DRAFT_MODE_GREEDY],
                         ids=["sampled-draft", "greedy-draft"])
def test_sampled_tokens_follow_the_target_alones_constrained_distribution(tiny_engines, tiny_pair, mode):
    """K = 2 decides both tokens of REGEX in one round, the second on a row restricted after the first draft; over
    SAMPLES seeds (t0, t1) follows the target alone's joint restricted to the regex, which differs from the plain
    one by far more than the test can miss (the plain joint puts most of its mass outside it)."""
    from tests import penalized_reference
    draft, target, model = tiny_engines
    eos = model.generation_config.eos_token_id
    exact = constrained_joint(model, PROMPT, "abc", "bcdef")
    plain = penalized_reference.first_two_joint(model, PROMPT)
    assert sum(abs(exact.get(cell, 0.0) - p) for cell, p in plain.items()) > 0.5
    grammar = grammar_of(frozenset({eos}), regex=REGEX)
    outcomes = [tuple(tokens) for tokens in runs_of_rounds(draft, target, PROMPT, 2, 2, [generation_pb2.SamplingParams(
        temperature=1.0, top_p=1.0, seed=seed) for seed in range(SAMPLES)], mode, grammar=grammar)]
    cells = sorted(exact)
    counts = [outcomes.count(cell) for cell in cells]
    assert sum(counts) == SAMPLES                        # never outside the regex
    assert chi_square_p_value(counts, [exact[c] for c in cells]) > 1e-4


@pytest.mark.parametrize("structure, field", [
    (dict(json_schema="{not json"), "structured_output.json_schema"),
    (dict(json_schema="[1, 2]"), "structured_output.json_schema"),
    (dict(json_schema='{"type": "nonsense"}'), "structured_output.json_schema"),
    (dict(json_object=False), "structured_output.json_object"),
    (dict(regex="a[b"), "structured_output.regex"),
    (dict(choice=generation_pb2.Choices()), "structured_output.choice.options"),
    (dict(grammar="start: undefined_rule"), "structured_output.grammar"),
    (dict(grammar="root ::= ("), "structured_output.grammar"),
    (dict(reasoning_end="</think>"), "structured_output.reasoning_end"),         # no structure to follow it
    (dict(json_object=True, reasoning_start="<think>"), "structured_output.reasoning_start"),     # no end
    (dict(harmony_final=True), "structured_output.harmony_final"),                 # no structure to be the body
    (dict(json_object=True, harmony_final=True, reasoning_end="</think>"), "structured_output.harmony_final"),
    (dict(json_object=True, harmony_final=True), "structured_output.harmony_final"),   # no harmony tokens
])
def test_a_malformed_structure_is_refused_naming_its_field(structure, field):
    with pytest.raises(RequestError) as info:
        grammar_of(**structure)
    assert info.value.field == field, str(info.value)


def test_every_kind_compiles_and_one_that_ends_with_eos_cannot_ignore_it():
    for structure in (dict(json_schema=json.dumps(POINT)), dict(json_object=True), dict(regex="[0-9]+"),
                      dict(choice=generation_pb2.Choices(options=["yes", 'no "way"'])), dict(grammar='start: "x"+'),
                      dict(grammar='root ::= "yes" | "no"')):
        assert grammar_of(**structure).eos_token_ids == [0]
    for fields, field in ((dict(ignore_eos=True), "ignore_eos"), (dict(min_new_tokens=2), "min_new_tokens")):
        request = generation_pb2.GenerateRequest(structured_output=generation_pb2.StructuredOutput(regex="a"), **fields)
        with pytest.raises(RequestError) as info:
            compiled(request, EOS_IDS)
        assert info.value.field == field
    assert compiled(generation_pb2.GenerateRequest(), EOS_IDS) is None


def test_a_structure_no_token_sequence_can_match_is_refused_by_the_router(demo):
    """A regex of no string passes llguidance's own check but not a matcher over the vocabulary: the router builds
    one from its tokenizer.json (router.structured_output.matcher_tokenizer), so no worker sees it."""
    from router.structured_output import matcher_tokenizer
    from router.text import load_tokenizer
    tokenizer = matcher_tokenizer(load_tokenizer(str(DEMO / "target")), 768, EOS_IDS)
    assert tokenizer is not None
    assert grammar_of(regex=r"[^\s\S]")                  # without the vocabulary it compiles
    request = generation_pb2.GenerateRequest(structured_output=generation_pb2.StructuredOutput(regex=r"[^\s\S]"))
    with pytest.raises(RequestError) as info:
        compiled(request, EOS_IDS, tokenizer)
    assert info.value.field == "structured_output.regex"
    request.structured_output.reasoning_end = "</think>"      # free reasoning in front does not hide it
    with pytest.raises(RequestError) as info:
        compiled(request, EOS_IDS, tokenizer)
    assert info.value.field == "structured_output.regex"
    request.structured_output.regex = "[0-9]+"
    assert compiled(request, EOS_IDS, tokenizer).llguidance


# ---- gpt-oss's harmony format: the structure is the final message's body --------------------------------------
HARMONY_MARKS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
LIKE = {"<|end|>": ("\n", 2.0), "<|message|>": (" =", 1.4), "<|channel|>": (":", 1.4)}  # (written like, times)


@pytest.fixture(scope="module")
def harmony_pair(tmp_path_factory):
    """The demo pair with harmony's markers as special tokens of its vocabulary (768-774). Each of LIKE's markers
    has the output row (times a factor) and input row of a token the demo pair writes often, so that it writes the
    marker where the grammar allows it: the output moves through harmony's messages instead of running one body
    on. "a" takes the output row of "(", so that after <|channel|> it opens analysis at times rather than final."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out = tmp_path_factory.mktemp("harmony-pair")
    tokenizer = AutoTokenizer.from_pretrained(str(DEMO / "target"))
    tokenizer.add_special_tokens({"additional_special_tokens": list(HARMONY_MARKS)})
    for name in ("draft", "target"):
        model = AutoModelForCausalLM.from_pretrained(str(DEMO / name))
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
        head, embedding = model.get_output_embeddings().weight, model.get_input_embeddings().weight
        with torch.no_grad():
            head[768:], embedding[768:] = 0.0, 0.0
            for marker, (like, times) in LIKE.items():
                marker, like = tokenizer.convert_tokens_to_ids(marker), tokenizer(like).input_ids[0]
                head[marker], embedding[marker] = times * head[like], embedding[like]
            head[tokenizer.convert_tokens_to_ids("a")] = head[tokenizer.convert_tokens_to_ids("(")]
        model.save_pretrained(out / name)
        tokenizer.save_pretrained(out / name)
    return str(out / "draft"), str(out / "target"), tokenizer


def harmony_grammar(target_path: str, **structure) -> worker_pb2.Grammar:
    from router.structured_output import added_token, matcher_tokenizer
    from router.text import load_tokenizer
    tokenizer = load_tokenizer(target_path)
    eos = frozenset({0, tokenizer.token_to_id("<|return|>")})
    return compiled(generation_pb2.GenerateRequest(structured_output=generation_pb2.StructuredOutput(
        harmony_final=True, **structure)), eos, matcher_tokenizer(tokenizer, 775, eos), added_token(tokenizer))


@pytest.mark.parametrize("text, accepted", [
    ('<|channel|>analysis<|message|>It is 1.<|end|><|start|>assistant<|channel|>final<|message|>{"a": 1}', True),
    ('<|channel|>final<|message|>{"a": 1}', True),                                    # no analysis
    ('<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>'
     '<|start|>assistant<|channel|>final<|message|>{"a": 1}', True),                 # two analysis messages
    ('<|channel|>final <|constrain|>json<|message|>{"a": 1}', True),                 # the final header constrained
    ('<|channel|>final<|message|>yes', False),                                        # the body is the structure
    ('{"a": 1}', False),                                                              # the format's header first
    ('<|channel|>finale<|message|>{"a": 1}', False),                                  # no such channel
    ('<|channel|>analysis<|message|>a<|channel|>final<|message|>{"a": 1}', False),   # a message ends first
    ('<|channel|>analysis<|message|>a<|end|><|channel|>final<|message|>{"a": 1}', False),   # ... and <|start|> opens
    ('<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>commentary<|message|>b<|end|>'
     '<|start|>assistant<|channel|>final<|message|>{"a": 1}', False),               # a preamble: content too
    ('<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|end|>'
     '<|start|>assistant<|channel|>final<|message|>{"a": 1}', False),                # a call: its block in content
    ('<|channel|>analysis<|message|>a<|end|><|start|>assistant to=functions.f<|channel|>final<|message|>{"a": 1}',
     False)])                                                                         # a final message to a function
def test_a_harmony_structure_is_the_final_messages_body(harmony_pair, text, accepted):
    from llguidance import LLMatcher
    from router.structured_output import matcher_tokenizer
    _, target, tokenizer = harmony_pair
    grammar = harmony_grammar(target, json_object=True)
    matcher = LLMatcher(matcher_tokenizer(tokenizer.backend_tokenizer, 775, frozenset({0})), grammar.llguidance)
    ok = matcher.consume_tokens(tokenizer(text, add_special_tokens=False).input_ids) and matcher.is_accepting()
    assert ok == accepted


def test_inside_a_harmony_body_the_mask_allows_its_end_and_not_eos(harmony_pair):
    """While an analysis message runs, text and <|end|> may come, EOS may not; after <|end|>, only the next
    message's <|start|>; after the final message's structure, EOS (<|return|>)."""
    from llguidance import LLMatcher
    from router.structured_output import matcher_tokenizer
    _, target, tokenizer = harmony_pair
    grammar = harmony_grammar(target, json_object=True)
    matcher = LLMatcher(matcher_tokenizer(tokenizer.backend_tokenizer, 775, frozenset({0, 773})), grammar.llguidance)
    ids = tokenizer.convert_tokens_to_ids

    def allowed() -> set[int]:
        mask = matcher.compute_logit_bias()
        return {token for token in (0, 773, ids("<|start|>"), ids("<|channel|>"), ids("<|end|>"), 88) if mask[token]}
    assert matcher.consume_tokens(tokenizer("<|channel|>analysis<|message|>It", add_special_tokens=False).input_ids)
    assert allowed() == {ids("<|end|>"), 88}
    assert matcher.consume_tokens([ids("<|end|>")])
    assert allowed() == {ids("<|start|>")}
    assert matcher.consume_tokens(tokenizer('<|start|>assistant<|channel|>final<|message|>{"a": 1}',
                                            add_special_tokens=False).input_ids)
    assert {0, 773} <= allowed()


@pytest.mark.parametrize("k", [0, 4])
@pytest.mark.parametrize("prompt", ["x = ", "class A:\n"])
def test_greedy_rounds_match_the_target_alone_under_a_harmony_structure(harmony_pair, k, prompt):
    """On a pair that writes harmony's markers, greedy rounds under the final-message grammar give the target
    alone's output under it, token for token: analysis messages (their markers among drafts rolled back), then the
    final message's JSON, which the answer reads as its content and the analysis as its reasoning."""
    from openai_api.reasoning import HARMONY
    from tests.conftest import pair_engines
    draft_path, target_path, tokenizer = harmony_pair
    draft, target, model = pair_engines((draft_path, target_path))
    grammar = harmony_grammar(target_path, json_schema=json.dumps(
        {**POINT, "properties": {**POINT["properties"], "n": {"type": "integer", "minimum": 0, "maximum": 99}},
         "x-guidance": {"whitespace_flexible": False}}))
    ids = tokenizer(prompt).input_ids
    expected = constrained_greedy(model, target_path, grammar, ids, 128)
    tokens = run_rounds(draft, target, ids, k, len(expected), generation_pb2.SamplingParams(top_p=1.0),
                        worker_pb2.DRAFT_MODE_GREEDY, grammar=grammar)
    assert tokens == expected
    text = tokenizer.decode(tokens)
    reasoning, content = HARMONY.split(text)
    assert text.count("<|channel|>analysis<|message|>") >= 1 and reasoning and text.endswith("<|return|>")
    assert set(json.loads(content)) == {"name", "n"}
