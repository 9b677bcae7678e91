"""Structured output: the target's logits restricted, position by position, to the tokens a grammar allows there.

A structured-output request's session holds an llguidance matcher (https://github.com/guidance-ai/llguidance) that
has consumed the output committed so far. A verify pass has K + 1 rows of logits; row j predicts the token after
the committed output and drafts 0..j-1, so the matcher walks the drafts, masking each row for its own prefix,
and then rolls them back: the next call's position says which of them were committed. p at each position is the
target alone's constrained distribution, and the rejection sampler is unchanged. Rows after a draft the grammar
forbids are left as they are: that draft has p = 0, so the round is rejected there at the latest.

    constraint = session_constraint(session, model_path, vocab_size)          # None without a grammar
    logits = constraint.mask(logits, session.tokens, start, sampling.prompt_length)   # after the penalties

The draft masks its own rows the same way (draft_worker/proposer.py), so that it proposes what the constrained
target can accept, and in sampled-draft mode the target recomputes q with the same masks. Once the grammar is
complete, only EOS is allowed, so the output ends there.
"""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=4)
def grammar_tokenizer(model_path: str, vocab_size: int, eos_ids: tuple):
    """llguidance's view of the model's tokenizer (its vocabulary padded to the logits' size), built once per
    model (at load: warm_grammar_tokenizer): ~1 s for a large vocabulary. A tokenizer whose decoder llguidance does
    not read (a Fuse decoder, as the tests' letter pairs have) is given to it token by token, each token's bytes as
    it decodes alone."""
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    try:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_ids))
    except ValueError:
        wrapped = llguidance.TokenizerWrapper(DecodedTokens(tokenizer))
        return llguidance.LLTokenizer(wrapped, n_vocab=vocab_size, eos_token=list(eos_ids))


def warm_grammar_tokenizer(model_path: str, model) -> None:
    """Build grammar_tokenizer at load, for the EOS tokens the router sends with a grammar (the target's, sorted:
    router/structured_output.py), so that a worker's first structured-output call does not build it on the engine
    thread, stalling every other session's rounds there. A model folder without a tokenizer has none to build."""
    from engine.modeling import model_info
    eos = tuple(sorted(set(model_info(model)["eos_token_ids"])))
    try:
        grammar_tokenizer(model_path, model.config.vocab_size, eos)
    except (OSError, ValueError, TypeError):
        pass


class DecodedTokens:
    """A transformers tokenizer as llguidance's TokenizerWrapper reads one: token bytes, special tokens, encode."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos_token_id, self.bos_token_id = tokenizer.eos_token_id, tokenizer.bos_token_id
        self.tokens = [tokenizer.decode([i]).encode() for i in range(len(tokenizer))]
        self.special_token_ids = list(tokenizer.all_special_ids)

    def __call__(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


def session_constraint(session, model_path: str, vocab_size: int) -> "Constraint | None":
    """The session's grammar matcher, made at its first use (None: the request has no grammar)."""
    sampling = session.sampling
    if not sampling.grammar:
        return None
    if session.constraint is None:
        session.constraint = Constraint(grammar_tokenizer(model_path, vocab_size, sampling.grammar_eos),
                                        sampling.grammar)
    return session.constraint


class Constraint:
    """A session's grammar matcher and the output tokens it has consumed."""

    def __init__(self, tokenizer, grammar: str):
        import llguidance
        self.matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        self.consumed: list[int] = []
        if self.matcher.is_error():
            raise ValueError(f"grammar: {self.matcher.get_error()}")

    def follow(self, output: list[int]) -> bool:
        """Roll the matcher back to the longest common prefix with `output`, then consume the rest of it. False
        (the matcher at the longest prefix of it that the grammar allows): the grammar forbids a token of it."""
        common = 0
        for mine, theirs in zip(self.consumed, output):
            if mine != theirs:
                break
            common += 1
        if common < len(self.consumed):
            self.matcher.rollback(len(self.consumed) - common)
            del self.consumed[common:]
        rest = output[common:]
        taken = self.matcher.try_consume_tokens(rest) if rest else 0
        self.consumed += rest[:taken]
        return taken == len(rest)

    def allowed_prefix(self, output: list[int], drafts: list[int]) -> int:
        """How many of `drafts` the grammar allows after the committed `output` (the matcher left at `output`)."""
        if not self.follow(output) or not drafts:
            return 0
        taken = self.matcher.try_consume_tokens(drafts)
        if taken:
            self.matcher.rollback(taken)
        return taken

    def allowed(self, vocab: int, device) -> torch.Tensor:  # [vocab] bool
        """The tokens the grammar allows next (none past the tokenizer's vocabulary)."""
        allowed = torch.zeros(vocab, dtype=torch.bool)
        bias = torch.frombuffer(bytearray(self.matcher.compute_logit_bias()), dtype=torch.uint8)
        allowed[:min(vocab, bias.shape[0])] = bias[:vocab] > 0
        if not allowed.any():       # a complete grammar allows EOS: none at all is the matcher's error
            raise ValueError(f"grammar: no token can come next ({self.matcher.get_error()[:200]!r})")
        return allowed.to(device)

    def mask(self, logits: torch.Tensor,  # [K + 1, vocab], row j predicting position start + j
             tokens: list[int],            # the prompt, the committed output, then the K drafts
             start: int,                   # the position row 0 predicts (the first draft's)
             prompt_length: int,
             committed: bool = True) -> torch.Tensor:  # [K + 1, vocab]
        """Each row's logits with the tokens the grammar forbids after its prefix at -inf; the matcher ends at
        tokens[:start]. If the grammar forbids a token there, that prefix is `committed` output: an error; or a
        draft's context (a pre-draft's guess), which the target can never commit: its rows are left as they are."""
        if not self.follow(tokens[prompt_length:start]):
            if committed:
                raise ValueError(f"the committed output breaks the grammar: {self.matcher.get_error()}")
            return logits
        rows, vocab = logits.shape
        allowed = torch.ones(rows, vocab, dtype=torch.bool, device=logits.device)
        walked = 0
        for j in range(rows):
            allowed[j] = self.allowed(vocab, logits.device)
            if j == rows - 1 or not self.matcher.try_consume_tokens([tokens[start + j]]):
                break
            walked += 1
        if walked:
            self.matcher.rollback(walked)
        return logits.float().masked_fill(~allowed, float("-inf"))
