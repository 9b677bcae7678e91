"""Reasoning parsers (`http.reasoning_parser`): a thinking model's output split into its reasoning and its answer,
as vLLM's reasoning parsers of the same names split it. A chat answer carries the reasoning in its message (a
stream, in its deltas) twice: as `reasoning`, vLLM's field since it followed OpenAI's guidance for gpt-oss, and as
`reasoning_content`, DeepSeek's, which many clients still read. The content is the rest, out of which the tool
parser then reads calls.

- `deepseek_r1`: the output begins as reasoning (the chat template opens `<think>` in the prompt; one the model
  writes itself is left out) until `</think>`; an output without it is all reasoning.
- `qwen3`: only an output that opens with `<think>` (after blank space) reasons, until `</think>`; any other is all
  content (thinking turned off, `chat_template_kwargs: {"enable_thinking": false}`).

    http: {reasoning_parser: qwen3}       # deploy/local.yaml
"""
from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    opens_reasoning: bool       # the output begins as reasoning without <think> (deepseek_r1)

    def split(self, text: str) -> tuple[str | None, str]:
        """(the reasoning, None where the output does not reason; the content) of a whole output."""
        body = self._body(text)
        if body is None:
            return None, text
        reasoning, _, content = body.partition(END)
        return reasoning, content

    def _body(self, text: str) -> str | None:
        """What follows an opening <think> (the output itself where it opens as reasoning), None: no reasoning."""
        opened = text.lstrip()
        if opened.startswith(START):
            return opened[len(START):]
        return text if self.opens_reasoning else None


PARSERS = {"deepseek_r1": ReasoningParser(opens_reasoning=True), "qwen3": ReasoningParser(opens_reasoning=False)}


class ReasoningStream:
    """One streamed choice split as its whole output would be: each piece of text -> (its reasoning, its content),
    holding back what may still begin `<think>` (at the start) or `</think>`, as stop strings are held."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.state = "opening"      # opening (not known yet whether it reasons), reasoning, content
        self.held = ""

    def feed(self, piece: str) -> tuple[str, str]:
        self.held += piece
        if self.state == "opening":
            opened = self.held.lstrip()
            if START.startswith(opened) and opened != START:      # blank, or a part of <think>: not known yet
                return "", ""
            body = self.parser._body(self.held)
            self.state, self.held = ("content", self.held) if body is None else ("reasoning", body)
        return self._sent(final=False)

    def finish(self) -> tuple[str, str]:
        """What is still held, at the end of the output."""
        if self.state == "opening":
            body = self.parser._body(self.held)
            self.state, self.held = ("content", self.held) if body is None else ("reasoning", body)
        return self._sent(final=True)

    def _sent(self, final: bool) -> tuple[str, str]:
        reasoning = ""
        if self.state == "reasoning":
            at = self.held.find(END)
            if at < 0:
                keep = 0 if final else max((n for n in range(1, len(END)) if self.held.endswith(END[:n])), default=0)
                reasoning, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
                return reasoning, ""
            reasoning, self.held, self.state = self.held[:at], self.held[at + len(END):], "content"
        content, self.held = self.held, ""
        return reasoning, content
