"""Mistral's tool calls (vLLM's ``mistral`` parser), streamed as vLLM streams them: the content
until the first ``[TOOL_CALLS]`` (a special token, kept in the text of a request with tools)
goes out as it comes; then, before v11, one JSON list of ``{"name", "arguments"}`` objects (text
after the list ignored, as vLLM ignores it), from v11 on ``name[ARGS]{...}`` per call, each
after its own tag — each call's id and name as soon as its name is read, then its arguments as
written. Call ids are 9 letters and digits, the only ids Mistral's chat templates take back. A
text that turns out not to be calls before any call went out is content, tag and all; a call
already streamed stays, with the target's finish_reason, as vLLM leaves it."""

from __future__ import annotations

import json
import random
import re
import string

from specctl.gateway.json_calls import JsonEnd, ObjectCalls, ends_at, grow_arguments
from specctl.gateway.tool_calls import CallsAfterTag, call_delta, new_call

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"  # Mistral's control tokens (kept: skip_special_tokens false)
# v11+ tokenizers' (Mistral Small 3.1+, Devstral, Magistral) call: its name, [ARGS] maybe, then a JSON object
NAMED_CALL = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*(?:\[ARGS\])?\s*(?=\{)")
NAME_BEGUN = re.compile(r"\s*[A-Za-z0-9_.\-]*\s*(?:\[(?:A(?:R(?:G(?:S\]?)?)?)?)?)?\s*")  # may still become one
LISTED_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\{)')


def mistral_id() -> str:
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


def listed_call(text: str) -> dict | None:
    """One object of a pre-v11 list as a call (``arguments`` may be left out), or None."""
    try:
        return listed_value(json.loads(text))
    except (json.JSONDecodeError, RecursionError):
        return None


def listed_value(call: object) -> dict | None:
    """A decoded list item as a call, or None when it is not one."""
    if not (isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments", {}),
                                                                                         dict)):
        return None
    return new_call(call["name"], json.dumps(call.get("arguments", {}), ensure_ascii=False))


def mistral_calls(body: str) -> list[dict] | None:
    """The calls after a Mistral output's first ``[TOOL_CALLS]`` read whole, or None when they
    do not parse."""
    decoder = json.JSONDecoder()
    stripped = body.strip()
    if stripped.startswith("["):
        try:
            listed, _ = decoder.raw_decode(stripped)
        except (json.JSONDecodeError, RecursionError):
            return None
        calls = [listed_value(c) for c in listed] if isinstance(listed, list) else [None]
        return calls if calls and None not in calls else None
    calls = []
    for part in body.split(TOOL_CALLS):
        named = NAMED_CALL.match(part)
        if named is None:
            return None
        try:
            arguments, end = decoder.raw_decode(part, named.end())
        except (json.JSONDecodeError, RecursionError):
            return None
        if not isinstance(arguments, dict) or part[end:].strip():
            return None
        calls.append(new_call(named.group(1), json.dumps(arguments, ensure_ascii=False)))
    return calls


class NamedCalls:
    """v11+'s ``name[ARGS]{...}`` calls read as they come, from ``start`` (after a tag)."""

    def __init__(self, start: int) -> None:
        self.calls: list[dict] = []
        self._at = start  # where the next name, or what follows the last call, starts
        self._arguments_at = 0  # where the call being read has its arguments
        self._after = False  # the last call's arguments closed: a tag (or the end) follows
        self._arguments_end: JsonEnd | None = None  # their end, read as they come
        self.broken = False

    def complete(self, text: str, max_calls: int | None) -> bool:
        if self.broken or self._arguments_at or not self._after:
            return False
        return (max_calls is not None and len(self.calls) >= max_calls) or not text[self._at:].strip()

    def read(self, text: str, max_calls: int | None) -> list[dict]:
        deltas: list[dict] = []
        full = max_calls is not None and len(self.calls) >= max_calls
        while not self.broken:
            if self._after:  # whitespace, then the next call's tag
                rest = text[self._at:].lstrip()
                if full or (TOOL_CALLS.startswith(rest) and rest != TOOL_CALLS):  # the end so far, or a tag begun
                    break
                if not rest.startswith(TOOL_CALLS):
                    self.broken = True
                    break
                self._at, self._after = len(text) - len(rest) + len(TOOL_CALLS), False
            index = len(self.calls) - (1 if self._arguments_at else 0)
            if not self._arguments_at:
                named = NAMED_CALL.match(text, self._at)
                if named is None:
                    self.broken = NAME_BEGUN.fullmatch(text, self._at) is None
                    break
                call = new_call(named.group(1), "")
                call["id"] = mistral_id()
                self.calls.append(call)
                self._arguments_at = named.end()
                deltas.append(call_delta(index, call, ""))
            self._arguments_end = ends_at(self._arguments_end, self._arguments_at)
            arguments, end = grow_arguments(text, self._arguments_at, self._arguments_end, index,
                                            self.calls[index]["function"], deltas)
            if end is None:
                break
            try:
                self.broken = not isinstance(json.loads(arguments), dict)
            except (json.JSONDecodeError, RecursionError):
                self.broken = True
            self._at, self._arguments_at, self._after = end, 0, True
            full = max_calls is not None and len(self.calls) >= max_calls
        return deltas


class MistralCalls(CallsAfterTag):
    """A Mistral choice's text with tools, pushed as it comes (as tool_calls.StreamedCalls)."""

    tag = TOOL_CALLS

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self.reader: ObjectCalls | NamedCalls | None = None

    def finish(self) -> tuple[str, list[dict], list[dict] | None]:
        deltas = self._read() if self.start >= 0 else []
        if self.reader is not None and self.reader.calls:
            return "", deltas, self.reader.calls if self.reader.complete(self.text, self.max_calls) else None
        return self._all_content()

    def _read(self) -> list[dict]:
        if self.reader is None:
            body_at = self.start + len(TOOL_CALLS)
            body = self.text[body_at:].lstrip()
            if not body:
                return []
            if body.startswith("["):
                self.reader = ObjectCalls(len(self.text) - len(body) + 1, ", \t\r\n", "]", listed_call,
                                          LISTED_HEADER, mistral_id)
            else:
                self.reader = NamedCalls(body_at)
        return self.reader.read(self.text, self.max_calls)
