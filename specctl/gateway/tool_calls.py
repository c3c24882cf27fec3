"""A choice's tool calls read back from the target's text (gateway.tools checks what a request
asks): the Hermes ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks of a free
output, or a forced call's JSON. Streamed as vLLM's Hermes parser streams them: the content up
to the first ``<tool_call>``, then each call's id and name as soon as its name is read, then
its arguments as the model writes them — the model's own text, so the pieces join into the
arguments a whole answer carries. A text whose blocks do not parse stays content; a call
already streamed when its block turns out malformed or cut short (max_tokens) stays streamed,
with the target's finish_reason, as vLLM leaves it."""

from __future__ import annotations

import json
import re
import uuid
from typing import Callable

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# A block up to its arguments' first character, name first as the Hermes templates write
# calls; a block in another shape ({"name": ...} alone, keys the other way round) is read whole
# when it closes.
HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\S)')


def opens_calls(text: str, opens: tuple[str, ...]) -> bool | None:
    """Whether an output whose format opens calls with one of ``opens`` is calls (None: not
    known yet — only whitespace so far, or a tag begun)."""
    opening = text.lstrip()
    if not opening or any(tag.startswith(opening) for tag in opens if len(tag) > 1):
        return None
    return opening.startswith(opens)


def held_back(text: str, tag: str, start: int = 0, end: int | None = None) -> int:
    """How many characters at the end of ``text`` (or of ``text[start:end]``) may begin ``tag``
    (held back until known)."""
    return max((k for k in range(1, len(tag)) if text.endswith(tag[:k], start, end)), default=0)


def content_before(text: str, sent: int, start: int, tag: str) -> tuple[str, int, int]:
    """A streamed text's content up to its first ``tag``: ``sent`` characters already handed out,
    ``start`` where the tag begins (-1: not seen yet; the text handed out holds no tag's start, so
    the search goes from there), a tag begun at the end held back. Returns (content to hand out
    now, sent, start)."""
    if start < 0:
        start = text.find(tag, sent)
    upto = start if start >= 0 else len(text) - held_back(text, tag)
    return (text[sent:upto] if upto > sent else ""), max(sent, upto), start


class CallsAfterTag:
    """Content that streams until the first ``tag`` (a tag begun held back), then calls, which a
    subclass's ``_read`` reads as they come (the deltas the text adds; called once the tag is seen)."""

    finish_reason = "tool_calls"
    tag: str

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self.text = ""
        self.sent = 0  # characters of content handed out
        self.start = -1  # where the first tag begins (-1: not yet)

    def push(self, delta: str) -> tuple[str, list[dict]]:
        """(content to hand out, tool-call deltas to hand out)."""
        self.text += delta
        content, self.sent, self.start = content_before(self.text, self.sent, self.start, self.tag)
        return content, (self._read() if self.start >= 0 else [])

    def _read(self) -> list[dict]:
        raise NotImplementedError

    def _all_content(self) -> tuple[str, list[dict], None]:
        """finish's answer when the text holds no call: what was not handed out (the tag and all)."""
        rest, self.sent = self.text[self.sent:], len(self.text)
        return rest, [], None


class TaggedCalls(CallsAfterTag):
    """Calls that follow content after a tag (Mistral's ``[TOOL_CALLS]``, GLM-4.5's
    ``<tool_call>``, gpt-oss's harmony ``<|channel|>``): the content until the first tag streams
    (a tag begun held back); from the tag on the text is held and ``parse``d when the choice ends —
    the calls (None: not calls, and all of it is content, tag and all). ``new_id``: an id of the
    model's own shape (Mistral's templates take back 9 letters and digits only)."""

    def __init__(self, tag: str, parse: Callable[[str], list[dict] | None], max_calls: int | None = None,
                 new_id: Callable[[], str] | None = None) -> None:
        super().__init__(max_calls)
        self.tag, self.parse, self.new_id = tag, parse, new_id

    def _read(self) -> list[dict]:
        return []  # held to the end

    def finish(self) -> tuple[str, list[dict], list[dict] | None]:
        calls = self.parse(self.text[self.start:]) if self.start >= 0 else None
        if calls is None:
            return self._all_content()
        calls = calls[:self.max_calls]
        for call in calls if self.new_id else ():
            call["id"] = self.new_id()
        return "", [call_delta(i, call, call["function"]["arguments"]) for i, call in enumerate(calls)], calls


def new_call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": arguments}}


def call_delta(index: int, call: dict, arguments: str) -> dict:
    """A call's first delta in a stream: its id, type and name (a fresh dict: the call grows)."""
    return {"index": index, "id": call["id"], "type": "function",
            "function": {"name": call["function"]["name"], "arguments": arguments}}


def more_arguments(calls: list[dict], deltas: list[dict], piece: str) -> None:
    """``piece`` of the last call's arguments: kept on the call (the pieces join into them) and
    added to the deltas to hand out (nothing for an empty piece)."""
    if piece:
        calls[-1]["function"]["arguments"] += piece
        deltas.append({"index": len(calls) - 1, "function": {"arguments": piece}})


def _whole(body: str) -> dict | None:
    try:
        call = json.loads(body)
    except (json.JSONDecodeError, RecursionError):  # RecursionError: a model's text nested past json's depth
        return None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
        return None
    return new_call(call["name"], json.dumps(call.get("arguments", {}), ensure_ascii=False))


def _arguments_end(text: str, start: int, end: int, closed: bool) -> int | None:
    """Where a header's arguments, from ``start`` of a block's body ending at ``end``, end as far
    as they are surely the arguments: the block's closing brace and the whitespace around it (and
    a tag maybe begun, closing this block or opening the next) held back. None: a closed block whose arguments are not the JSON of a call.
    Read from the end, so a long argument streamed in small pieces stays linear."""
    if not closed:  # a tag begun: this block's end, or the next block's start (which ends this one)
        end -= max(held_back(text, CLOSE, start, end), held_back(text, OPEN, start, end))
    end = _space_before(text, start, end)
    if end > start and text[end - 1] == "}":
        return _space_before(text, start, end - 1)
    return None if closed else end


def _space_before(text: str, start: int, end: int) -> int:
    """``end`` moved back over whitespace (``str.rstrip``'s), not past ``start``."""
    while end > start and text[end - 1].isspace():
        end -= 1
    return end


class StreamedCalls:
    """A choice's text with tools, pushed as it comes: the content and the calls' deltas to
    hand out; ``finish`` reads what is left once the choice ended."""

    def __init__(self, max_calls: int | None = None, finish_reason: str = "tool_calls") -> None:
        self.max_calls = max_calls  # parallel_tool_calls false: 1 (the blocks after it are not read)
        self.finish_reason = finish_reason  # a forced named call's: "stop", OpenAI's (gateway.tools)
        self.text = ""
        self.sent = 0  # characters of content handed out
        self.start = -1  # where the first <tool_call> begins (-1: not yet)
        self.calls: list[dict] = []  # the calls begun, as OpenAI's (arguments handed out so far)
        self._starts: list[int] = []  # where each begun call's arguments start in the text
        self._read_blocks = 0  # blocks read to their end
        self._block_at: int | None = None  # where the block being read starts (None: its tag not seen)
        self._open_from = self._close_from = 0  # where the next tags are looked for (each character read once)
        self._broken = False  # a block that is no call: nothing after it is read

    def push(self, delta: str) -> tuple[str, list[dict]]:
        """(content to hand out, tool-call deltas to hand out)."""
        self.text += delta
        content, self.sent, self.start = content_before(self.text, self.sent, self.start, OPEN)
        return content, self._read(final=False) if self.start >= 0 else []

    def finish(self) -> tuple[str, list[dict], list[dict] | None]:
        """(content not yet handed out, the last deltas, every call — None when the text holds
        a block that is no call: a whole answer keeps its text as content)."""
        deltas = self._read(final=True) if self.start >= 0 else []
        if self.calls:
            return "", deltas, None if self._broken else self.calls
        rest, self.sent = self.text[self.sent:], len(self.text)
        return rest, [], None

    def _read(self, final: bool) -> list[dict]:
        """The deltas the text read since the last call adds: blocks run from a <tool_call> to the
        next (a block's body up to its </tool_call>), at most max_calls of them."""
        deltas: list[dict] = []
        text = self.text
        while not self._broken and (self.max_calls is None or self._read_blocks < self.max_calls):
            if self._block_at is None:  # the next block's tag not seen yet
                tag = text.find(OPEN, self._open_from)
                if tag < 0:
                    self._open_from = max(self._open_from, len(text) - len(OPEN) + 1)
                    break
                self._block_at = self._open_from = self._close_from = tag + len(OPEN)
            i, at = self._read_blocks, self._block_at
            next_open = text.find(OPEN, self._open_from)
            if next_open < 0:
                self._open_from = max(at, len(text) - len(OPEN) + 1)  # a tag begun at the end is read again
            block_end = next_open if next_open >= 0 else len(text)
            close = text.find(CLOSE, self._close_from, block_end)
            if close < 0:
                self._close_from = max(at, block_end - len(CLOSE) + 1)
            # a block is closed by its tag, or by the next block's when that one is read too
            closed = final or close >= 0 or (next_open >= 0 and (self.max_calls is None or i + 1 < self.max_calls))
            body_end = close if close >= 0 else block_end  # the last block may end without its tag
            if i == len(self.calls):  # not begun
                header = HEADER.match(text, at, body_end)
                if header is None:
                    if not closed:
                        break
                    call = _whole(text[at:body_end])
                    if call is None:
                        self._broken = True
                        break
                    self.calls.append(call)
                    self._starts.append(body_end)
                    deltas.append(call_delta(i, call, call["function"]["arguments"]))
                    self._next_block(next_open)
                    continue
                self.calls.append(new_call(json.loads(header.group(1)), ""))
                self._starts.append(header.end())
                deltas.append(call_delta(i, self.calls[i], ""))
            function, start = self.calls[i]["function"], self._starts[i]
            end, sent = _arguments_end(text, start, body_end, closed), start + len(function["arguments"])
            if end is None or end < sent or (closed and not _fits(text[at:body_end], text[start:end])):
                self._broken = True
                break
            if piece := text[sent:end]:
                function["arguments"] += piece
                deltas.append({"index": i, "function": {"arguments": piece}})
            if not closed:
                break
            self._next_block(next_open)
        return deltas

    def _next_block(self, tag: int) -> None:
        """The block read to its end: the next starts after ``tag`` (-1: not seen yet)."""
        self._read_blocks += 1
        self._block_at = None
        if tag >= 0:
            self._block_at = self._open_from = self._close_from = tag + len(OPEN)


def _fits(body: str, arguments: str) -> bool:
    """Whether a header's closed block is one call whose arguments are ``arguments``."""
    whole = _whole(body)
    try:
        return whole is not None and json.loads(whole["function"]["arguments"]) == json.loads(arguments)
    except (json.JSONDecodeError, RecursionError):  # RecursionError: a model's text nested past json's depth
        return False


def read_whole(reader: "StreamedCalls | ForcedCalls", text: str) -> tuple[str, list[dict] | None]:
    """A whole answer's text read by ``reader``: (its content — all of the text when it holds
    no call —, the calls or None)."""
    content, _ = reader.push(text)
    rest, _, calls = reader.finish()
    return (content + rest, calls) if calls else (text, None)


def parse(text: str) -> tuple[str | None, list[dict]] | None:
    """A whole text's (content before the first call, None when there is none; the calls in
    OpenAI's shape) — or None when it holds no call, or a block that is none."""
    content, calls = read_whole(StreamedCalls(), text)
    if calls is None:
        return None
    return content if content.strip() else None, calls


class ForcedCalls:
    """A choice whose output was held to a forced call's schema (gateway.tools.forced_call):
    nothing is content. A named function's output is its arguments, streamed as they come;
    "required"'s list of calls is read at the end (a list cut short by max_tokens does not
    parse and stays content)."""

    def __init__(self, named: str | None) -> None:
        self.named, self.text = named, ""
        self.finish_reason = "stop" if named is not None else "tool_calls"
        self.call = new_call(named, "") if named is not None else None
        self._begun = False

    def push(self, delta: str) -> tuple[str, list[dict]]:
        self.text += delta
        if self.call is None or not (delta or not self._begun):
            return "", []
        self.call["function"]["arguments"] = self.text
        if self._begun:
            return "", [{"index": 0, "function": {"arguments": delta}}]
        self._begun = True
        return "", [call_delta(0, self.call, delta)]

    def finish(self) -> tuple[str, list[dict], list[dict] | None]:
        if self.call is not None:
            return "", self.push("")[1], [self.call]
        try:
            calls = [new_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in json.loads(self.text)]
        except (json.JSONDecodeError, RecursionError, TypeError, KeyError):
            return self.text, [], None
        return "", [call_delta(i, call, call["function"]["arguments"]) for i, call in enumerate(calls)], calls
