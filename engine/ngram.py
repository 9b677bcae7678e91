"""Prompt lookup (n-gram) proposals: drafts copied from the request's own context, with no model.

The proposal after a context is the continuation of an earlier occurrence of the context's longest suffix of
`min_n` to `max_n` tokens. Of several earlier occurrences, the **most recent** one is used: nearby text is the
likelier one being repeated (the block being rewritten, the last loop body), and it is what an index that
overwrites its entries gives for free.

Index: per n-gram size, a dict from the n-gram (a tuple) to the position just after its most recent occurrence.
It is brought up to date incrementally, before each lookup, with the tokens committed since the last one: each
token adds at most (max_n - min_n + 1) entries, so a request's lookups cost O(context x sizes) in all, never a
rescan of every position per round. Only committed tokens are indexed (never rejected drafts), and an n-gram is
indexed only once a token follows it, so the context's own suffix never matches itself.

The continuation is copied LZ77-style: proposal token j is context[start + j], where positions past the end of
the context continue into the proposal itself, so a periodic run ("a b a b a b") proposes K tokens, not only the
few that follow its last occurrence.

A prediction (OpenAI's Predicted Outputs: the output a request expects, such as the file being edited) is a second
text to copy from. While the output so far is the prediction's beginning, the proposal is what follows in the
prediction; once the output leaves it (an edit), the context's longest suffix is looked up in the prediction too,
at its first occurrence at or after where the output left it (so a repeated line resumes where the edit did, not
at the file's top), and from there the output follows it again; a match there at least as long as one in the
context wins:

    index = NgramIndex(2, 4, prediction=predicted_ids, output_from=len(prompt_ids))
    index.propose(prompt_ids + output_so_far, k=8)
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Sequence


class LookupMissed(Exception):
    """A call asked to be stopped rather than run without drafts, and the lookup found no match."""


@dataclass(frozen=True)
class Match:
    start: int          # where, in the context (or the prediction), the continuation begins
    size: int           # tokens of the context's suffix that matched (n); the longest size while the output
                        # so far is the prediction's beginning
    predicted: bool = False     # the continuation is the prediction's


def continuation(tokens: list[int], start: int, k: int) -> list[int]:
    """k tokens copied from tokens[start:], running on into the copy itself past the end of `tokens`."""
    out: list[int] = []
    for j in range(k):
        i = start + j
        out.append(tokens[i] if i < len(tokens) else out[i - len(tokens)])
    return out


INDEX_STEP = 256        # a prediction's tokens indexed per lookup, at most (about 0.8 ms here): a long one is indexed
                        # as the lookups come, far ahead of the output, never in one stall of the caller's thread


class Prediction:
    """The tokens a request predicts its output to be, indexed by n-gram (every occurrence), and where the output
    has got to in them: from an anchor (an output position and a prediction position; at first both 0) the output
    follows the prediction as far as it repeats it."""

    def __init__(self, tokens: Sequence[int], sizes: range, output_from: int):
        self.tokens, self.sizes, self.output_from = list(tokens), sizes, output_from
        self._positions: dict[int, dict[tuple, list[int]]] = {n: {} for n in sizes}   # -> starts after it, ascending
        self._indexed = 0                                   # n-grams ending before this position are indexed
        self._anchor, self._size, self._followed, self._following = (0, 0), sizes[0], 0, True

    def match(self, tokens: list[int]) -> Match | None:
        """The prediction's continuation of `tokens` (an append-only list): where the output has got to while it
        follows the prediction from the anchor (its size: the anchor's match and the tokens followed since, the
        longest size from the start); else after its longest suffix found in the prediction, at the first occurrence
        at or after where the output left it (else the last one before), which becomes the anchor."""
        self._index_more()
        reached = self._reach(tokens)
        if self._following and reached < len(self.tokens):
            return Match(reached, min(self.sizes[0], self._size + self._followed), predicted=True)
        for n in self.sizes:
            starts = self._positions[n].get(tuple(tokens[-n:])) if len(tokens) >= n else None
            if starts:
                at = bisect_left(starts, reached)
                start = starts[at] if at < len(starts) else starts[-1]
                self._anchor, self._size = (len(tokens) - self.output_from, start), n
                self._followed, self._following = 0, True
                return Match(start, n, predicted=True)
        return None

    def _index_more(self) -> None:
        """Index the n-grams ending at the next INDEX_STEP positions (one ending at the last token has no
        continuation)."""
        last = min(self._indexed + INDEX_STEP, len(self.tokens) - 1)
        for end in range(self._indexed, last):
            for n in self.sizes:
                if end + 1 >= n:
                    self._positions[n].setdefault(tuple(self.tokens[end + 1 - n:end + 1]), []).append(end + 1)
        self._indexed = max(self._indexed, last)

    def _reach(self, tokens: list[int]) -> int:
        """How far into the prediction the output has followed it from the anchor. Where the output's token differs
        from the prediction's after at least one it repeated, the output is guessed to have changed that token alone
        (a renamed name, a changed value): the anchor moves past both, and the output follows on from there as far
        as it repeats the prediction, the match as long as the one it followed before; where its very next token
        differs too, it has left the prediction."""
        while self._following and self.output_from + self._anchor[0] + self._followed < len(tokens):
            (output, predicted), followed = self._anchor, self._followed
            at = predicted + followed
            if at < len(self.tokens) and tokens[self.output_from + output + followed] == self.tokens[at]:
                self._followed += 1
            elif followed and at + 1 < len(self.tokens):          # one token changed: follow on after it, as
                self._anchor, self._followed = (output + followed + 1, at + 1), 0     # strong a match as before
                self._size = min(self.sizes[0], self._size + followed)
            else:
                self._following = False
        return self._anchor[1] + self._followed


class NgramIndex:
    """The n-gram index of one request's committed tokens (an append-only list it is shown each round), and of its
    prediction, if it has one (Prediction; `output_from`: where the output begins in those tokens)."""

    def __init__(self, min_n: int = 2, max_n: int = 4, prediction: Sequence[int] = (), output_from: int = 0):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n (got {min_n}, {max_n})")
        self.min_n, self.max_n = min_n, max_n
        self.sizes = range(max_n, min_n - 1, -1)          # longest first
        self._tables: dict[int, dict[tuple, int]] = {n: {} for n in self.sizes}
        self._next_end = 0                                  # n-grams ending before this position are indexed
        self._last: tuple[int, Match | None] | None = None  # (context length, its match)
        self.prediction = Prediction(prediction, self.sizes, output_from) if prediction else None

    def drop_prediction(self) -> None:
        """Copy no more drafts from the prediction (it proved worth less than the request's other drafts:
        router/prediction.py); the context's own n-grams stay."""
        if self.prediction is not None:         # (a target is told so with every lookup after)
            self.prediction, self._last = None, None

    def _catch_up(self, tokens: list[int]) -> None:
        """Index the n-grams that end at positions [_next_end, len - 2]: each has a token after it."""
        for end in range(self._next_end, len(tokens) - 1):
            for n in self.sizes:
                if end + 1 >= n:
                    self._tables[n][tuple(tokens[end + 1 - n:end + 1])] = end + 1
        self._next_end = max(self._next_end, len(tokens) - 1)

    def match(self, tokens: list[int]) -> Match | None:
        """The longest suffix of `tokens` seen before, at its most recent occurrence, or None; the prediction's
        match instead where it is at least as long."""
        if self._last is not None and self._last[0] == len(tokens):
            return self._last[1]
        self._catch_up(tokens)
        found = None
        for n in self.sizes:
            start = self._tables[n].get(tuple(tokens[-n:])) if len(tokens) >= n else None
            if start is not None:
                found = Match(start, n)
                break
        predicted = self.prediction.match(tokens) if self.prediction is not None else None
        if predicted is not None and (found is None or predicted.size >= found.size):
            found = predicted
        self._last = (len(tokens), found)
        return found

    def propose(self, tokens: list[int], k: int, min_match: int = 0, k_by_size: Sequence[int] = ()) -> list[int]:
        """Up to k drafts after `tokens` (none when no suffix matched, or the longest match is shorter than
        `min_match` tokens); with `k_by_size` (one per size, min_n first), up to its entry for the match's size."""
        found = self.match(tokens)
        if found is None or found.size < min_match:
            return []
        if found.size - self.min_n < len(k_by_size):
            k = min(k, k_by_size[found.size - self.min_n])
        if k <= 0:
            return []
        return self.prediction.tokens[found.start:found.start + k] if found.predicted else \
            continuation(tokens, found.start, k)
