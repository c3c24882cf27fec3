"""Tool calling as vLLM serves it with its Hermes parser (``--tool-call-parser hermes``, the
format of the Qwen2.5 chat templates): the request's tools go to the model's own chat
template, and the target's text is read back for ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`` blocks, which become the message's ``tool_calls`` (finish_reason
"tool_calls"). Decoding is untouched — the calls are the target's own tokens, parsed. A text
whose blocks do not parse stays content, as vLLM leaves it. The reading back, whole or
streamed call by call, is gateway.tool_calls; this module checks what a request asks.

Forcing a call is structured output (spec.structured). A named function, with the hermes
parser, holds the output to the model's own call format, as SGLang holds it (its "structural
tags"): ``<tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call>``, ARGS to the function's
parameters' JSON schema, read back by the hermes reader; with the other parsers, as vLLM forces
it, to the parameters' JSON schema alone, which becomes the call's arguments. A model held to the
bare arguments, though its template primes it to write a call's name first, fills a parameter
called "name" with the function's (Qwen2.5-Coder-1.5B: ``{"name": "add_contact", ..., "name1":
"Alice Smith"}``); in its own format it writes ``{"name": "Alice Smith", ...}``. "required" holds
the output to vLLM's JSON list of {"name", "parameters"} of the given tools (one call or more):
held to its own format instead, the same model wrote call after call till max_tokens, where the
list ends after one. finish_reason: "stop" for a named call (OpenAI's), "tool_calls" for "required"."""

from __future__ import annotations

import json
from functools import partial
from typing import Any, NamedTuple

from specctl.gateway.api import ApiError
from specctl.gateway.tool_calls import CLOSE, OPEN
from specctl.spec.json_schema import served_schema

FUNCTION_FIELDS = ("name", "description", "parameters")  # vLLM's FunctionDefinition, in its order


class Forced(NamedTuple):
    """A forced call: the function named (None: "required"), the constraint on the output, and
    whether that output is the model's own call format (read by the parser's reader)."""
    named: str | None
    structured: tuple[str, str]
    native: bool = False

def request_tools(tools: list[Any] | None, tool_choice: Any, chat_template: str | None) -> list[dict] | None:
    """The tools to render and parse for, or None (no tools, or ``tool_choice`` "none": the
    model is not told of them). A template that does not render tools is a 400."""
    if not tools or tool_choice == "none":
        return None
    specs = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(function, dict)
                and isinstance(function.get("name"), str) and function["name"]):
            raise ApiError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                                "\"parameters\": {...}}}}", param="tools")
        specs.append({"type": "function", "function": _as_vllm_renders(function)})
    if "tools" not in (chat_template or ""):
        raise ApiError(400, "this model's chat template does not render tools, so it cannot be told of them: send "
                            "the request without tools", param="tools")
    return specs


def _as_vllm_renders(function: dict) -> dict:
    """A function as vLLM hands it to the template (its model's fields name, description and
    parameters first, then any other, such as strict, as sent), without null values: one tool is
    one prompt whichever API carried it (chat, Responses, Anthropic) in whichever key order."""
    first = {key: function[key] for key in FUNCTION_FIELDS if function.get(key) is not None}
    return first | {key: value for key, value in function.items() if key not in first and value is not None}


def forced_call(tools: list[dict] | None, tool_choice: Any, parallel: bool = True, parser: str = "",
                tokenizer: Any = None) -> Forced | None:
    """The forced call when ``tool_choice`` forces one, else None: in the hermes format for the
    hermes ``parser`` (given the ``tokenizer``), else vLLM's JSON. Not ``parallel``
    (parallel_tool_calls false): "required" holds one call."""
    if tool_choice in (None, "none", "auto"):
        return None
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    named = function.get("name") if isinstance(function, dict) else None
    if tool_choice != "required" and not (isinstance(named, str) and tool_choice.get("type", "function") == "function"):
        raise ApiError(400, "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": "
                            "{\"name\": ...}}", param="tool_choice")
    if not tools:
        raise ApiError(400, "tool_choice forces a call, but the request gives no tools", param="tool_choice")
    parameters = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    if named is not None and named not in parameters:
        raise ApiError(400, f"tool_choice names {named!r}, which is not among the tools", param="tool_choice")
    if named is not None and parser == "hermes" and tokenizer is not None:
        return Forced(named, ("grammar", hermes_call(named, parameters[named], tokenizer)), True)
    if named is not None:
        return Forced(named, ("json", json.dumps(parameters[named])))
    one_of = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
               "required": ["name", "parameters"], "additionalProperties": False}
              for name, schema in parameters.items()]
    return Forced(None, ("json", json.dumps({"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}),
                                             "items": {"anyOf": one_of}})))


def hermes_call(name: str, schema: dict, tokenizer: Any) -> str:
    """A Lark grammar (llguidance's) of one call as the Hermes/Qwen templates write it:
    ``<tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call>``, ARGS held to ``schema``. A tag
    that is an added token is that token (``<[id]>``: as text a grammar could not take it), else
    its text."""
    added = tokenizer.get_added_vocab()
    open_tag, close_tag = (f"<[{added[tag]}]>" if tag in added else json.dumps(tag) for tag in (OPEN, CLOSE))
    head, tail = '\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": ', "}\n"
    literal = partial(json.dumps, ensure_ascii=False)  # a Lark string is written as a JSON string
    return (f"start: {open_tag} {literal(head)} arguments {literal(tail)} {close_tag}\n"
            f"arguments: %json {literal(served_schema(schema))}\n")
