"""Llama 3.1-3.3's tool calls (vLLM's ``llama3_json``; Phi-4-mini's ``phi4_mini_json`` the same
way) streamed as vLLM streams them: an
output that opens with ``{`` (or ``<|python_tag|>``) is ``{"name": ..., "parameters": {...}}``
objects separated by ``;``; each call's id and name go out as soon as its name is read, then
its arguments as the model writes them — the model's own text, so the pieces join into the
arguments a whole answer carries. An object in another shape (arguments before the name) is
read whole when it closes. An output that turns out not to be calls before any call went out
is content, all of it; a call already streamed when a later object turns out malformed or cut
short stays streamed, with the target's finish_reason, as vLLM leaves it. Any other output is
content as it comes."""

from __future__ import annotations

import json
import re
from typing import Callable

from specctl.gateway.tool_calls import call_delta, new_call, opens_calls

PYTHON_TAG = "<|python_tag|>"  # Llama 3.1's, before JSON calls (kept with skip_special_tokens false)
OPENS = ("{", PYTHON_TAG)
# An object up to its arguments' first character, the name first as Llama's templates write calls
HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:parameters|arguments)"\s*:\s*(?=\{)')
SEPARATORS = "; \t\r\n"


class JsonEnd:
    """Where the JSON object or list opening at ``start`` of a growing text closes, brackets
    counted outside strings; each character is read once however often it is asked (a long
    argument streamed in small pieces stays linear)."""

    def __init__(self, start: int) -> None:
        self.start = self._at = start
        self._depth, self._in_string, self._escaped = 0, False, False
        self.end: int | None = None  # the index after the closing bracket, once read

    def find(self, text: str) -> int | None:
        if self.end is not None:
            return self.end
        for at in range(self._at, len(text)):
            char = text[at]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.end = at + 1
                    return self.end
        self._at = len(text)
        return None


def json_end(text: str, start: int) -> int | None:
    """Where the JSON object or list opening at ``start`` closes (the index after it), or None
    while it is open."""
    return JsonEnd(start).find(text)


def ends_at(scanner: JsonEnd | None, start: int) -> JsonEnd:
    """``scanner`` if it scans from ``start``, else a new one that does."""
    return scanner if scanner is not None and scanner.start == start else JsonEnd(start)


def grow_arguments(text: str, at: int, scanner: JsonEnd, index: int, function: dict,
                   deltas: list[dict]) -> tuple[str, int | None]:
    """A streamed call's arguments as far as written from ``at`` (trailing whitespace held back
    while they are open), the piece not handed out yet added to ``deltas``; (them, their end)."""
    end = scanner.find(text)
    arguments = text[at:end] if end else text[at:].rstrip()
    if piece := arguments[len(function["arguments"]):]:
        function["arguments"] = arguments
        deltas.append({"index": index, "function": {"arguments": piece}})
    return arguments, end


def whole_call(text: str) -> dict | None:
    """One closed object as a call (``parameters`` or ``arguments``), or None when it is not one."""
    try:
        call = json.loads(text)
    except (json.JSONDecodeError, RecursionError):  # RecursionError: nested past json's depth
        return None
    arguments = call.get("parameters", call.get("arguments")) if isinstance(call, dict) else None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(arguments, dict)):
        return None
    return new_call(call["name"], json.dumps(arguments, ensure_ascii=False))


class ObjectCalls:
    """Name-first JSON call objects read as they come from ``start`` of a growing text: each
    call's id and name as soon as its name is read, its arguments as written; an object in
    another shape read whole when it closes. ``separators`` may stand between objects; with a
    ``closer`` (a list's ``]``) the objects end there and what follows is not read. ``parse``
    reads one closed object as a call (None: it is none); ``new_id`` names the calls."""

    def __init__(self, start: int, separators: str = SEPARATORS, closer: str | None = None,
                 parse: Callable[[str], dict | None] | None = None, header: re.Pattern = HEADER,
                 new_id: Callable[[], str] | None = None) -> None:
        self.separators, self.closer, self.header, self.new_id = separators, closer, header, new_id
        self.parse = parse or whole_call
        self.calls: list[dict] = []  # the calls begun, as OpenAI's (arguments handed out so far)
        self._start = start  # where the object being read starts in the text
        self._arguments_at = 0  # where its arguments start, once its header is read
        self._object_end: JsonEnd | None = None  # the object's and its arguments' ends, read as they come
        self._arguments_end: JsonEnd | None = None
        self.broken = False
        self.closed = False  # the closer was read

    def complete(self, text: str, max_calls: int | None) -> bool:
        """Whether the calls read are all the text holds, none cut short and nothing else after."""
        if self.broken or self._arguments_at or not self.calls:
            return False
        if self.closer is not None:  # a list: read to its end
            return self.closed or self._full(max_calls)
        return self._full(max_calls) or not text[self._start:].strip(self.separators)

    def after(self, text: str) -> str:
        """The text after the closer ("" while it is not read)."""
        return text[self._start + 1:] if self.closed else ""

    def _full(self, max_calls: int | None) -> bool:
        """max_calls read (parallel_tool_calls false): the objects after them are not read."""
        return max_calls is not None and len(self.calls) >= max_calls

    def _begin(self, call: dict) -> dict:
        if self.new_id is not None:
            call["id"] = self.new_id()
        self.calls.append(call)
        return call

    def read(self, text: str, max_calls: int | None) -> list[dict]:
        """The deltas the text read since the last call adds."""
        deltas: list[dict] = []
        while not (self.broken or self.closed) and (self._arguments_at or not self._full(max_calls)):
            while self._start < len(text) and text[self._start] in self.separators:
                self._start += 1
            if self._start >= len(text):
                break
            if self.closer is not None and text[self._start] == self.closer and not self._arguments_at:
                self.closed = True
                break
            if text[self._start] != "{":
                self.broken = True
                break
            self._object_end = ends_at(self._object_end, self._start)
            end = self._object_end.find(text)
            index = len(self.calls) - (1 if self._arguments_at else 0)
            if not self._arguments_at:  # the object's header: its name
                header = self.header.match(text, self._start)
                if header is None:
                    if end is None:
                        break  # another shape: read whole once it closes
                    call = self.parse(text[self._start:end])
                    if call is None:
                        self.broken = True
                        break
                    self._begin(call)
                    deltas.append(call_delta(index, call, call["function"]["arguments"]))
                    self._start = end
                    continue
                self._begin(new_call(json.loads(header.group(1)), ""))
                self._arguments_at = header.end()
                deltas.append(call_delta(index, self.calls[index], ""))
            function = self.calls[index]["function"]
            self._arguments_end = ends_at(self._arguments_end, self._arguments_at)
            arguments, _ = grow_arguments(text, self._arguments_at, self._arguments_end, index, function, deltas)
            if end is None:
                break
            whole = self.parse(text[self._start:end])
            if (whole is None or whole["function"]["name"] != function["name"]
                    or json.loads(whole["function"]["arguments"]) != json.loads(arguments)):
                self.broken = True
                break
            self._start, self._arguments_at = end, 0
        return deltas


class StreamedJsonCalls:
    """A choice's text with tools, pushed as it comes (as tool_calls.StreamedCalls): an output
    that opens with one of ``opens`` is calls, any other is content."""

    finish_reason = "tool_calls"
    opens: tuple[str, ...] = OPENS

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self.text = ""
        self.opened: bool | None = None  # calls (True), content (False), not known yet (None)
        self.objects: ObjectCalls | None = None

    def push(self, delta: str) -> tuple[str, list[dict]]:
        """(content to hand out, tool-call deltas to hand out)."""
        self.text += delta
        if self.opened is None:
            self.opened = opens_calls(self.text, self.opens)
            if not self.opened:
                return ("", []) if self.opened is None else (self.text, [])
            opening = self.text.lstrip()
            self.objects = self._objects(opening, len(self.text) - len(opening))
        return ("", self.objects.read(self.text, self.max_calls)) if self.opened else (delta, [])

    def finish(self) -> tuple[str, list[dict], list[dict] | None]:
        """(content not yet handed out, the last deltas, every call — None when the text is not
        calls after all)."""
        if self.objects is None:
            return ("" if self.opened is False else self.text), [], None
        deltas = self.objects.read(self.text, self.max_calls)
        if self.objects.calls:
            return "", deltas, self.objects.calls if self._complete() else None
        return self.text, [], None

    def _objects(self, opening: str, at: int) -> ObjectCalls:
        return ObjectCalls(at + (len(PYTHON_TAG) if opening.startswith(PYTHON_TAG) else 0))

    def _complete(self) -> bool:
        return self.objects.complete(self.text, self.max_calls)


FUNCTOOLS = "functools["  # Phi-4-mini's calls: a JSON list after it


def functools_call(text: str) -> dict | None:
    """One object of Phi-4-mini's list as a call (``arguments``, else ``parameters``, else none)."""
    try:
        call = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    arguments = call.get("arguments", call.get("parameters", {})) if isinstance(call, dict) else None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(arguments, dict)):
        return None
    return new_call(call["name"], json.dumps(arguments, ensure_ascii=False))


class StreamedFunctoolsCalls(StreamedJsonCalls):
    """Phi-4-mini's (vLLM's ``phi4_mini_json``): an output that opens with ``functools[`` is its
    calls, streamed as llama3_json's are; the list must end the output (else it is content)."""

    opens = (FUNCTOOLS,)

    def _objects(self, opening: str, at: int) -> ObjectCalls:
        return ObjectCalls(at + len(FUNCTOOLS), ", \t\r\n", "]", functools_call)

    def _complete(self) -> bool:
        return super()._complete() and not self.objects.after(self.text).strip()
