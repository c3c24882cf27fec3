"""Tool calling as vLLM serves it with its Hermes parser (``--tool-call-parser hermes``, the
format of the Qwen2.5 chat templates): the request's tools go to the model's own chat
template, and the target's text is read back for ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`` blocks, which become the message's ``tool_calls`` (finish_reason
"tool_calls"). Decoding is untouched — the calls are the target's own tokens, parsed. A text
whose blocks do not parse stays content, as vLLM leaves it. The reading back, whole or
streamed call by call, is gateway.tool_calls; this module checks what a request asks.

Forcing a call is structured output (spec.structured), as vLLM forces one: a named function
constrains the output to its parameters' JSON schema, which becomes the call's arguments
(finish_reason stays "stop", as OpenAI's for a named call); "required" constrains it to a JSON
list of {"name", "parameters"} of the given tools, one call or more (finish_reason "tool_calls")."""

from __future__ import annotations

import json
from typing import Any

from specctl.gateway.api import ApiError

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
        specs.append({"type": "function", "function": function})
    if "tools" not in (chat_template or ""):
        raise ApiError(400, "this model's chat template does not render tools, so it cannot be told of them: send "
                            "the request without tools", param="tools")
    return specs


def forced_call(tools: list[dict] | None, tool_choice: Any,
                parallel: bool = True) -> tuple[str | None, tuple[str, str]] | None:
    """(the named function, or None for "required"; the JSON schema the output is held to) when
    ``tool_choice`` forces a call, else None. Not ``parallel`` (parallel_tool_calls false):
    "required"'s list holds one call."""
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
    if named is not None:
        if named not in parameters:
            raise ApiError(400, f"tool_choice names {named!r}, which is not among the tools", param="tool_choice")
        return named, ("json", json.dumps(parameters[named]))
    one_of = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
               "required": ["name", "parameters"], "additionalProperties": False}
              for name, schema in parameters.items()]
    return None, ("json", json.dumps({"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}),
                                      "items": {"anyOf": one_of}}))
