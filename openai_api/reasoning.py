"""Reasoning parsers (`http.reasoning_parser`, `deepseek_r1` or `qwen3`, vLLM's names for the `<think>` format):
a thinking model's output split into its reasoning and its answer. A chat answer carries the reasoning in its
message (a stream, in its deltas) twice: as `reasoning`, vLLM's field since it followed OpenAI's guidance for
gpt-oss, and as `reasoning_content`, DeepSeek's, which many clients still read. The content is the rest, out of
which the tool parser then reads calls.

The output reasons when the prompt opened the thinking (its generation prompt ends with `<think>`, as
DeepSeek-R1's and Qwen3-Thinking's templates end it) or when the output opens with `<think>` itself (Qwen3 with
thinking on); the reasoning runs to the first `</think>` (all of the output, cut before one). Any other output is
all content: thinking turned off closes it in the prompt (Qwen3's `enable_thinking: false`, DeepSeek V3.1's default
mode). Under structured output (which constrains the whole output from its first token) nothing is split.

    http: {reasoning_parser: qwen3}       # deploy/local.yaml
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    opens_reasoning: bool       # the prompt opened the thinking: the output begins as reasoning without <think>

    def split(self, text: str) -> tuple[str | None, str]:
        """(the reasoning, None where the output does not reason; the content) of a whole output."""
        body = self.body(text)
        if body is None:
            return None, text
        reasoning, _, content = body.partition(END)
        return reasoning, content

    def span(self, text: str) -> tuple[int, int] | None:
        """Where the reasoning lies in a whole output, (start, end) in characters; None where it does not reason."""
        body = self.body(text)
        if body is None:
            return None
        start, end = len(text) - len(body), body.find(END)
        return start, start + (len(body) if end < 0 else end)

    def reasoning_tokens(self, pieces: list[str]) -> int:
        """How many of an output's tokens (`pieces`: each one's text) reason: those with text in the reasoning, as
        vLLM counts them (the <think> and </think> markers left out); 0 where the output does not reason."""
        span = self.span("".join(pieces))
        if span is None:
            return 0
        starts = itertools.accumulate(map(len, pieces), initial=0)
        return sum(at < span[1] and at + max(len(piece), 1) > span[0] for at, piece in zip(starts, pieces))

    def leading_thought(self, pieces: list[str]) -> int:
        """How many of an output's first tokens (`pieces`: each one's text) hold only its reasoning and markers:
        those that end before its answer begins (after the first </think>; all of them where it is cut before
        one); 0 where the output does not reason."""
        text = "".join(pieces)
        span = self.span(text)
        if span is None:
            return 0
        start = span[1] + len(END) if text.startswith(END, span[1]) else len(text)
        return sum(1 for end in itertools.accumulate(map(len, pieces)) if end <= start)

    def body(self, text: str) -> str | None:
        """What follows an opening <think> (the output itself where it opens as reasoning), None: no reasoning."""
        opened = text.lstrip()
        if opened.startswith(START):
            return opened[len(START):]
        return text if self.opens_reasoning else None


NAMES = ("deepseek_r1", "qwen3")       # both the <think> format, as vLLM names its parsers for it


def for_request(name: str, prompt: str, constrained: bool) -> ReasoningParser | None:
    """How a request's output splits: not at all without a parser or under structured output; else as its prompt
    leaves the thinking (open: the output begins as reasoning)."""
    if name not in NAMES or constrained:
        return None
    return ReasoningParser(opens_reasoning=prompt.rstrip().endswith(START))


class ReasoningStream:
    """One streamed choice split as its whole output would be: each piece of text -> (its reasoning, its content),
    holding back what may still begin `<think>` (at the start) or `</think>`, as stop strings are held."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.state = "opening"      # opening (not known yet whether it reasons), reasoning, content
        self.held = ""
        self.said = False           # some reasoning was sent

    def feed(self, piece: str) -> tuple[str | None, str]:
        """(the reasoning to send, None: none; the content to send)."""
        self.held += piece
        if self.state == "opening":
            opened = self.held.lstrip()
            if START.startswith(opened) and opened != START:      # blank, or a part of <think>: not known yet
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
        reasoning = None
        if self.state == "reasoning":
            at = self.held.find(END)
            if at < 0 and not final:
                keep = max((n for n in range(1, len(END)) if self.held.endswith(END[:n])), default=0)
                reasoning, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
                return self._said(reasoning or None), ""
            at = len(self.held) if at < 0 else at
            reasoning, self.held, self.state = self.held[:at], self.held[at + len(END):], "content"
            reasoning = self._said(reasoning if reasoning or not self.said else None)
        content, self.held = self.held, ""
        return reasoning, content

    def _said(self, reasoning: str | None) -> str | None:
        self.said = self.said or reasoning is not None
        return reasoning
