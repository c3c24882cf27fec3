"""gpt-oss's output format, harmony: vLLM's ``--reasoning-parser openai_gptoss`` and
``--tool-call-parser openai``. The chat template ends the prompt with ``<|start|>assistant``; the
model then writes messages, each a header and a body:

    <|channel|>analysis<|message|>The user asks ...<|end|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.            (then <|return|>: EOS)
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}
                                                                         (then <|call|>: EOS)

Those markers are special tokens, so a request read this way keeps special tokens in its text
(as vLLM's harmony parsing reads token ids). ``analysis`` is the thinking (the message's
``reasoning``), ``final`` and ``commentary`` without a recipient (a preamble to the user) its
``content``; a message to a built-in tool (``to=browser.search``) is the model's own business,
so thinking too. A message to ``functions.NAME`` is a tool call: the reasoning reader passes it
to the content as ``<|channel|>commentary to=functions.NAME<|message|>BODY``, which the
``openai`` tool-call reader (``HarmonyCalls``) holds and reads as calls when the choice ends.
Only what is shown changes: tokens, logprobs and exactness are the target's own."""

from __future__ import annotations

import json
import re

from specctl.gateway.tool_calls import TaggedCalls, new_call

CHANNEL, MESSAGE, END, CALL, RETURN = "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>"
ENDS = (END, CALL, RETURN)  # what closes a message (<|call|> and <|return|> are EOS: in the text only past ignore_eos)
RECIPIENT = re.compile(r"to=(\S+?)(?=\s|<\||$)")
CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")
CALL_SEGMENT = re.compile(re.escape(CHANNEL) + r"commentary to=functions\.(\S+?)" + re.escape(MESSAGE))


class StreamedHarmony:
    """A choice's text pushed as it comes: (reasoning, content) to hand out for each piece, as
    gateway.reasoning's StreamedReasoning. A header is held until its ``<|message|>``; a body goes
    out as it comes — its end tag, a special token, is whole in the piece that brings it (the
    pieces are tokens' texts). ``finish``: a header cut short (max_tokens) is markup, dropped."""

    def __init__(self) -> None:
        self.header = ""  # a header being read
        self.route: str | None = None  # in a body: "reasoning", "content" or "call"; None: reading a header

    def push(self, delta: str) -> tuple[str, str]:
        reasoning, content = [], []
        text = delta
        while text:
            if self.route is None:
                header, found, text = (self.header + text).partition(MESSAGE)
                self.header = "" if found else header
                if not found:
                    break
                self.route, opening = _route(header)
                content.append(opening)
                continue
            cut, end = min(((text.find(tag), tag) for tag in ENDS if tag in text), default=(len(text), ""))
            (reasoning if self.route == "reasoning" else content).append(text[:cut])
            if not end:
                break
            if self.route == "call" and end == CALL:  # the call's close, where the text has it (past ignore_eos)
                content.append(end)
            self.route, text = None, text[cut + len(end):]
        return "".join(reasoning), "".join(content)

    def finish(self) -> str:
        self.header = ""
        return ""


def _route(header: str) -> tuple[str, str]:
    """Where a message's body goes, by its header, and the text its opening adds to the content
    (a function call's normalised header)."""
    channel = CHANNEL_NAME.search(header)
    recipient = RECIPIENT.search(header)
    if recipient and recipient.group(1).startswith("functions."):
        return "call", f"{CHANNEL}commentary to={recipient.group(1)}{MESSAGE}"
    if recipient or channel is None or channel.group(1) == "analysis":
        return "reasoning", ""
    return "content", ""


def split_harmony(text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole output, None where there is none: the streamed split of it
    in one piece, so a whole answer and a stream's pieces agree."""
    reader = StreamedHarmony()
    reasoning, content = reader.push(text)
    reasoning += reader.finish()
    return reasoning or None, content or None


def HarmonyCalls(max_calls: int | None = None) -> TaggedCalls:  # noqa: N802 - a reader class, as StreamedCalls
    """The ``openai`` tool-call reader: content until the first function-call message (as
    StreamedHarmony passes it on), streamed; from there held and read when the choice ends — each
    ``functions.NAME`` message a call, its body (a JSON object) the arguments; else content."""
    return TaggedCalls(CHANNEL, harmony_calls, max_calls)


def harmony_calls(text: str) -> list[dict] | None:
    """The calls of ``<|channel|>commentary to=functions.NAME<|message|>{...}`` segments (each
    maybe closed by ``<|call|>``), or None when the text is not calls alone."""
    calls, at = [], 0
    decoder = json.JSONDecoder()
    while at < len(text):
        segment = CALL_SEGMENT.match(text, at)
        if segment is None:
            return None
        try:
            arguments, end = decoder.raw_decode(text, segment.end())
        except (json.JSONDecodeError, RecursionError):
            return None
        if not isinstance(arguments, dict):
            return None
        calls.append(new_call(segment.group(1), json.dumps(arguments, ensure_ascii=False)))
        at = end + len(CALL) if text.startswith(CALL, end) else end
        at += len(text[at:]) - len(text[at:].lstrip())
    return calls or None


def serving_parsers(model_type: str, reasoning_parser: str | None, tool_call_parser: str) -> tuple[str | None, str]:
    """The parsers a gateway serves ``model_type`` with: a gpt-oss model's output is harmony, so as
    vLLM reads it without being told, the harmony readers stand in for none given (no reasoning
    parser; the tool-call parser's default, hermes, which gpt-oss never writes)."""
    if model_type != "gpt_oss":
        return reasoning_parser, tool_call_parser
    reasoning = reasoning_parser or "openai_gptoss"
    return reasoning, "openai" if tool_call_parser == "hermes" and reasoning == "openai_gptoss" else tool_call_parser
