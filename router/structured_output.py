"""Structured output: GenerateRequest.structured_output compiled to the llguidance grammar the workers follow.

The router checks the grammar here, so that a bad schema, regex or grammar is INVALID_ARGUMENT naming its field
before any worker sees it; the target restricts p to it (engine/constraints.py). llguidance imports no torch.

    grammar = compiled(request)      # worker_pb2.Grammar, or None for a request without structured output
"""
from __future__ import annotations

import json
from typing import Callable

from protos.specpool.v1 import generation_pb2, worker_pb2
from router.validation import RequestError

MAX_GRAMMAR_CHARS = 1 << 20    # a schema, regex, grammar or the choices together, as sent


def llguidance_grammar(structured: generation_pb2.StructuredOutput) -> tuple[str, str]:
    """(field, llguidance grammar) of the structure asked for; RequestError for a malformed one."""
    from llguidance import LLMatcher
    kind = structured.WhichOneof("kind")
    field = f"structured_output.{kind}"
    if kind == "json_schema":
        try:
            schema = json.loads(structured.json_schema)
        except ValueError as exc:
            raise RequestError(field, f"not JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise RequestError(field, f"must be a JSON Schema: an object or a boolean (got {type(schema).__name__})")
        return field, LLMatcher.grammar_from_json_schema(schema)
    if kind == "json_object":
        if not structured.json_object:
            raise RequestError(field, "must be true (leave structured_output unset for free text)")
        return field, LLMatcher.grammar_from_json_schema({"type": "object"})
    if kind == "regex":
        return field, LLMatcher.grammar_from_regex(structured.regex)
    if kind == "choice":
        if not structured.choice.options:
            raise RequestError(f"{field}.options", "must not be empty")
        return field, LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(option)
                                                                          for option in structured.choice.options))
    from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark
    try:
        return field, LLMatcher.grammar_from_lark(any_to_lark(structured.grammar))
    except GbnfToLarkError as exc:
        raise RequestError(field, f"not a Lark or GBNF grammar: {exc}") from None


def none_added(text: str) -> None:
    """No marker is a token of its own (the default of after_reasoning's `added`)."""


def after_reasoning(grammar: str, end: str, start: str = "", added: Callable[[str], int | None] = none_added) -> str:
    """`grammar` after a thinking model's reasoning: free text up to and including the first `end`, opened by
    `start` where the reasoning is optional (else it is always there), then the structure at once, as a grammar of
    its own. A marker that is a token of its own (`added` gives its ID: Qwen3's and DeepSeek-R1's </think>, which
    llguidance counts special, so that no text spells it) is that token after free text; one that is text ends a
    lexeme with that suffix (llguidance rolls it back, as rejected drafts need, which a `stop` lexeme it cannot)."""
    ended = added(end)
    reasoning, rule = ("thinking", f"thinking[suffix={_literal(end)}]: /(?s:.*)/") if ended is None else (
        f"THINKING <[{ended}]>", "THINKING: /(?s:.*)/")
    opened = added(start) if start else None
    opening = "" if not start else _literal(start) if opened is None else f"<[{opened}]>"
    head = f"({opening} {reasoning})?" if start else reasoning
    return _wrapped(grammar, lambda name: f"start: {head} @{name}\n{rule}\n")


HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|constrain|>", "<|message|>", "<|end|>")


def after_harmony(grammar: str, added: Callable[[str], int | None]) -> str:
    """`grammar` as the body of the `final` message of gpt-oss's harmony format, after its analysis: any analysis
    messages first (`<|channel|>analysis<|message|>`, free text, `<|end|>`; each after the first opened by
    `<|start|>assistant`), then `<|channel|>final` (after `<|start|>assistant` where analysis came first), an optional
    `<|constrain|>` and its text, `<|message|>` and the structure at once. No other message (a preamble, a call) comes
    before it, so the answer's content is the structure. The markers are special tokens and enter by ID (`added`;
    harmony_markers checks that they exist)."""
    start, channel, constrain, message, end = (f"<[{added(marker)}]>" for marker in HARMONY_MARKERS)
    return _wrapped(grammar, lambda name: (
        f'start: (analysis ({start} "assistant" analysis)* {start} "assistant")? {channel} "final" '
        f'(" "? {constrain} TEXT)? {message} @{name}\n'
        f'analysis: {channel} "analysis" {message} TEXT {end}\nTEXT: /(?s:.*)/\n'))


def _wrapped(grammar: str, top: Callable[[str], str]) -> str:
    """A grammar whose first grammar is the Lark text top(name), where @name refers to `grammar`."""
    try:
        inner = json.loads(grammar)["grammars"]            # llguidance's JSON form (a schema's, a regex's)
    except (ValueError, TypeError, KeyError):
        inner = [{"lark_grammar": grammar}]                # Lark text (a choice's, a grammar's)
    name = inner[0].get("name") or "answer"
    return json.dumps({"grammars": [{"lark_grammar": top(name)}, {**inner[0], "name": name}, *inner[1:]]})


def _literal(marker: str) -> str:
    """A Lark string literal of the text."""
    return json.dumps(marker, ensure_ascii=False)


def added_token(tokenizer) -> Callable[[str], int | None]:
    """text -> the ID of the added token that is exactly that text (a `tokenizers.Tokenizer`'s), or None. The
    tokenizer's added tokens are read once, here."""
    ids = {added.content: at for at, added in sorted(tokenizer.get_added_tokens_decoder().items(), reverse=True)}
    return ids.get


def matcher_tokenizer(tokenizer, vocab_size: int, eos_ids: frozenset):
    """llguidance's view of the router's tokenizer (a `tokenizers.Tokenizer`), to check grammars against the
    vocabulary; None where llguidance cannot read it (the workers then find what only the vocabulary shows)."""
    from llguidance import LLTokenizer
    try:
        return LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size, eos_token=sorted(eos_ids))
    except (ValueError, AttributeError):
        return None


def compiled(request: generation_pb2.GenerateRequest, eos_ids: frozenset, tokenizer=None,
             added: Callable[[str], int | None] = none_added) -> worker_pb2.Grammar | None:
    """The request's grammar for the workers, checked (with `tokenizer`, matcher_tokenizer's, also against the
    vocabulary: a regex no token can start is caught only there; the structure on its own, before any reasoning is
    put in front of it). None: no structured output. A grammar ends its output with EOS, so it is refused beside
    ignore_eos or min_new_tokens. `added`: added_token's, for reasoning markers."""
    if not request.HasField("structured_output"):
        return None
    structured = request.structured_output
    refuse_alone(structured)
    if structured.WhichOneof("kind") is None:
        return None
    if request.ignore_eos:
        raise RequestError("ignore_eos", "cannot be combined with structured_output (its output ends with EOS)")
    if request.min_new_tokens:
        raise RequestError("min_new_tokens", "cannot be combined with structured_output")
    if request.structured_output.ByteSize() > MAX_GRAMMAR_CHARS:
        raise RequestError("structured_output", f"at most {MAX_GRAMMAR_CHARS} bytes")
    if not eos_ids:
        raise RequestError("structured_output", "the model has no EOS token to end a structured output with")
    field, grammar = llguidance_grammar(structured)
    checked(field, grammar, tokenizer)
    if structured.reasoning_end:
        grammar = after_reasoning(grammar, structured.reasoning_end, structured.reasoning_start, added)
        checked("structured_output.reasoning_end", grammar, tokenizer)
    elif structured.harmony_final:
        grammar = after_harmony(grammar, harmony_markers(added))
        checked("structured_output.harmony_final", grammar, tokenizer)
    return worker_pb2.Grammar(llguidance=grammar, eos_token_ids=sorted(eos_ids))


def refuse_alone(structured: generation_pb2.StructuredOutput) -> None:
    """RequestError for what goes before a structure (reasoning markers, harmony's messages) asked for wrongly:
    without a structure to follow it, or both kinds at once."""
    field = ("structured_output.reasoning_end" if structured.reasoning_end else
             "structured_output.harmony_final" if structured.harmony_final else None)
    if structured.reasoning_start and not structured.reasoning_end:
        raise RequestError("structured_output.reasoning_start", "needs reasoning_end (where the reasoning ends)")
    if structured.reasoning_end and structured.harmony_final:
        raise RequestError("structured_output.harmony_final", "not with reasoning_end (harmony's reasoning ends "
                                                              "where its final message begins)")
    if field and structured.WhichOneof("kind") is None:
        raise RequestError(field, "needs a structure to follow the reasoning "
                                  "(json_schema, json_object, regex, choice, grammar)")


def harmony_markers(added: Callable[[str], int | None]) -> Callable[[str], int]:
    """`added`, once each harmony marker is found to be a token of its own (RequestError naming the first that is
    not: the model does not write harmony)."""
    missing = next((marker for marker in HARMONY_MARKERS if added(marker) is None), None)
    if missing is not None:
        raise RequestError("structured_output.harmony_final", f"the model's tokenizer has no {missing} token of "
                                                              "its own: it does not write gpt-oss's harmony format")
    return added


def checked(field: str, grammar: str, tokenizer) -> None:
    """RequestError naming `field` for a grammar llguidance refuses, or (with `tokenizer`) one whose first token no
    token of the vocabulary can start."""
    from llguidance import LLMatcher
    error = LLMatcher.validate_grammar(grammar)
    if not error and tokenizer is not None:
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        matcher.compute_logit_bias()                    # the first token's mask: where a dead start shows
        if matcher.is_error():
            raise RequestError(field, "no text the model's tokens can spell matches it "
                                      f"({(matcher.get_error() or '?').splitlines()[0]})")
    if error:                   # "at 1(8): invalid regex ... parse error:", a diagram, "error: unclosed ..."
        lines = [line.strip() for line in error.strip().splitlines()]
        raise RequestError(field, " ".join([lines[0]] + [line for line in lines[1:] if line.startswith("error:")]))
