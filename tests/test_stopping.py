"""Stop strings on the demo pair's BPE tokenizer, with tokens arriving in random batches: the text is cut
before the first stop string, the tokens end with the one that completed it, and a stream never sends text
that a stop string later claims."""
import random
from pathlib import Path

import pytest

from router.stopping import StopStrings
from router.text import IncrementalDetokenizer, load_tokenizer

TOKENIZER = Path(__file__).resolve().parent.parent / "deploy" / "models" / "demo-pair" / "target"
TEXT = ("def __init__(self, name, value=None):\n    self.name = name  # é ünïcode ✓\n    return self.value\n"
        "class Foo(Bar):\n    pass\n")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(TOKENIZER))


def run(tokenizer, tokens: list[int], stops: tuple, rng: random.Random):
    """Push `tokens` in random batches, as rounds commit them; (pieces sent, tokens kept, stopped)."""
    output = StopStrings(IncrementalDetokenizer(tokenizer), stops)
    pieces, kept, at = [], 0, 0
    while at < len(tokens):
        batch = tokens[at:at + rng.randint(1, 5)]
        at += len(batch)
        piece = output.push(batch, final=at == len(tokens))
        pieces.append(piece.text)
        kept += piece.kept
        if piece.stopped:
            return pieces, kept, True
    return pieces, kept, False


def expected(tokenizer, tokens: list[int], stops: tuple) -> tuple[str, int | None]:
    """The text before the first stop string and the fewest tokens whose text contains one (None: no stop)."""
    for n in range(1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:n])
        found = [text.find(stop) for stop in stops if stop in text]
        if found:
            return text[:min(found)], n
    return tokenizer.decode(tokens), None


def test_random_stops_across_token_boundaries(tokenizer):
    rng = random.Random(0)
    tokens = tokenizer.encode(TEXT).ids
    full = tokenizer.decode(tokens)
    for _ in range(300):
        starts = [rng.randrange(len(full) - 1) for _ in range(rng.randint(1, 3))]
        stops = tuple(full[s:s + rng.randint(1, 6)] for s in starts) + (("never-there",) if rng.random() < .5 else ())
        pieces, kept, stopped = run(tokenizer, tokens, stops, rng)
        text, n = expected(tokenizer, tokens, stops)
        assert stopped and "".join(pieces) == text and kept == n
        sent = ""
        for piece in pieces:                  # every prefix sent is a prefix of the final text
            sent += piece
            assert text.startswith(sent)


def test_no_match_sends_everything_and_holds_back_only_prefixes(tokenizer):
    tokens = tokenizer.encode(TEXT).ids
    output = StopStrings(IncrementalDetokenizer(tokenizer), ("self.nameX", "zzz"))
    sent = [output.push([token], final=False).text for token in tokens]
    assert output.held == "" and "".join(sent) == tokenizer.decode(tokens)
    output = StopStrings(IncrementalDetokenizer(tokenizer), ("):\n    self.x",))
    head = tokenizer.encode("def f(self):\n    self.").ids
    assert output.push(head, final=False).text == "def f(self"          # "):\n    self." could still be a stop
    assert output.push(tokenizer.encode("y").ids, final=True).text == "):\n    self.y"
