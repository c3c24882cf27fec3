"""Structured output through the gateway (gateway.structured): OpenAI's response_format and
vLLM's guided_* / structured_outputs give the target's own output under the grammar — what
``specctl generate`` gives with the same constraint — whole or streamed, in every choice, the
draft server following the grammar too; a bad or doubled constraint is a 400 naming its field."""

import json
import re
import subprocess
import sys

import pytest

from specctl.engine.tiny import make_byte_tokenizer
from specctl.gateway.api import ApiError, ChatCompletionRequest, CompletionRequest
from specctl.gateway.request_body import parse_body
from specctl.gateway.structured import structured_output
from specctl.spec.structured import JSON_OBJECT
from tests.test_gateway import PROMPT, post
from tests.test_structured import SCHEMA

REGEX = r"[a-c]{2,5}-\d{3}"
CHAT = {"messages": [{"role": "user", "content": "Give me a code."}]}


def generate_cli(tiny_dir, *flags: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "specctl", "generate", "--target", str(tiny_dir["llama"]),
                           "--mode", "ar", "--dtype", "fp32", "--prompt", PROMPT, "--max-tokens", "40", "--json",
                           *flags], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("body, expected", [
    ({"response_format": {"type": "json_object"}}, ("json", JSON_OBJECT)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"},
                                                                 "strict": True}}}, ("json", '{"type": "integer"}')),
    ({"guided_json": {"type": "string"}}, ("json", '{"type": "string"}')),
    ({"guided_json": '{"type": "string"}'}, ("json", '{"type": "string"}')),
    ({"guided_regex": "a+"}, ("regex", "a+")),
    ({"guided_choice": ["yes", "no"]}, ("choice", '["yes", "no"]')),
    ({"guided_grammar": 'start: "a" | "b"'}, ("grammar", 'start: "a" | "b"')),
    ({"structured_outputs": {"regex": "a+"}}, ("regex", "a+")),
    ({"structured_outputs": {"json_object": True}}, ("json", JSON_OBJECT)),
    ({"response_format": {"type": "text"}, "guided_json": None}, None),
])
def test_each_field_a_client_sends_it_in_is_read(body, expected):
    for kind, base in ((CompletionRequest, {"prompt": "x"}), (ChatCompletionRequest, CHAT)):
        assert structured_output(parse_body(json.dumps({**base, **body}).encode(), kind)) == expected


def test_completions_under_a_regex_equal_specctl_generate_and_stream_the_same(cluster, tiny_dir):
    base = cluster[1]["gateway"]
    reference = generate_cli(tiny_dir, "--regex", REGEX)
    assert re.fullmatch(REGEX, reference["text"]) and reference["finish_reason"] == "stop"
    for field in ({"guided_regex": REGEX}, {"structured_outputs": {"regex": REGEX}}):
        code, _, raw = post(base + "/v1/completions", {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, **field})
        assert code == 200, raw
        answer = json.loads(raw)
        choice = answer["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (reference["text"], "stop")
        # the draft server followed the grammar: free, this random draft never writes [a-c] where it must
        assert answer["specctl"]["accepted"] > 0
    code, _, raw = post(base + "/v1/completions", {"prompt": PROMPT, "max_tokens": 40, "temperature": 0,
                                                   "guided_regex": REGEX, "stream": True})
    chunks = [json.loads(line[6:]) for line in raw.split(b"\n\n") if line.startswith(b"data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == reference["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_chat_with_a_json_schema_answers_that_schema_in_every_sampled_choice(cluster):
    code, _, raw = post(cluster[1]["gateway"] + "/v1/chat/completions", {
        **CHAT, "max_tokens": 40, "temperature": 1.0, "seed": 5, "n": 3,
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": json.loads(SCHEMA)}}})
    assert code == 200, raw
    for choice in json.loads(raw)["choices"]:
        answer = json.loads(choice["message"]["content"])
        assert set(answer) == {"ok", "n"} and isinstance(answer["ok"], bool) and 0 <= answer["n"] <= 99
        assert choice["finish_reason"] == "stop"
    code, _, raw = post(cluster[1]["gateway"] + "/v1/chat/completions", {
        **CHAT, "max_tokens": 10, "temperature": 0, "guided_choice": ["red", "green", "blue"]})
    assert json.loads(raw)["choices"][0]["message"]["content"] in ("red", "green", "blue")


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "response_format json_schema needs json_schema.schema, a JSON schema object"),
    ({"response_format": {"type": "yaml"}}, "response_format",
     "response_format type must be 'text', 'json_object' or 'json_schema', got 'yaml'"),
    ({"guided_regex": "(ab"}, "guided_regex",
     'structured output (regex) is invalid: at 1(8): invalid regex "(ab" (in regex): regex parse error: error: '
     'unclosed group'),
    ({"guided_choice": "yes"}, "guided_choice", "guided_choice must be a non-empty list of strings"),
    ({"guided_json": 3}, "guided_json", "guided_json must be a JSON schema"),
    ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex",
     "one structured output a request, got 2 (response_format, guided_regex)"),
    ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs",
     "structured_outputs.xml is not supported: give one of json, regex, choice, grammar, json_object (and "
     "whitespace_pattern or disable_any_whitespace for JSON)"),
    ({"guided_regex": "a+", "ignore_eos": True}, "ignore_eos",
     "guided_regex cannot be combined with ignore_eos: the output ends where the grammar does, with EOS"),
])
def test_a_bad_constraint_is_refused_with_its_field(cluster, body, param, message):
    for route, base in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", CHAT)):
        code, _, raw = post(cluster[1]["gateway"] + route, {**base, "max_tokens": 2, **body})
        assert code == 400 and json.loads(raw)["error"] == {"message": message, "type": "invalid_request_error",
                                                            "param": param, "code": None}


def test_a_grammar_that_asks_for_an_added_token_as_text_is_a_400_that_says_how_to_write_it(cluster):
    """The tiny tokenizer reads "<|fim_prefix|>" as its added token 259, which a grammar's quoted
    text cannot be (llguidance offered it, then refused it: a 502 with the matcher's state)."""
    base = cluster[1]["gateway"]
    body = {"prompt": "x", "max_tokens": 4, "guided_grammar": 'start: "<|fim_prefix|>"'}
    code, _, raw = post(base + "/v1/completions", body)
    assert code == 400 and json.loads(raw)["error"] == {
        "message": "target instance: generation failed: structured output cannot go on: its grammar asks here for "
                   "text that this model writes only as an added token, which a grammar takes as a token, not as "
                   "text (<|fim_prefix|> <[259]>): write it as <[id]> in a Lark grammar",
        "type": "invalid_request_error", "param": None, "code": None}
    code, _, raw = post(base + "/v1/completions", {**body, "guided_grammar": "start: <[259]>"})
    assert code == 200 and json.loads(raw)["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("body, expected", [
    ({"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
     ("json", '{"type": "object", "x-guidance": {"whitespace_flexible": false}}')),
    ({"structured_outputs": {"json": {"type": "object", "x-guidance": {"whitespace_flexible": False, "lenient": True}},
                             "whitespace_pattern": "\n*"}},
     ("json", '{"type": "object", "x-guidance": {"lenient": true, "whitespace_pattern": "\\n*"}}')),
    ({"response_format": {"type": "json_object"}, "guided_whitespace_pattern": " ?"},
     ("json", '{"type": "object", "x-guidance": {"whitespace_pattern": " ?"}}')),
    ({"guided_regex": "a+", "structured_outputs": {"disable_fallback": True}}, ("regex", "a+")),
    ({"guided_json": {"x-guidance": "lenient"}, "guided_whitespace_pattern": " ?"},
     ("json", '{"x-guidance": {"whitespace_pattern": " ?"}}')),  # its x-guidance, not a dict, replaced
    ({"structured_outputs": {"disable_any_whitespace": False}}, None),
])
def test_the_whitespace_a_request_asks_for_goes_into_its_schema(body, expected):
    assert structured_output(parse_body(json.dumps({**CHAT, **body}).encode(), ChatCompletionRequest)) == expected


@pytest.mark.parametrize("body, param, message", [
    ({"guided_regex": "a+", "structured_outputs": {"disable_any_whitespace": True}}, "disable_any_whitespace",
     "disable_any_whitespace applies to a JSON schema object only"),
    ({"guided_json": {"type": "object"}, "guided_whitespace_pattern": 3}, "guided_whitespace_pattern",
     "guided_whitespace_pattern must be a regular expression (a string)"),
    ({"structured_outputs": {"json_object": True, "whitespace_pattern": " ", "disable_any_whitespace": True}},
     "whitespace_pattern", "give one of whitespace_pattern, disable_any_whitespace, not both"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern",
     "guided_whitespace_pattern applies to a JSON schema object only"),
    ({"guided_json": {"type": "object"}, "guided_whitespace_pattern": "(ab"}, "guided_json",
     "structured output (json) is invalid: regex parse error: error: unclosed group"),
])
def test_a_bad_whitespace_request_is_refused_with_its_field(body, param, message):
    with pytest.raises(ApiError) as caught:
        structured_output(parse_body(json.dumps({**CHAT, **body}).encode(), ChatCompletionRequest))
    assert (caught.value.param, str(caught.value)) == (param, message)


def test_a_model_pulled_to_line_breaks_cannot_pad_json_with_them(cluster):
    """logit_bias pulls the tiny model to "\\n" (which a JSON string cannot hold): with any
    whitespace allowed it wrote `{` and line breaks till max_tokens; bounded, it goes on with JSON."""
    newline = make_byte_tokenizer().encode("\n")[0]
    base = {**CHAT, "max_tokens": 40, "temperature": 0, "logit_bias": {str(newline): 100}}
    texts = {}
    for name, extra in (("bounded", {"response_format": {"type": "json_object"}}),
                        ("compact", {"structured_outputs": {"json_object": True, "disable_any_whitespace": True}}),
                        ("asked", {"structured_outputs": {"json_object": True, "whitespace_pattern": "\n*"}})):
        code, _, raw = post(cluster[1]["gateway"] + "/v1/chat/completions", {**base, **extra})
        assert code == 200, raw
        texts[name] = json.loads(raw)["choices"][0]["message"]["content"]
    assert texts["bounded"].startswith("{\n\n") and "\n\n\n" not in texts["bounded"]
    assert texts["compact"].startswith("{") and "\n" not in texts["compact"]
    assert texts["asked"] == "{" + "\n" * 39
