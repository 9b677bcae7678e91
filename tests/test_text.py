"""Streaming detokenization: the deltas concatenate to the full decode, however the tokens are chunked,
including multi-byte characters split across tokens (held back until complete)."""
from pathlib import Path

import pytest

from router.text import IncrementalDetokenizer, load_tokenizer

DEMO_TARGET = Path(__file__).resolve().parent.parent / "deploy" / "models" / "demo-pair" / "target"
TEXT = "def __init__(self, x):\n    return 'héllo wörld ✓ 😀' + str(x)  # ünïcode\n" * 3


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_deltas_concatenate_to_the_full_text(chunk):
    tokenizer = load_tokenizer(str(DEMO_TARGET))
    ids = tokenizer.encode(TEXT).ids
    detokenizer, deltas = IncrementalDetokenizer(tokenizer), []
    for start in range(0, len(ids), chunk):
        deltas.append(detokenizer.push(ids[start:start + chunk], final=start + chunk >= len(ids)))
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in delta for delta in deltas)
