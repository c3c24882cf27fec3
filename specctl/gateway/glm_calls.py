"""GLM-4.5's and 4.6's tool calls (vLLM's ``glm45``) streamed block by block: content streams
until the first ``<tool_call>``; from there the output is ``<tool_call>NAME\n<arg_key>K</arg_key>
<arg_value>V</arg_value>...</tool_call>`` blocks. Each call's id and name go out as soon as the
name's line ends, its arguments (a JSON object) pair by pair as each ``</arg_value>`` closes one
(``{"K": V`` then ``, "K": V``, and ``}`` when ``</tool_call>`` closes the block) — a value is
JSON only when the whole value is, so nothing of a value can go out before its end. The pieces
join into the arguments a whole answer carries (pairs in the order written, a repeated key
written again: JSON readers keep the last, as a dict would). A block that is not one before
any call went out makes the text from the tag on content, as a whole reading did; a call
already streamed stays streamed when a later block turns out malformed or cut short, with the
target's finish_reason, as vLLM leaves it (and as gateway.json_calls does)."""

from __future__ import annotations

import json
import re

from specctl.gateway.tool_calls import CallsAfterTag, call_delta, more_arguments, new_call

TAG, CLOSE = "<tool_call>", "</tool_call>"
GLM_CALL = re.compile(r"<tool_call>([^\n<]*?)\s*\n(.*?)</tool_call>\s*", re.DOTALL)
GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.DOTALL)
GLM_HEAD = re.compile(r"<tool_call>([^\n<]*?)\s*\n", re.DOTALL)  # a block's name line, as GLM_CALL reads it
GAP = " \t\r\n"
VALUE_CLOSE = "</arg_value>"
SPACE = re.compile(r"\s*")


def glm_calls(text: str) -> list[dict] | None:
    """GLM-4.5's ``<tool_call>NAME\n<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>``
    blocks (as vLLM's glm45 parser reads them), or None when the text is not such blocks alone.
    A value that is JSON (a number, true, an object, a list) is that JSON, any other the text; the
    request's schema is not consulted, so a string parameter given "42" gets 42."""
    calls, at = [], 0
    while at < len(text):
        block = GLM_CALL.match(text, at)
        if block is None or not block.group(1).strip():
            return None
        body, pairs, where = block.group(2), [], 0
        while where < len(body.strip()):
            pair = GLM_ARGUMENT.match(body, where)
            if pair is None:
                return None
            pairs.append(_pair(pair))
            where = pair.end()
        calls.append(new_call(block.group(1).strip(), "{" + ", ".join(pairs) + "}"))
        at = block.end()
    return calls or None


def _pair(match: re.Match) -> str:
    """One argument as its JSON object writes it: ``"K": V``."""
    key, value = match.group(1).strip(), _json_or_text(match.group(2))
    return f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"


def _json_or_text(value: str):
    try:
        return json.loads(value)
    except (json.JSONDecodeError, RecursionError):
        return value


class StreamedGlmCalls(CallsAfterTag):
    """A choice's text with tools, pushed as it comes (as tool_calls.StreamedCalls)."""

    tag = TAG

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self.calls: list[dict] = []  # the calls begun, as OpenAI's
        self._at = -1  # where the next block (or the gap before it) starts (-1: at the first tag)
        self._block: int | None = None  # where the block being read starts, once its name went out
        self._close_from = 0  # where its ``</tool_call>`` is looked for next (each character read once)
        self._pairs = 0  # its arguments streamed so far
        self._pair_at: int | None = None  # where its next argument starts, once its pairs begin
        self._value_from = 0  # where the next </arg_value> is looked for (each character read once)
        self.broken = False

    def finish(self) -> tuple[str, list[dict], list[dict] | None]:
        """(content not yet handed out, the last deltas, every call — None when the text is not
        calls after all)."""
        deltas = self._read() if self.start >= 0 else []
        if not self.calls:  # no tag, or nothing after it that is a call: content, tag and all
            return self._all_content()
        complete = not self.broken and self._block is None and (self._full() or not self.text[self._at:].strip(GAP))
        return "", deltas, self.calls if complete else None

    def _full(self) -> bool:
        """max_calls read (parallel_tool_calls false): the blocks after them are not read."""
        return self.max_calls is not None and len(self.calls) >= self.max_calls and self._block is None

    def _read(self) -> list[dict]:
        """The deltas the text read since the last call adds."""
        deltas: list[dict] = []
        text = self.text
        self._at = max(self._at, self.start)
        while not (self.broken or self._full()):
            if self._block is None and not self._named(deltas):
                break
            close = text.find(CLOSE, max(self._block, self._close_from))
            if close < 0:
                self._close_from = len(text) - len(CLOSE) + 1  # a tag begun at the end is read again
                self._stream_pairs(deltas)
                break
            end = close + len(CLOSE)
            calls = glm_calls(text[self._block:end])
            if calls is None or calls[0]["function"]["name"] != self.calls[-1]["function"]["name"]:
                self.broken = True
                break
            arguments, streamed = calls[0]["function"]["arguments"], self.calls[-1]["function"]["arguments"]
            if not arguments.startswith(streamed):  # never, as written_pairs reads: the pieces out stay
                self.broken = True
                break
            more_arguments(self.calls, deltas, arguments[len(streamed):])
            self._at, self._block, self._pairs, self._pair_at = end, None, 0, None
        return deltas

    def _stream_pairs(self, deltas: list[dict]) -> None:
        """The open block's arguments whose values have ended, not streamed yet, as ``glm_calls``
        will read them once it closes (if it reads it at all): none before the blank run after
        the name has ended, which decides where the pairs begin. A pair can only be read once a
        new ``</arg_value>`` came, so each is looked for once (a long value stays linear)."""
        text = self.text
        if self._pair_at is None:
            head = GLM_HEAD.match(text, self._block)
            if head is None or not text[head.end():].strip():  # more blank lines may come
                return
            self._pair_at = self._value_from = head.end()
        while (close := text.find(VALUE_CLOSE, self._value_from)) >= 0:
            self._value_from = close + len(VALUE_CLOSE)
            # after a pair, the whitespace glm_calls skips may have grown; the first starts at the head's end
            at = SPACE.match(text, self._pair_at).end() if self._pairs else self._pair_at
            pair = GLM_ARGUMENT.match(text, at)
            if pair is not None:
                more_arguments(self.calls, deltas, ("{" if not self._pairs else ", ") + _pair(pair))
                self._pairs += 1
                self._pair_at = pair.end()
                self._value_from = max(self._value_from, pair.end(2) + len(VALUE_CLOSE))
        self._value_from = max(self._value_from, len(text) - len(VALUE_CLOSE) + 1)  # a tag begun is read again


    def _named(self, deltas: list[dict]) -> bool:
        """Read the gap to the next block and its name's line (its delta added); False when there
        is none to read now (not written yet, or not a block: then broken)."""
        text, at = self.text, self._at
        while at < len(text) and text[at] in GAP:
            at += 1
        rest = text[at:]
        if not rest.startswith(TAG):
            self.broken = not TAG.startswith(rest)  # a tag still coming is waited for
            return False
        line_end = text.find("\n", at + len(TAG))
        name = text[at + len(TAG): line_end if line_end >= 0 else len(text)]
        if "<" in name or (line_end >= 0 and not name.strip()):
            self.broken = True
            return False
        if line_end < 0:
            return False
        self.calls.append(new_call(name.strip(), ""))
        deltas.append(call_delta(len(self.calls) - 1, self.calls[-1], ""))
        self._block = at
        return True
