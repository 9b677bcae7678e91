"""OpenAI's harmony format (gpt-oss): an output read as the messages it writes, for the `openai_gptoss` reasoning
parser (openai_api/reasoning.py) and the `openai` tool-call parser (openai_api/tools.py), vLLM's names for them.

The chat template's generation prompt ends with `<|start|>assistant`, so the output opens with the rest of a
message's header. Each message is a header, `<|message|>`, its body, and an end:

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny in Oslo.<|return|>

(one line here, none between them in the output). The header names the message's channel (`analysis`: the
reasoning; `final`: the answer; `commentary`: calls, and preambles before them) and, for a call, its recipient
(`to=functions.NAME`, after the channel or after the role). `<|return|>` and `<|call|>` are end-of-sequence
tokens, so the output's last message usually has no end in the text. The markers are special tokens: a request
read this way keeps them in its text (GenerateRequest.keep_special_tokens).

Text outside any message (an output that writes no header) is read as it is written. A header cut off by the end of
the output is no message yet; one that another header or an end interrupts before its `<|message|>` is dropped.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

START, MESSAGE = "<|start|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
MARKERS = (START, "<|channel|>", MESSAGE, "<|constrain|>", *ENDS)
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"(?:^|\s|>)to=([^\s<]+)")
_STOPS = re.compile("|".join(re.escape(marker) for marker in (START, *ENDS)))
FUNCTIONS = "functions."


@dataclass(frozen=True)
class Message:
    channel: str            # "" where the header names none; None: text outside any message
    recipient: str          # "functions.get_weather" for a call, else ""
    start: int              # where its body (or the outside text) begins in the output
    stop: int               # ... and ends
    end: str                # its end marker, "" where the output (or the next header) cut it

    @property
    def call(self) -> str | None:
        """The function it calls (its recipient without `functions.`), None where it calls none."""
        return self.recipient.removeprefix(FUNCTIONS) if self.recipient else None

    def body(self, text: str) -> str:
        return text[self.start:self.stop]


def opens_with_header(text: str) -> bool:
    """Whether the output begins inside a message's header (as the generation prompt leaves it)."""
    opened = text.lstrip()
    return opened.startswith(("<|channel|>", "to=", START))


def messages(text: str) -> list[Message]:
    """The output's messages and the text outside them, in order."""
    found, at = [], 0
    header = 0 if opens_with_header(text) else None
    while True:
        if header is None:
            header = text.find(START, at)
            header = len(text) if header < 0 else header
            if header > at:
                found.append(Message(None, "", at, header, ""))
            if header == len(text):
                return found
        read = _read(text, header)
        if read is None:                # cut off by the end of the output: no message yet
            return found
        message, at = read
        found += [message] if message else []
        header = None


def _read(text: str, header: int) -> tuple[Message | None, int] | None:
    """The message whose header begins at `header` and where the text after it goes on; None where its header is
    cut off by the end of the output; (None, where it was interrupted) where another header or an end interrupts
    it before its `<|message|>`."""
    opened = header + len(START) if text.startswith(START, header) else header
    body = text.find(MESSAGE, opened)
    interrupted = _STOPS.search(text, opened, body if body >= 0 else len(text))
    if interrupted:                     # dropped, up to the next header (an end with it)
        return None, interrupted.start() if interrupted.group() == START else interrupted.end()
    if body < 0:
        return None
    words, body = text[opened:body], body + len(MESSAGE)
    stop = _STOPS.search(text, body)
    stop_at = stop.start() if stop else len(text)
    end = stop.group() if stop and stop.group() != START else ""
    channel, recipient = _CHANNEL.search(words), _RECIPIENT.search(words)
    message = Message(channel[1] if channel else "", recipient[1] if recipient else "", body, stop_at, end)
    return message, stop_at + len(end)


def held(text: str) -> int:
    """How much of a streamed output reads now as it will whole: all but a tail that may still become a marker, or
    all of it held while it may still open a header."""
    opened = text.lstrip()
    if any(opening.startswith(opened) for opening in ("<|channel|>", "to=", START)):
        return 0
    tails = [n for marker in MARKERS for n in range(1, len(marker)) if text.endswith(marker[:n])]
    return len(text) - max(tails, default=0)


def call_block(message: Message, text: str) -> str:
    """A call written back as one message (the content the `openai` tool-call parser reads calls out of)."""
    return f"{START}assistant to={message.recipient}<|channel|>{message.channel}{MESSAGE}{message.body(text)}" \
           f"{message.end}"
