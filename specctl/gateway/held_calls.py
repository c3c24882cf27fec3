"""The ``--tool-call-parser`` names (``TOOL_PARSERS``) and their readers, with the formats read
whole: ``glm45`` (GLM-4.5/4.6: ``<tool_call>`` blocks of ``<arg_key>`` / ``<arg_value>`` pairs
after content; the content streams, the blocks are held and read when the choice ends), and
the whole-output readers of llama3_json (``json_calls``) and phi4_mini_json
(``functools_calls``), which stream (gateway.json_calls) and are read whole here to check
them. ``pythonic`` (Llama 3.2, Llama 4) streams call by call (gateway.pythonic_calls),
``mistral`` too (gateway.mistral_calls), ``hermes`` (gateway.tool_calls) and ``openai``
(gpt-oss's, gateway.harmony) as they come."""

from __future__ import annotations

import json
import re
from typing import Callable

from specctl.gateway.harmony import HarmonyCalls
from specctl.gateway.json_calls import PYTHON_TAG, StreamedFunctoolsCalls, StreamedJsonCalls
from specctl.gateway.mistral_calls import MistralCalls
from specctl.gateway.pythonic_calls import StreamedPythonicCalls
from specctl.gateway.tool_calls import StreamedCalls, TaggedCalls, new_call


def json_calls(text: str) -> list[dict] | None:
    """The calls a llama3_json output holds, or None when it is not one or more calls."""
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            call, end = decoder.raw_decode(body, at)
        except (json.JSONDecodeError, RecursionError):  # RecursionError: nested past json's depth
            return None
        arguments = call.get("parameters", call.get("arguments")) if isinstance(call, dict) else None
        if not (isinstance(call.get("name") if isinstance(call, dict) else None, str) and isinstance(arguments, dict)):
            return None
        calls.append(new_call(call["name"], json.dumps(arguments, ensure_ascii=False)))
        at = end
        while at < len(body) and body[at] in "; \t\r\n":
            at += 1
    return calls or None


def functools_calls(text: str) -> list[dict] | None:
    """Phi-4-mini's calls, ``functools[{"name": ..., "arguments": {...}}, ...]`` (``parameters``
    taken too, as vLLM's phi4_mini_json takes it), or None when the output is not that alone."""
    body = text.strip()
    if not body.startswith("functools["):
        return None
    try:
        listed = json.loads(body.removeprefix("functools"))
    except (json.JSONDecodeError, RecursionError):
        return None
    if not (isinstance(listed, list) and listed and all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                                        for c in listed)):
        return None
    arguments = [c.get("arguments", c.get("parameters", {})) for c in listed]
    if not all(isinstance(a, dict) for a in arguments):
        return None
    return [new_call(c["name"], json.dumps(a, ensure_ascii=False)) for c, a in zip(listed, arguments)]


GLM_CALL = re.compile(r"<tool_call>([^\n<]*?)\s*\n(.*?)</tool_call>\s*", re.DOTALL)
GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.DOTALL)


def GlmCalls(max_calls: int | None = None) -> TaggedCalls:  # noqa: N802
    """GLM-4.5's (and 4.6's) calls: content until its first ``<tool_call>``, then its blocks (glm_calls)."""
    return TaggedCalls("<tool_call>", glm_calls, max_calls)


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
        body, arguments, where = block.group(2), {}, 0
        while where < len(body.strip()):
            pair = GLM_ARGUMENT.match(body, where)
            if pair is None:
                return None
            arguments[pair.group(1).strip()] = _json_or_text(pair.group(2))
            where = pair.end()
        calls.append(new_call(block.group(1).strip(), json.dumps(arguments, ensure_ascii=False)))
        at = block.end()
    return calls or None


def _json_or_text(value: str):
    try:
        return json.loads(value)
    except (json.JSONDecodeError, RecursionError):
        return value


def JsonCalls(max_calls: int | None = None) -> StreamedJsonCalls:  # noqa: N802 - a reader class, as StreamedCalls
    """llama3_json: streamed, each call's name then its arguments (gateway.json_calls)."""
    return StreamedJsonCalls(max_calls)


def FunctoolsCalls(max_calls: int | None = None) -> StreamedFunctoolsCalls:  # noqa: N802
    """phi4_mini_json: streamed as llama3_json (gateway.json_calls)."""
    return StreamedFunctoolsCalls(max_calls)


# vLLM's --tool-call-parser names and their readers (each called with max_calls)
TOOL_PARSERS: dict[str, Callable[..., object]] = {"hermes": StreamedCalls, "llama3_json": JsonCalls,
                                                   "pythonic": StreamedPythonicCalls, "mistral": MistralCalls,
                                                   "phi4_mini_json": FunctoolsCalls, "openai": HarmonyCalls,
                                                   "glm45": GlmCalls}
# parsers whose tags are special tokens: a request with tools keeps them in the text (as vLLM's mistral)
KEEPS_SPECIAL_TOKENS = frozenset({"mistral", "openai", "glm45"})
