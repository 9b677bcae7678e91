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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


class LookupMissed(Exception):
    """A call asked to be stopped rather than run without drafts, and the lookup found no match."""


@dataclass(frozen=True)
class Match:
    start: int          # where, in the context, the continuation begins
    size: int           # tokens of the context's suffix that matched (n)


def continuation(tokens: list[int], start: int, k: int) -> list[int]:
    """k tokens copied from tokens[start:], running on into the copy itself past the end of `tokens`."""
    out: list[int] = []
    for j in range(k):
        i = start + j
        out.append(tokens[i] if i < len(tokens) else out[i - len(tokens)])
    return out


class NgramIndex:
    """The n-gram index of one request's committed tokens (an append-only list it is shown each round)."""

    def __init__(self, min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n (got {min_n}, {max_n})")
        self.min_n, self.max_n = min_n, max_n
        self.sizes = range(max_n, min_n - 1, -1)          # longest first
        self._tables: dict[int, dict[tuple, int]] = {n: {} for n in self.sizes}
        self._next_end = 0                                  # n-grams ending before this position are indexed
        self._last: tuple[int, Match | None] | None = None  # (context length, its match)

    def _catch_up(self, tokens: list[int]) -> None:
        """Index the n-grams that end at positions [_next_end, len - 2]: each has a token after it."""
        for end in range(self._next_end, len(tokens) - 1):
            for n in self.sizes:
                if end + 1 >= n:
                    self._tables[n][tuple(tokens[end + 1 - n:end + 1])] = end + 1
        self._next_end = max(self._next_end, len(tokens) - 1)

    def match(self, tokens: list[int]) -> Match | None:
        """The longest suffix of `tokens` seen before, at its most recent occurrence, or None."""
        if self._last is not None and self._last[0] == len(tokens):
            return self._last[1]
        self._catch_up(tokens)
        found = None
        for n in self.sizes:
            start = self._tables[n].get(tuple(tokens[-n:])) if len(tokens) >= n else None
            if start is not None:
                found = Match(start, n)
                break
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
        return continuation(tokens, found.start, k) if k > 0 else []
