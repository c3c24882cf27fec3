"""A request's JSON schema as the grammar serves it (spec.structured): its whitespace bounded
and its objects closed to the properties they name, as the servers users come from hold JSON.

- Whitespace: between two JSON tokens up to two blanks, or one or two line breaks and an indent
  of up to 40 (llama.cpp's json-schema grammars allow a blank, or line breaks and an indent of
  20). With any whitespace allowed (llguidance's whitespace_flexible, vLLM's default) a model
  that wants what the grammar refuses writes blanks till max_tokens: Qwen2.5-Coder-1.5B, asked
  for a json_object about Paris, wrote `"population": 2,` and 256 tokens of spaces.
- Closed objects: an object schema that names its properties and says nothing of others takes
  no others, as vLLM's default backend (xgrammar's strict mode), SGLang's and llama.cpp's
  grammars hold it, and OpenAI's strict schemas require; llguidance, like JSON Schema itself,
  takes any. Qwen2.5-Coder-1.5B, asked by `llm --schema 'name, country'` about Paris, wrote
  name and country, then "capital", "population", "currency", "language", "climate" and a
  "history" that ran to max_tokens. A schema that wants others says so (``additionalProperties``
  true or a schema, or ``unevaluatedProperties``)."""

from __future__ import annotations

from typing import Any

JSON_WHITESPACE = r"[ \t]{0,2}((\r?\n){1,2}[ \t]{0,40})?"
WHITESPACE_OPTIONS = ("whitespace_flexible", "whitespace_pattern", "item_separator", "key_separator")  # x-guidance's
# Where a schema holds other schemas — key: (a map of them by name, whether they are closed);
# otherwise one schema or a list of them. Other keys (enum, const, default, examples) hold data,
# left as it is. Those not closed judge the same object beside the schema holding them (a part
# of a conjunction, a condition, a negation): closed, they would refuse what the others name, so
# they stay open, their insides closed. anyOf's and oneOf's branches are each the whole object.
SUBSCHEMAS = {
    **dict.fromkeys(("properties", "patternProperties", "$defs", "definitions"), (True, True)),
    "dependentSchemas": (True, False),
    **dict.fromkeys(("anyOf", "oneOf", "prefixItems", "items", "additionalItems", "additionalProperties",
                     "unevaluatedProperties", "unevaluatedItems", "contains", "propertyNames"), (False, True)),
    **dict.fromkeys(("allOf", "not", "if", "then", "else"), (False, False)),
}


def served_schema(schema: Any) -> Any:
    """``schema`` with its objects closed and its whitespace bounded (a new schema: the request's
    is left as it is)."""
    return bounded_whitespace(closed_objects(schema))


def bounded_whitespace(schema: Any) -> Any:
    """A JSON schema with JSON_WHITESPACE in its ``x-guidance``, unless it says its own whitespace
    there (llguidance takes each key of its defaults the schema leaves out, so a schema's
    whitespace_flexible false would otherwise go with this pattern)."""
    guidance = schema.get("x-guidance", {}) if isinstance(schema, dict) else None
    if not isinstance(guidance, dict) or any(key in guidance for key in WHITESPACE_OPTIONS):
        return schema
    return {**schema, "x-guidance": {**guidance, "whitespace_pattern": JSON_WHITESPACE}}


def closed_objects(schema: Any, close: bool = True) -> Any:
    """``schema`` with ``additionalProperties: false`` in every object schema that names
    properties and says nothing of others (and ``items: false`` in every tuple, ``prefixItems``
    that says nothing of more items). Schemas that judge the object beside the one holding them
    (``allOf``'s parts, ``not``, ``if``/``then``/``else``, ``dependentSchemas``) are left open,
    their own subschemas closed. ``close``: whether ``schema`` itself is closed."""
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    for key, (by_name, close_them) in SUBSCHEMAS.items():
        held = closed.get(key)
        if by_name and isinstance(held, dict):
            closed[key] = {name: closed_objects(sub, close_them) for name, sub in held.items()}
        elif isinstance(held, list):
            closed[key] = [closed_objects(sub, close_them) for sub in held]
        elif isinstance(held, dict):
            closed[key] = closed_objects(held, close_them)
    names = "properties" in closed or "patternProperties" in closed
    if close and names and "additionalProperties" not in closed and "unevaluatedProperties" not in closed:
        closed["additionalProperties"] = False
    if close and "prefixItems" in closed and "items" not in closed and "unevaluatedItems" not in closed:
        closed["items"] = False  # a tuple takes no items past those it names (xgrammar's strict mode too)
    return closed
