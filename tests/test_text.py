"""Streaming detokenization: the deltas concatenate to the full decode, however the tokens are chunked,
including multi-byte characters split across tokens (held back until complete). Prompt encoding: on the event
loop when short, on a thread when long, the same IDs either way."""
import asyncio
import threading
from pathlib import Path

import pytest

from router.text import INLINE_CHARS, IncrementalDetokenizer, encode, load_tokenizer

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


def test_deltas_keep_special_tokens_when_asked():
    """skip_special=False (vLLM's skip_special_tokens false): the deltas are the decode with special tokens."""
    tokenizer = load_tokenizer(str(DEMO_TARGET))
    eos = tokenizer.token_to_id(tokenizer.decode([0], skip_special_tokens=False))
    ids = tokenizer.encode(TEXT).ids[:20] + [eos] + tokenizer.encode(TEXT).ids[:5] + [eos]
    for skip in (True, False):
        detokenizer = IncrementalDetokenizer(tokenizer, skip_special=skip)
        deltas = [detokenizer.push([token], final=at == len(ids) - 1) for at, token in enumerate(ids)]
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert tokenizer.decode(ids, skip_special_tokens=False) != tokenizer.decode(ids, skip_special_tokens=True)


def test_a_short_prompt_is_encoded_on_the_event_loop_and_a_long_one_on_a_thread():
    tokenizer = load_tokenizer(str(DEMO_TARGET))

    class Recording:
        def __init__(self):
            self.threads = []

        def encode(self, text):
            self.threads.append(threading.current_thread())
            return tokenizer.encode(text)

    async def encoded(text):
        recording = Recording()
        ids = await encode(recording, text)
        return ids, recording.threads == [threading.current_thread()]
    short, long = TEXT[:INLINE_CHARS], TEXT * (INLINE_CHARS // len(TEXT) + 1)
    assert asyncio.run(encoded(short)) == (tokenizer.encode(short).ids, True)
    assert asyncio.run(encoded(long)) == (tokenizer.encode(long).ids, False)
