"""The hermes parser's reader (``--tool-call-parser hermes``, the default): Hermes
``<tool_call>`` blocks (gateway.tool_calls), and — as llama.cpp's Hermes 2 Pro parser reads
them — calls a model writes as a markdown JSON block instead. Qwen2.5-Coder, whose template asks
for ``<tool_call>`` tags, answers a request with tools with
```` ```json\\n{"name": "get_weather", "arguments": {...}}\\n``` ```` (7 of 8 prompts tried);
vLLM's hermes parser leaves that as content, so no call ever came back from the default pair.

An output that opens with such a block (```` ``` ```` or ```` ```json ````, then a name-first
object) is calls when the first object's name is one of the request's tools: its name-first
objects, separated by whitespace, then the closing ```` ``` ```` and nothing more, streamed as
llama3_json's are (each call's id and name once read, its arguments as written). A block that
turns out not to be that is content, all of it (a call already streamed stays, as vLLM leaves
it); a JSON block whose object names no tool (``{"name": "Alice", "age": 30}``) is content
from the start, and so is a block after other text (a coder model's answers are full of code
blocks). While the opening could still be a call block, nothing goes out: at most the fence
line and the object's name."""

from __future__ import annotations

import json

import regex

from specctl.gateway.json_calls import ObjectCalls, StreamedJsonCalls
from specctl.gateway.tool_calls import StreamedCalls

FENCE, CLOSER = "```", "`"
# A call block up to its first object's name (regex's partial matching says when a text can still
# become one): the block's body starts where group 1 (empty) stands; group 2 is the name's JSON string
BLOCK = regex.compile(r'\s*```(?:json)?[ \t]*\r?\n()\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')


def block_start(text: str, tool_names: frozenset[str]) -> int | None:
    """Where the body of the call block ``text`` opens with begins; -1 when the text does not
    open with a call block naming one of ``tool_names``; None while it still may."""
    opening = BLOCK.match(text, partial=True)
    if opening is None:
        return -1
    if opening.partial:
        return None
    try:
        name = json.loads(opening.group(2))
    except json.JSONDecodeError:  # an escape JSON does not know ("\x"): no tool's name
        return -1
    return opening.start(1) if name in tool_names else -1


class FencedCalls(StreamedJsonCalls):
    """The name-first objects of a call block whose body starts at ``body_at``, streamed as
    llama3_json's; calls when the block closes with nothing after it (or ``max_calls`` were read:
    the objects after them are not read)."""

    def __init__(self, body_at: int, max_calls: int | None = None, finish_reason: str = "tool_calls") -> None:
        super().__init__(max_calls)
        self.finish_reason = finish_reason
        self.opened = True
        self.objects = ObjectCalls(body_at, " \t\r\n", CLOSER)

    def _complete(self) -> bool:
        if not super()._complete():
            return False
        after = self.objects.after(self.text)  # the closer's first backtick is read already
        return not self.objects.closed or (after.startswith(FENCE[1:]) and not after[2:].strip())


class HermesCalls:
    """A choice's text read for Hermes ``<tool_call>`` blocks or a call block of ``tool_names``
    (the first few characters held until it is known which), pushed as it comes."""

    def __init__(self, max_calls: int | None = None, finish_reason: str = "tool_calls",
                 tool_names: frozenset[str] = frozenset()) -> None:
        self.max_calls, self.finish_reason, self.tool_names = max_calls, finish_reason, tool_names
        self.text = ""
        self.reader: StreamedCalls | FencedCalls | None = None  # None: not known yet

    def push(self, delta: str) -> tuple[str, list[dict]]:
        """(content to hand out, tool-call deltas to hand out)."""
        if self.reader is not None:
            return self.reader.push(delta)
        self.text += delta
        return self._decide(final=False)

    def finish(self) -> tuple[str, list[dict], list[dict] | None]:
        """(content not yet handed out, the last deltas, every call — None when there is none)."""
        content, deltas = self._decide(final=True) if self.reader is None else ("", [])
        rest, more, calls = self.reader.finish()
        return content + rest, deltas + more, calls

    def _decide(self, final: bool) -> tuple[str, list[dict]]:
        start = block_start(self.text, self.tool_names)
        if start is None and not final:
            return "", []
        self.reader = (FencedCalls(start, self.max_calls, self.finish_reason) if start is not None and start >= 0
                       else StreamedCalls(self.max_calls, self.finish_reason))
        return self.reader.push(self.text)
