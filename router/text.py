"""Text <-> token IDs on the router, with the target's tokenizer.json and no torch. A long prompt is encoded on a
thread, never on the event loop; a short one on the loop (see encode)."""
from __future__ import annotations

import asyncio
import functools
from pathlib import Path

from tokenizers import Tokenizer


def load_tokenizer(model: str) -> Tokenizer:
    """The tokenizer.json of a model folder, or of a hub ID (fetched through huggingface_hub)."""
    path = Path(model) / "tokenizer.json"
    if not path.exists():
        from huggingface_hub import hf_hub_download
        path = Path(hf_hub_download(model, "tokenizer.json"))
    return Tokenizer.from_file(str(path))


def max_token_chars(tokenizer: Tokenizer) -> int:
    """The most characters one token can stand for: its longest vocabulary entry (added tokens included;
    a byte-level entry has one character per byte, so this bounds characters from above). A text of n
    characters is at least n / max_token_chars tokens, which bounds a prompt's size before it is encoded."""
    return max(map(len, tokenizer.get_vocab(with_added_tokens=True)), default=1)


INLINE_CHARS = 512     # a prompt this short is encoded on the event loop


async def encode(tokenizer: Tokenizer, text: str, special: bool = True) -> list[int]:
    """The text's token IDs (`special`: with the tokenizer's special tokens, a BOS). A prompt of at most
    INLINE_CHARS characters is encoded on the event loop, since the thread hop costs more than encoding it: 0.29 ms
    per request against ~0.1 ms for 512 characters (~0.2 µs per character, the demo pair's tokenizer on this
    machine); a longer one on a thread."""
    call = tokenizer.encode if special else functools.partial(tokenizer.encode, add_special_tokens=False)
    if len(text) <= INLINE_CHARS:
        return call(text).ids
    return (await asyncio.to_thread(call, text)).ids


def word_sequences(tokenizer: Tokenizer, words) -> list[tuple[int, ...]]:
    """vLLM's bad_words as token sequences: each word as the tokenizer writes it alone and after a space (where a
    word starts mid-text), without special tokens; distinct."""
    sequences = {tuple(tokenizer.encode(text, add_special_tokens=False).ids) for word in words
                 for text in (word, " " + word.lstrip())}
    return sorted(sequence for sequence in sequences if sequence)


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas, decoding only the tokens since the previous delta
    (plus the ones before them, for context), so a long stream costs O(length), not O(length^2). A delta
    that would end inside a multi-byte character (decoded as U+FFFD) is held back until it completes."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special     # special tokens left out of the text
        self._tokens: list[int] = []
        self._prefix = 0          # tokens before this are done with
        self._read = 0            # tokens before this have been emitted as text

    def push(self, token_ids: list[int], final: bool = False) -> str:
        self._tokens.extend(token_ids)
        decode = self._tokenizer.decode
        emitted = decode(self._tokens[self._prefix:self._read], skip_special_tokens=self._skip)
        text = decode(self._tokens[self._prefix:], skip_special_tokens=self._skip)
        if len(text) <= len(emitted) or (text.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._tokens)
        return text[len(emitted):]
