"""A request's JSON schema as the grammar serves it (spec.json_schema): objects closed to the
properties they name unless they say otherwise, whitespace bounded; the request's own schema
left as it was."""

from __future__ import annotations

import copy
import json

import pytest

from specctl.engine.tiny import make_byte_tokenizer
from specctl.spec.json_schema import JSON_WHITESPACE, closed_objects, served_schema
from specctl.spec.structured import grammar_text
from tests.test_structured import _takes

CITY = {"type": "object", "properties": {"name": {"type": "string"}, "country": {"type": "string"}},
        "required": ["name", "country"]}


def test_an_object_that_names_its_properties_takes_no_others_in_the_grammar():
    """As vLLM's default backend (xgrammar, strict), SGLang and llama.cpp hold it: Qwen2.5-Coder
    asked for name and country wrote five more keys and a history that ran to max_tokens."""
    tokenizer = make_byte_tokenizer()
    grammar = grammar_text("json", json.dumps(CITY))
    assert _takes(grammar, '{"name": "Paris", "country": "France"}', tokenizer)
    assert not _takes(grammar, '{"name": "Paris", "country": "France", "capital": true}', tokenizer)
    opened = grammar_text("json", json.dumps({**CITY, "additionalProperties": True}))
    assert _takes(opened, '{"name": "Paris", "country": "France", "capital": true}', tokenizer)
    typed = grammar_text("json", json.dumps({**CITY, "additionalProperties": {"type": "integer"}}))
    assert _takes(typed, '{"name": "P", "country": "F", "people": 2}', tokenizer)
    assert not _takes(typed, '{"name": "P", "country": "F", "people": "2"}', tokenizer)
    assert _takes(grammar_text("json", '{"type": "object"}'), '{"any": [1]}', tokenizer)  # names none: any
    pair = {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]}
    assert _takes(grammar_text("json", json.dumps(pair)), '[1, "a"]', tokenizer)
    assert not _takes(grammar_text("json", json.dumps(pair)), '[1, "a", 2]', tokenizer)
    assert _takes(grammar_text("json", json.dumps({**pair, "items": True})), '[1, "a", 2]', tokenizer)


def test_every_object_schema_inside_is_closed_and_data_and_allof_parts_are_left_as_they_are():
    item = {"type": "object", "properties": {"n": {"type": "integer"}}}
    schema = {"type": "object", "properties": {
        "items": {"type": "array", "items": item},
        "pair": {"type": "array", "prefixItems": [item, {"anyOf": [item, {"type": "null"}]}]},
        "properties": {"type": "object", "properties": {"properties": {"type": "string"}}},  # names, not schemas
        "ref": {"$ref": "#/$defs/thing"},
        "open": {**item, "additionalProperties": True}, "rest": {**item, "unevaluatedProperties": False},
        "both": {"allOf": [item, {"properties": {"m": item}}]},
        "cond": {**item, "if": item, "then": {"properties": {"m": item}}, "not": item,
                 "dependentSchemas": {"n": {"properties": {"k": item}}}},
        "data": {"enum": [{"properties": {}}], "default": {"properties": {}}},
    }, "$defs": {"thing": item}}
    asked = copy.deepcopy(schema)
    closed = closed_objects(schema)
    assert schema == asked  # the request's schema untouched
    shut = {**item, "additionalProperties": False}
    props = closed["properties"]
    assert closed["additionalProperties"] is False and closed["$defs"]["thing"] == shut
    assert props["items"]["items"] == shut and props["pair"] == {
        "type": "array", "prefixItems": [shut, {"anyOf": [shut, {"type": "null"}]}], "items": False}
    assert props["properties"] == {"type": "object", "properties": {"properties": {"type": "string"}},
                                   "additionalProperties": False}
    assert props["ref"] == {"$ref": "#/$defs/thing"}
    assert props["open"] == {**item, "additionalProperties": True}
    assert props["rest"] == {**item, "unevaluatedProperties": False}
    assert props["both"] == {"allOf": [item, {"properties": {"m": shut}}]}  # parts open, their insides closed
    assert props["cond"] == {**shut, "if": item, "then": {"properties": {"m": shut}}, "not": item,
                             "dependentSchemas": {"n": {"properties": {"k": shut}}}}
    assert props["data"] == {"enum": [{"properties": {}}], "default": {"properties": {}}}
    assert closed_objects(True) is True and closed_objects([1]) == [1]


@pytest.mark.parametrize("schema", [CITY, {"type": "array", "items": CITY}])
def test_the_served_schema_is_closed_and_its_whitespace_bounded(schema):
    served = served_schema(schema)
    assert served["x-guidance"] == {"whitespace_pattern": JSON_WHITESPACE}
    assert closed_objects(schema) == {key: value for key, value in served.items() if key != "x-guidance"}
    tokenizer = make_byte_tokenizer()
    text = '{"name": "Paris", "country": "France", "x": 1}'
    assert not _takes(grammar_text("json", json.dumps(schema)), text if schema is CITY else f"[{text}]", tokenizer)
