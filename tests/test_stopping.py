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


@pytest.mark.parametrize("keep_special", [False, True])
@pytest.mark.parametrize("include_stop", [False, True])
def test_a_stop_token_or_eos_that_ends_the_output_is_in_its_tokens_not_its_text(tokenizer, keep_special, include_stop):
    """As vLLM: the token that ends the output (a stop token id, ordinary or special, or EOS) is the output's last
    token, but its text is left out, also where the text keeps special tokens, in whatever batches the rounds
    commit; include_stop_str_in_output keeps it. A token that ends nothing (EOS under ignore_eos) keeps its text."""
    import asyncio

    from protos.specpool.v1 import generation_pb2
    from router.request_state import RequestState
    from router.speculation import commit
    from router.stopping import output_chunks
    body, eos = tokenizer.encode(TEXT).ids[:12], tokenizer.token_to_id("<|endoftext|>")
    plain_stop = body[9]
    for stop_ids, eos_ids, last, reason in (({plain_stop}, {eos}, plain_stop, generation_pb2.FINISH_REASON_STOP),
                                            ((), {eos}, eos, generation_pb2.FINISH_REASON_EOS),
                                            ({eos}, (), eos, generation_pb2.FINISH_REASON_STOP),
                                            ((), (), eos, generation_pb2.FINISH_REASON_LENGTH)):
        output = body[:9] + [last, 0, 0]
        for seed in range(5):
            state = RequestState(session_id=1, tokens=[0], prompt_len=1, max_new_tokens=10, sampling=None, fixed_k=None,
                                 draft_mode=0, max_context=100, stop_ids=frozenset(stop_ids),
                                 eos_ids=frozenset(eos_ids), include_stop=include_stop, keep_special=keep_special)

            async def rounds(rng=random.Random(seed), at=0):
                while not state.finish_reason:
                    batch = output[at:at + rng.randint(1, 4)]
                    at += len(batch)
                    yield commit(state, batch)

            async def chunks():
                return [chunk async for chunk in output_chunks(rounds(), state, tokenizer)]
            sent = asyncio.run(chunks())
            assert [t for chunk in sent for t in chunk.token_ids] == output[:10] and state.finish_reason == reason
            shown = include_stop or reason == generation_pb2.FINISH_REASON_LENGTH
            expected = tokenizer.decode(output[:10] if shown else output[:9], skip_special_tokens=not keep_special)
            assert "".join(chunk.text for chunk in sent) == expected
