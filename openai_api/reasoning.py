"""Reasoning parsers (`http.reasoning_parser`, `deepseek_r1` or `qwen3`, vLLM's names for the `<think>` format):
a thinking model's output split into its reasoning and its answer. A chat answer carries the reasoning in its
message (a stream, in its deltas) twice: as `reasoning`, vLLM's field since it followed OpenAI's guidance for
gpt-oss, and as `reasoning_content`, DeepSeek's, which many clients still read. The content is the rest, out of
which the tool parser then reads calls.

The output reasons when the prompt opened the thinking (its generation prompt ends with `<think>`, as
DeepSeek-R1's and Qwen3-Thinking's templates end it) or when the output opens with `<think>` itself (Qwen3 with
thinking on); the reasoning runs to the first `</think>` (all of the output, cut before one). Any other output is
all content: thinking turned off closes it in the prompt (Qwen3's `enable_thinking: false`, DeepSeek V3.1's default
mode). Under structured output the structure follows the reasoning (StructuredOutput.reasoning_end), as vLLM has it.

    http: {reasoning_parser: qwen3}       # deploy/local.yaml

`openai_gptoss` reads gpt-oss's harmony format (openai_api/harmony.py): the reasoning is its `analysis` messages,
the content its other messages' text, each call in it written back as one message, out of which the `openai`
tool-call parser reads the calls. Its markers are special tokens, so its requests keep them in their text. Under
structured output the structure is the body of its `final` message, after any analysis (StructuredOutput.
harmony_final), and the output splits as usual.

`gemma4` reads Gemma 4's thinking channel as the <think> format is read: `<|channel>thought\n`, the reasoning,
`<channel|>`, then the answer; the `thought\n` label is not reasoning, and the markers are special tokens, kept in
its requests' text. `seed_oss` reads Seed-OSS's `<seed:think>...</seed:think>` the same way.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from openai_api import harmony
from protos.specpool.v1 import generation_pb2

START, END = "<think>", "</think>"
GEMMA_START, GEMMA_END, GEMMA_LABEL = "<|channel>", "<channel|>", "thought\n"    # Gemma 4's thinking channel


@dataclass(frozen=True)
class ReasoningParser:
    """The <think> format's (`deepseek_r1`, `qwen3`), or another with markers of its own (`gemma4`:
    `<|channel>thought\n...<channel|>`, its `thought\n` label left out of the reasoning, as vLLM leaves it out)."""
    opens_reasoning: bool       # the prompt opened the thinking: the output begins as reasoning without the start
    start: str = START
    end: str = END
    label: str = ""             # what the reasoning begins with that is not reasoning (Gemma 4's channel name)
    special: bool = False       # the markers are special tokens: the request's text keeps them

    def prepare(self, generate: generation_pb2.GenerateRequest) -> None:
        """A structure follows the reasoning: free text up to the end marker (opened by the start marker unless the
        prompt opened it, and then optional); special markers kept in the text."""
        if self.special:
            generate.keep_special_tokens = True
        if generate.HasField("structured_output"):
            generate.structured_output.reasoning_end = self.end
            generate.structured_output.reasoning_start = "" if self.opens_reasoning else self.start

    def split(self, text: str) -> tuple[str | None, str]:
        """(the reasoning, None where the output does not reason; the content) of a whole output."""
        body = self.body(text)
        if body is None:
            return None, text
        reasoning, _, content = body.partition(self.end)
        return reasoning.removeprefix(self.label), content

    def span(self, text: str) -> tuple[int, int] | None:
        """Where the reasoning lies in a whole output, (start, end) in characters; None where it does not reason."""
        body = self.body(text)
        if body is None:
            return None
        start, end = len(text) - len(body), body.find(self.end)
        return start, start + (len(body) if end < 0 else end)

    def reasoning_tokens(self, pieces: list[str]) -> int:
        """How many of an output's tokens (`pieces`: each one's text) reason: those with text in the reasoning, as
        vLLM counts them (the <think> and </think> markers left out); 0 where the output does not reason."""
        span = self.span("".join(pieces))
        return tokens_within(pieces, [span] if span else [])

    def leading_thought(self, pieces: list[str]) -> int:
        """How many of an output's first tokens (`pieces`: each one's text) hold only its reasoning and markers:
        those that end before its answer begins (after the first </think>; all of them where it is cut before
        one); 0 where the output does not reason."""
        text = "".join(pieces)
        span = self.span(text)
        if span is None:
            return 0
        return tokens_ending_by(pieces, span[1] + len(self.end) if text.startswith(self.end, span[1]) else len(text))

    def stream(self) -> "ReasoningStream":
        return ReasoningStream(self)

    def body(self, text: str) -> str | None:
        """What follows an opening start marker (the output itself where it opens as reasoning), None: no
        reasoning."""
        opened = text.lstrip()
        if opened.startswith(self.start):
            return opened[len(self.start):]
        return text if self.opens_reasoning else None


def tokens_within(pieces: list[str], spans: list[tuple[int, int]]) -> int:
    """How many tokens (`pieces`: each one's text) have text in one of the (start, end) character spans (a token
    with no text counts where it stands inside one)."""
    starts = itertools.accumulate(map(len, pieces), initial=0)
    return sum(any(at < end and at + max(len(piece), 1) > start for start, end in spans)
               for at, piece in zip(starts, pieces))


def tokens_ending_by(pieces: list[str], at: int) -> int:
    """How many of the first tokens end at or before character `at`."""
    return sum(1 for end in itertools.accumulate(map(len, pieces)) if end <= at)


@dataclass(frozen=True)
class HarmonyParser:
    """gpt-oss's (`openai_gptoss`): the reasoning is the bodies of its `analysis` messages (None where it writes
    none), the content the rest (openai_api/harmony.py)."""

    def prepare(self, generate: generation_pb2.GenerateRequest) -> None:
        """Its markers are special tokens: the request's text keeps them. A structure is its final message's body."""
        generate.keep_special_tokens = True
        if generate.HasField("structured_output"):
            generate.structured_output.harmony_final = True

    def split(self, text: str) -> tuple[str | None, str]:
        return self.read(text)[:2]

    def read(self, text: str) -> tuple[str | None, str, str | None]:
        """split's (reasoning, content), and where more body text would go: "reasoning" or "content" where the
        text ends inside a body, else None."""
        found = harmony.messages(text)
        thought = [m for m in found if _thought(m)]
        content = "".join(_content(m, text) for m in found if not _thought(m))
        last = found[-1] if found else None
        going_on = last is not None and not last.end and last.stop == len(text)
        return ("".join(m.body(text) for m in thought) if thought else None), content, \
            ("reasoning" if _thought(last) else "content") if going_on else None

    def reasoning_tokens(self, pieces: list[str]) -> int:
        """The tokens with text in an analysis message's body (its header and end left out, as vLLM counts)."""
        text = "".join(pieces)
        return tokens_within(pieces, [(m.start, m.stop) for m in harmony.messages(text) if _thought(m)])

    def leading_thought(self, pieces: list[str]) -> int:
        """The first tokens that end before the answer's text begins (all of them where it never does); 0 where
        the output does not reason."""
        text = "".join(pieces)
        found = harmony.messages(text)
        if not any(map(_thought, found)):
            return 0
        return tokens_ending_by(pieces, next((m.start for m in found if not _thought(m)), len(text)))

    def stream(self) -> "HarmonyStream":
        return HarmonyStream(self)


def _thought(message: harmony.Message) -> bool:
    return message.channel == "analysis" and not message.call


def _content(message: harmony.Message, text: str) -> str:
    """A message's part of the content: its body, or, a call's, the call written back (closed where anything
    follows it)."""
    if not message.call:
        return message.body(text)
    return harmony.call_block(message, text, closed=bool(message.end) or message.stop < len(text))


NAMES = ("deepseek_r1", "qwen3", "gemma4", "seed_oss", "openai_gptoss")    # the <think> format twice, Gemma 4's
HARMONY = HarmonyParser()                                      # channel, Seed-OSS's and harmony, as vLLM names them
MARKERS = {"gemma4": dict(start=GEMMA_START, end=GEMMA_END, label=GEMMA_LABEL, special=True),
           "seed_oss": dict(start="<seed:think>", end="</seed:think>")}


def for_request(name: str, prompt: str) -> ReasoningParser | HarmonyParser | None:
    """How a request's output splits (its parser's prepare() readies the request for it): not at all without a
    parser; harmony as gpt-oss writes it; else as its prompt leaves the thinking (open: the output begins as
    reasoning)."""
    if name not in NAMES:
        return None
    if name == "openai_gptoss":
        return HARMONY
    markers = MARKERS.get(name, {})
    return ReasoningParser(opens_reasoning=prompt.rstrip().endswith(markers.get("start", START)), **markers)


class ReasoningStream:
    """One streamed choice split as its whole output would be: each piece of text -> (its reasoning, its content),
    holding back what may still begin `<think>` (at the start) or `</think>`, as stop strings are held."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.state = "opening"      # opening (not known yet whether it reasons), reasoning, content
        self.held = ""
        self.said = False           # some reasoning was sent
        self.labelled = not parser.label    # the reasoning's label is past (or it has none)

    def feed(self, piece: str) -> tuple[str | None, str]:
        """(the reasoning to send, None: none; the content to send)."""
        self.held += piece
        if self.state == "opening":
            opened = self.held.lstrip()
            start = self.parser.start
            if start.startswith(opened) and opened != start:      # blank, or a part of <think>: not known yet
                return None, ""
            self._decided()
        return self._sent(final=False)

    def finish(self) -> tuple[str | None, str]:
        """What is still held, at the end of the output."""
        if self.state == "opening":
            self._decided()
        return self._sent(final=True)

    def _decided(self) -> None:
        body = self.parser.body(self.held)
        self.state, self.held = ("content", self.held) if body is None else ("reasoning", body)

    def _sent(self, final: bool) -> tuple[str | None, str]:
        """What can be sent now: reasoning up to </think> (or all at the end), holding a tail that may begin it;
        an empty reasoning once, where it ends without any (the whole answer's `reasoning` is "")."""
        reasoning, end = None, self.parser.end
        if self.state == "reasoning" and not self.labelled:
            label = self.parser.label
            if label.startswith(self.held) and len(self.held) < len(label) and not final:
                return None, ""                 # may still be the label
            self.held, self.labelled = self.held.removeprefix(label), True
        if self.state == "reasoning":
            at = self.held.find(end)
            if at < 0 and not final:
                keep = max((n for n in range(1, len(end)) if self.held.endswith(end[:n])), default=0)
                reasoning, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
                return self._said(reasoning or None), ""
            at = len(self.held) if at < 0 else at
            reasoning, self.held, self.state = self.held[:at], self.held[at + len(end):], "content"
            reasoning = self._said(reasoning if reasoning or not self.said else None)
        content, self.held = self.held, ""
        return reasoning, content

    def _said(self, reasoning: str | None) -> str | None:
        self.said = self.said or reasoning is not None
        return reasoning


class HarmonyStream:
    """One streamed choice of harmony output split as the whole would be: each piece -> (its reasoning, None: none
    to send; its content), holding back a tail that may still become a marker or open a header."""

    def __init__(self, parser: HarmonyParser):
        self.parser, self.text = parser, ""
        self.reasoned, self.said = None, 0      # the reasoning sent (None: none yet), characters of content sent
        self.going_on = None                    # the text sent ends inside a body of this kind (HarmonyParser.read)

    def feed(self, piece: str) -> tuple[str | None, str]:
        self.text += piece
        if self.going_on and "<" not in piece:      # no marker can begin in it: it is the body's (no parse, so
            return self._more(piece)                # that a long answer streams in linear time)
        return self._sent(self.text[:harmony.held(self.text)])

    def finish(self) -> tuple[str | None, str]:
        return self._sent(self.text)

    def _sent(self, text: str) -> tuple[str | None, str]:
        """What the split of `text` holds past what was sent: reasoning once it has begun (an empty one once)."""
        reasoning, content, going_on = self.parser.read(text)
        self.going_on = going_on if text == self.text else None
        new = None if reasoning is None else reasoning[len(self.reasoned or ""):]
        new = new if new or self.reasoned is None else None
        self.reasoned = self.reasoned if new is None else (self.reasoned or "") + new
        piece, self.said = content[self.said:], len(content)
        return new, piece

    def _more(self, piece: str) -> tuple[str | None, str]:
        if self.going_on == "reasoning":
            self.reasoned += piece
            return piece or None, ""
        self.said += len(piece)
        return None, piece
