"""Pythonic tool calls (vLLM's ``pythonic``: Llama 3.2, Llama 4) streamed call by call: an
output that opens with ``[`` (or Llama 4's ``<|python_start|>``) is a Python list of calls with
keyword arguments, ``[get_weather(city="Oslo"), ...]``. Each call's id and name go out as soon
as ``name(`` is read, its arguments (Python literals turned into JSON, read with
ast.literal_eval, never evaluated) argument by argument — ``{"city": "Oslo"`` once the comma
after it is read outside brackets and strings, ``, "days": 3`` for the next, ``}`` once its ``)``
closes the call: JSON cannot be streamed from a Python literal half written, and each piece is
the call's first arguments read as a whole call (``f(city="Oslo")``), which the whole call's
JSON begins with (Python refuses a keyword given twice). An output that turns out not to be calls before any call went out
is content, all of it; a call already streamed stays streamed when a later one turns out
malformed or cut short, with the target's finish_reason, as vLLM leaves it (and as
gateway.json_calls does)."""

from __future__ import annotations

import ast
import json
import re

from specctl.gateway.tool_calls import call_delta, more_arguments, new_call, opens_calls

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"  # Llama 4's, around pythonic calls
OPENS = ("[", PYTHON_START)
NAME = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*\(")
CALL_GAP = " \t\r\n"


def pythonic_calls(text: str) -> list[dict] | None:
    """The calls a whole pythonic output holds — a list of ``name(key=literal, ...)`` — or None."""
    body = text.strip().removeprefix(PYTHON_START).removesuffix(PYTHON_END).strip()
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, RecursionError, MemoryError):  # MemoryError: CPython's parser on some deep nesting
        return None
    if not (isinstance(tree, ast.List) and tree.elts):
        return None
    calls = [_call(call) for call in tree.elts]
    return None if None in calls else calls


def _call(node: ast.expr) -> dict | None:
    """One element of the list as a call by name with literal keyword arguments, or None
    (positional arguments, ``**kw``, a dotted name, a value that is no literal or no JSON)."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
            and all(keyword.arg is not None for keyword in node.keywords)):
        return None
    try:
        arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
        return new_call(node.func.id, json.dumps(arguments, ensure_ascii=False))
    except (ValueError, TypeError, SyntaxError, RecursionError):  # not a literal, not JSON (a set, bytes)
        return None


def one_call(text: str) -> dict | None:
    """``name(key=literal, ...)`` alone as a call, or None."""
    try:
        return _call(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, RecursionError, MemoryError):
        return None


class CallEnd:
    """Where the call whose ``(`` is at ``start`` of a growing text closes: brackets counted
    outside Python strings (either quote, tripled or not, backslash escapes); each character
    is read once however often it is asked."""

    def __init__(self, start: int) -> None:
        self._at, self._depth = start, 0
        self._quote = ""  # the open string's quote ('"', "'", '\"\"\"' or "'''"), "" outside one
        self._escaped = False
        self.end: int | None = None  # the index after the closing ``)``, once read
        self.commas: list[int] = []  # the commas between its arguments (inside its brackets only)

    def find(self, text: str) -> int | None:
        at = self._at
        while self.end is None and at < len(text):
            char = text[at]
            if self._quote:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif text.startswith(self._quote, at):
                    at += len(self._quote) - 1
                    self._quote = ""
                elif len(self._quote) == 3 and char == self._quote[0] and len(text) - at < 3:
                    break  # perhaps a closing triple quote cut in two: wait for the rest
            elif char in "\"'":
                if len(text) - at < 3 and text[at:] == char * (len(text) - at):
                    break  # one quote, or the start of three: wait for the next character
                self._quote = char * 3 if text.startswith(char * 3, at) else char
                at += len(self._quote) - 1
            elif char in "([{":
                self._depth += 1
            elif char in ")]}":
                self._depth -= 1
                if self._depth == 0:
                    self.end = at + 1
            elif char == "," and self._depth == 1:
                self.commas.append(at)
            at += 1
        self._at = at
        return self.end


class StreamedPythonicCalls:
    """A choice's text with tools, pushed as it comes (as tool_calls.StreamedCalls): an output
    that opens with ``[`` or ``<|python_start|>`` is calls, any other is content."""

    finish_reason = "tool_calls"

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self.text = ""
        self.opened: bool | None = None  # calls (True), content (False), not known yet (None)
        self.calls: list[dict] = []  # the calls begun, as OpenAI's
        self._at = 0  # where the next thing to read starts: the list, a call, a gap, the closer
        self._listed = False  # the list's ``[`` was read
        self._start = 0  # where the call being read starts
        self._end: CallEnd | None = None  # the call being read, while its ``)`` is not
        self._after_call = False  # a call closed last: a comma or the closer comes next
        self._commas_read = 0  # of the call being read: the commas its streamed arguments were read up to
        self.broken = self.closed = False

    def push(self, delta: str) -> tuple[str, list[dict]]:
        """(content to hand out, tool-call deltas to hand out)."""
        self.text += delta
        if self.opened is None:
            self.opened = opens_calls(self.text, OPENS)
            if not self.opened:
                return ("", []) if self.opened is None else (self.text, [])
        return ("", self._read()) if self.opened else (delta, [])

    def finish(self) -> tuple[str, list[dict], list[dict] | None]:
        """(content not yet handed out, the last deltas, every call — None when the text is not
        calls after all)."""
        if not self.opened:
            return ("" if self.opened is False else self.text), [], None
        deltas = self._read()
        if not self.calls:
            return self.text, [], None
        return "", deltas, self.calls if self._complete() else None

    def _full(self) -> bool:
        """max_calls read (parallel_tool_calls false): the calls after them are not read."""
        return self.max_calls is not None and len(self.calls) >= self.max_calls and self._end is None

    def _complete(self) -> bool:
        """The calls read are all the list holds, the last closed, nothing after the list."""
        if self.broken or self._end is not None:
            return False
        if self._full() and not self.closed:
            return True
        return self.closed and self.text[self._at:].strip().removeprefix(PYTHON_END).strip() == ""

    def _read(self) -> list[dict]:
        """The deltas the text read since the last call adds."""
        deltas: list[dict] = []
        while not (self.broken or self.closed or self._full()):
            if not self._listed:
                if not self._list_opened():
                    break
                continue
            if self._end is None and not self._call_begun(deltas):
                break
            end = self._end.find(self.text)
            self._stream_arguments(deltas)
            if end is None:
                break
            call = one_call(self.text[self._start:end])
            if call is None or call["function"]["name"] != self.calls[-1]["function"]["name"]:
                self.broken = True
                break
            arguments, streamed = call["function"]["arguments"], self.calls[-1]["function"]["arguments"]
            if not arguments.startswith(streamed):  # never (see the module's docstring): the pieces out stay
                self.broken = True
                break
            more_arguments(self.calls, deltas, arguments[len(streamed):])
            self._at, self._end, self._after_call, self._commas_read = end, None, True, 0
        return deltas

    def _stream_arguments(self, deltas: list[dict]) -> None:
        """The call's arguments up to its last comma read, not streamed yet: its JSON as the call
        cut there reads, less the closing brace (nothing while that cut is not a call: a positional
        argument, a value that is no literal — the whole call then decides)."""
        commas = self._end.commas
        if len(commas) <= self._commas_read:
            return
        self._commas_read = len(commas)
        cut = one_call(self.text[self._start:commas[-1]] + ")")
        streamed = self.calls[-1]["function"]["arguments"]
        if cut is not None and cut["function"]["arguments"].startswith(streamed):
            more_arguments(self.calls, deltas, cut["function"]["arguments"][len(streamed):-1])


    def _list_opened(self) -> bool:
        """Read past ``[`` (after Llama 4's tag, if it is there); False while it is not written."""
        body = self.text[self._at:].lstrip()
        if len(body) < len(PYTHON_START) and PYTHON_START.startswith(body):
            return False  # the tag (or nothing yet) so far
        body = body.removeprefix(PYTHON_START).lstrip()
        if body:
            self._listed, self._at, self.broken = True, len(self.text) - len(body) + 1, body[0] != "["
        return bool(body)

    def _call_begun(self, deltas: list[dict]) -> bool:
        """Read the gap to the next call and its ``name(`` (its delta added), or the list's end;
        False when there is no call to read now (not written yet, the list closed, broken)."""
        text = self.text
        while self._at < len(text):
            char = text[self._at]
            if char in CALL_GAP:
                self._at += 1
            elif char == "," and self._after_call:
                self._at, self._after_call = self._at + 1, False
            elif char == "]":
                self.closed, self._at = True, self._at + 1
                return False
            else:
                break
        if self._at >= len(text):
            return False
        name = NAME.match(text, self._at)
        if self._after_call or name is None:
            # a name still coming is waited for; anything else is not a list of calls
            self.broken = self._after_call or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*\s*", text[self._at:])
            return False
        self.calls.append(new_call(name.group(1), ""))
        deltas.append(call_delta(len(self.calls) - 1, self.calls[-1], ""))
        self._start, self._end = self._at, CallEnd(name.end() - 1)
        return True
