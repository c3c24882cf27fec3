"""A request's structured output, from the fields OpenAI and vLLM clients send it in:
OpenAI's ``response_format`` (``json_object``, ``json_schema``) and vLLM's ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar`` and ``structured_outputs`` ({json,
regex, choice, grammar, json_object}). One constraint a request; the grammar is checked
here, so a bad one is a 400 naming its field before any instance is asked. JSON's whitespace
is spec.json_schema's JSON_WHITESPACE unless the request asks for other (vLLM's
``structured_outputs.whitespace_pattern`` / ``disable_any_whitespace``, ``guided_whitespace_pattern``),
written into the schema as llguidance's ``x-guidance``."""

from __future__ import annotations

import json
from typing import Any

from specctl.errors import InvalidSamplingParams
from specctl.gateway.api import ApiError
from specctl.gateway.reasoning import HARMONY
from specctl.spec.json_schema import WHITESPACE_OPTIONS
from specctl.spec.structured import GRAMMARS, JSON_OBJECT, grammar_text

WHITESPACE_KEYS = ("whitespace_pattern", "disable_any_whitespace")  # structured_outputs' keys for JSON's whitespace


def _spec(kind: str, value: Any, field: str) -> tuple[str, str]:
    """(kind, text) for spec.structured; a JSON schema or choice list may come as an object."""
    if kind == "json" and isinstance(value, dict):
        return kind, json.dumps(value)
    if kind == "choice":
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            return kind, json.dumps(value)
    elif isinstance(value, str):
        return kind, value
    shape = {"json": "a JSON schema", "choice": "a non-empty list of strings"}.get(kind, "a string")
    raise ApiError(400, f"{field} must be {shape}", param=field.split(".")[0])


def _asked(req: Any) -> list[tuple[str, tuple[str, str]]]:
    """Every constraint the request sets, with the field it came in."""
    asked = []
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            asked.append(("response_format", ("json", JSON_OBJECT)))
        elif fmt.type == "json_schema":
            schema = (fmt.json_schema or {}).get("schema")
            if not isinstance(schema, dict):
                raise ApiError(400, "response_format json_schema needs json_schema.schema, a JSON schema object",
                               param="response_format")
            asked.append(("response_format", ("json", json.dumps(schema))))
        else:
            raise ApiError(400, f"response_format type must be 'text', 'json_object' or 'json_schema', got "
                                f"{fmt.type!r}", param="response_format")
    for kind in GRAMMARS:  # vLLM's guided_* and structured_outputs keys are spec.structured's grammars
        value = getattr(req, f"guided_{kind}")
        if value is not None:
            asked.append((f"guided_{kind}", _spec(kind, value, f"guided_{kind}")))
    for key, value in (req.structured_outputs or {}).items():
        if value is None or value is False or key in WHITESPACE_KEYS or key == "disable_fallback":
            continue  # disable_fallback: there is one backend, no other to fall back to
        if key == "json_object":
            asked.append(("structured_outputs", ("json", JSON_OBJECT)))
        elif key in GRAMMARS:
            asked.append(("structured_outputs", _spec(key, value, f"structured_outputs.{key}")))
        else:
            raise ApiError(400, f"structured_outputs.{key} is not supported: give one of json, regex, choice, "
                                "grammar, json_object (and whitespace_pattern or disable_any_whitespace for "
                                "JSON)", param="structured_outputs")
    return asked


def _whitespace(req: Any, structured: tuple[str, str] | None) -> tuple[str, str] | None:
    """A JSON constraint with the whitespace the request asks for (llguidance's x-guidance in its
    schema; none asked: the constraint as it is, spec.json_schema bounds JSON's)."""
    options = req.structured_outputs or {}
    asked = {key: options[key] for key in WHITESPACE_KEYS if options.get(key) not in (None, False)}
    if req.guided_whitespace_pattern is not None:
        asked["guided_whitespace_pattern"] = req.guided_whitespace_pattern
    if not asked:
        return structured
    field = next(iter(asked))
    if len(asked) > 1:
        raise ApiError(400, f"give one of {', '.join(asked)}, not both", param=field)
    schema = json.loads(structured[1]) if structured is not None and structured[0] == "json" else None
    if not isinstance(schema, dict):
        raise ApiError(400, f"{field} applies to a JSON schema object only", param=field)
    if field == "disable_any_whitespace":
        guidance = {"whitespace_flexible": False}  # llguidance's compact separators, vLLM's meaning
    elif isinstance(asked[field], str):
        guidance = {"whitespace_pattern": asked[field]}
    else:
        raise ApiError(400, f"{field} must be a regular expression (a string)", param=field)
    own = schema.get("x-guidance")
    held = {key: own[key] for key in own if key not in WHITESPACE_OPTIONS} if isinstance(own, dict) else {}
    return "json", json.dumps({**schema, "x-guidance": {**held, **guidance}})


def after_thinking(structured: tuple[str, str] | None, thinking: bool | str | None) -> tuple[str, str] | None:
    """A constraint that starts after the thinking when the output starts in thought (a reasoning
    parser's chat request): the thinking is free, the answer holds to the grammar, as vLLM does;
    gpt-oss's (HARMONY): its analysis messages free, its final message held to the grammar."""
    if structured is None or not thinking:
        return structured
    kind, spec = structured
    return "harmony" if thinking == HARMONY else "thinking", json.dumps({"kind": kind, "spec": spec})


def structured_output(req: Any, forced_call: tuple[str, str] | None = None) -> tuple[str, str] | None:
    """The request's constraint as spec.structured takes it (None: the output is free), checked;
    ``forced_call``: the schema a forced tool call holds the output to (gateway.tools)."""
    asked = _asked(req) + ([("tool_choice", forced_call)] if forced_call else [])
    if not asked:
        return _whitespace(req, None)  # None, or a 400 for whitespace asked of no JSON
    if len(asked) > 1:
        raise ApiError(400, f"one structured output a request, got {len(asked)} ({', '.join(f for f, _ in asked)})",
                       param=asked[1][0])
    field, structured = asked[0][0], _whitespace(req, asked[0][1])
    if req.ignore_eos and not req.stop_token_ids:
        raise ApiError(400, f"{field} cannot be combined with ignore_eos: the output ends where the grammar does, "
                            "with EOS", param="ignore_eos")
    try:
        grammar_text(*structured)
    except InvalidSamplingParams as exc:
        raise ApiError(400, str(exc), param=field) from None
    return structured
