"""The ``--tool-call-parser`` names (``TOOL_PARSERS``) and their readers, every one streamed:
``hermes`` (gateway.fenced_calls: gateway.tool_calls' blocks, or a markdown JSON block),
``llama3_json`` and ``phi4_mini_json`` (gateway.json_calls), ``pythonic``
(gateway.pythonic_calls), ``mistral`` (gateway.mistral_calls), ``glm45`` (gateway.glm_calls) and
``openai`` (gpt-oss's, gateway.harmony); and the whole-output readers of llama3_json
(``json_calls``) and phi4_mini_json (``functools_calls``), which property tests hold the
streamed ones to."""

from __future__ import annotations

import json
from typing import Callable

from specctl.gateway.fenced_calls import HermesCalls
from specctl.gateway.glm_calls import StreamedGlmCalls
from specctl.gateway.harmony import HarmonyCalls
from specctl.gateway.json_calls import PYTHON_TAG, StreamedFunctoolsCalls, StreamedJsonCalls
from specctl.gateway.mistral_calls import MistralCalls
from specctl.gateway.pythonic_calls import StreamedPythonicCalls
from specctl.gateway.tool_calls import new_call


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


def JsonCalls(max_calls: int | None = None) -> StreamedJsonCalls:  # noqa: N802 - a reader class, as StreamedCalls
    """llama3_json: streamed, each call's name then its arguments (gateway.json_calls)."""
    return StreamedJsonCalls(max_calls)


def FunctoolsCalls(max_calls: int | None = None) -> StreamedFunctoolsCalls:  # noqa: N802
    """phi4_mini_json: streamed as llama3_json (gateway.json_calls)."""
    return StreamedFunctoolsCalls(max_calls)


# vLLM's --tool-call-parser names and their readers (each called with max_calls)
TOOL_PARSERS: dict[str, Callable[..., object]] = {"hermes": HermesCalls, "llama3_json": JsonCalls,
                                                   "pythonic": StreamedPythonicCalls, "mistral": MistralCalls,
                                                   "phi4_mini_json": FunctoolsCalls, "openai": HarmonyCalls,
                                                   "glm45": StreamedGlmCalls}
# parsers whose tags are special tokens: a request with tools keeps them in the text (as vLLM's mistral)
KEEPS_SPECIAL_TOKENS = frozenset({"mistral", "openai", "glm45"})
# parsers whose readers are told the request's tool names (``tool_names``)
READS_TOOL_NAMES = frozenset({"hermes"})
