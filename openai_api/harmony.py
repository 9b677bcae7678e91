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

Text outside any message (an output that writes no header, as one continuing a final message does) is read as a body
of no channel, up to its end. A header cut off by the end of the output is no message yet; one that another header
or an end interrupts before its `<|message|>` is dropped.
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
    """Whether the output begins inside a message's header, as the generation prompt leaves it: with a channel, a
    new message, or a recipient (`to=functions.NAME`) followed by a marker (else `to=` is only text)."""
    opened = text.lstrip()
    return opened.startswith(("<|channel|>", START)) or opened.startswith("to=") and "<|" in opened


def messages(text: str, opened: bool | None = None) -> list[Message]:
    """The output's messages in order, text outside any (no header) read as a body up to the next end or header.
    `opened`: whether the text begins inside a header (None: as opens_with_header reads it; False for a text whose
    headers all begin with <|start|>, such as a split's content)."""
    found, at = [], 0
    header = opens_with_header(text) if opened is None else opened
    while at < len(text):
        if header or text.startswith(START, at):
            read = _read(text, at)
            if read is None:                # cut off by the end of the output: no message yet
                break
            message, at = read
        else:
            message, at = _outside(text, at)
        found += [message] if message else []
        header = False
    return found


def _outside(text: str, at: int) -> tuple[Message, int]:
    """Text outside any header, read as a body of no channel up to the next end (its end) or header."""
    stop = _STOPS.search(text, at)
    stop_at = stop.start() if stop else len(text)
    end = stop.group() if stop and stop.group() != START else ""
    return Message(None, "", at, stop_at, end), stop_at + len(end)


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
    words = text[opened:body]
    channel, recipient = _CHANNEL.search(words), _RECIPIENT.search(words)
    read, at = _outside(text, body + len(MESSAGE))
    return Message(channel[1] if channel else "", recipient[1] if recipient else "", read.start, read.stop,
                   read.end), at


def held(text: str) -> int:
    """How much of a streamed output reads now as it will whole: all but a tail that may still become a marker; none
    of it while it may still open a header (a recipient waits for its first marker)."""
    opened = text.lstrip()
    if any(opening.startswith(opened) for opening in ("<|channel|>", "to=", START)):
        return 0
    tails = [n for marker in MARKERS for n in range(1, len(marker)) if text.endswith(marker[:n])]
    settled = len(text) - max(tails, default=0)
    waiting = text[:settled].lstrip().startswith("to=") and not opens_with_header(text[:settled])
    return 0 if waiting else settled


def call_block(message: Message, text: str, closed: bool) -> str:
    """A call written back as one message (the content the `openai` tool-call parser reads calls out of), its end
    written once it is `closed` (an end, or the next message's header, follows it)."""
    end = message.end or ("<|call|>" if closed else "")
    return f"{START}assistant to={message.recipient}<|channel|>{message.channel}{MESSAGE}{message.body(text)}{end}"
