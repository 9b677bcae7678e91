"""Text <-> token IDs on the router, with the target's tokenizer.json and no torch."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer


def load_tokenizer(model: str) -> Tokenizer:
    """The tokenizer.json of a model folder, or of a hub ID (fetched through huggingface_hub)."""
    path = Path(model) / "tokenizer.json"
    if not path.exists():
        from huggingface_hub import hf_hub_download
        path = Path(hf_hub_download(model, "tokenizer.json"))
    return Tokenizer.from_file(str(path))


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas. A delta that would end inside a multi-byte
    character (decoded as U+FFFD) is held back until the character completes."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._tokens: list[int] = []
        self._emitted = 0

    def push(self, token_ids: list[int], final: bool = False) -> str:
        self._tokens.extend(token_ids)
        text = self._tokenizer.decode(self._tokens, skip_special_tokens=True)
        if text.endswith("\ufffd") and not final:
            return ""
        delta, self._emitted = text[self._emitted:], len(text)
        return delta
