"""Tool calling (gateway.tools): tools rendered by the model's own chat template, the target's
text read back for Hermes ``<tool_call>`` blocks — whole or streamed — and what cannot be
served (forcing a call, legacy functions, a template without tools) refused by name."""

import json
import shutil

import pytest

from specctl.cluster.embedded import ClusterConfig, ClusterThread
from specctl.config import build_config
from specctl.gateway.api import ApiError, ChatCompletionRequest, chat_messages, parse_body
from specctl.gateway.tools import ForcedCalls, StreamedCalls, forced_call, parse, request_tools
from tests.conftest import running_cluster
from tests.test_gateway import post

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "today's weather",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# A Hermes template as Qwen2.5's renders tools, calls and answers (shortened)
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_call_is_parsed_into_openais_shape_and_anything_else_stays_text():
    content, calls = parse("Let me look.\n" + CALL)
    assert content == "Let me look.\n"
    assert [c["function"] for c in calls] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    content, calls = parse(CALL + "\n" + CALL.replace("Paris", "Oslo"))
    assert content is None and [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"},
                                                                                         {"city": "Oslo"}]
    assert parse("no call here") is None
    assert parse("<tool_call>\n{\"name\": \"get_weather\", \"argu") is None  # cut short by max_tokens
    assert parse("<tool_call>[1, 2]</tool_call>") is None  # not a call
    assert parse('<tool_call>\n{"name": "f"}\n')[1][0]["function"] == {"name": "f", "arguments": "{}"}


def test_streamed_content_stops_at_the_first_call_and_the_calls_come_at_the_end():
    text = "Checking <b>now</b>.\n" + CALL
    streamed = StreamedCalls()
    pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
    out = "".join(streamed.push(piece) for piece in pieces)
    rest, calls = streamed.finish()
    assert out + rest == "Checking <b>now</b>.\n" == parse(text)[0]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    plain = StreamedCalls()
    assert plain.push("a <tool") == "a " and plain.push("box> b") == "<toolbox> b"  # held back, then handed out
    assert plain.push(" <tool_c") == " " and plain.finish() == ("<tool_c", None)  # never a call: text after all


def test_a_forced_call_is_held_to_its_schema_and_read_back_as_the_call():
    named, structured = forced_call([WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    assert (named, structured) == ("get_weather", ("json", json.dumps(WEATHER["function"]["parameters"])))
    reader = ForcedCalls(named)
    assert reader.push('{"city": ') + reader.push('"Oslo"}') == ""
    rest, calls = reader.finish()
    assert rest == "" and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert reader.finish_reason == "stop"  # OpenAI's for a named call
    named, (kind, schema) = forced_call([WEATHER], "required")
    assert named is None and json.loads(schema)["items"]["anyOf"][0]["properties"]["name"] == {"const": "get_weather"}
    reader = ForcedCalls(None)
    reader.push('[{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_weather", "parameters": {}}]')
    _, calls = reader.finish()
    assert [c["function"]["arguments"] for c in calls] == ['{"city": "Rome"}', "{}"] and reader.finish_reason == "tool_calls"
    cut = ForcedCalls(None)
    cut.push('[{"name": "get_we')  # max_tokens came first: no call, the text stays content
    assert cut.finish() == ('[{"name": "get_we', None)
    assert forced_call([WEATHER], "auto") is None and forced_call(None, None) is None
    with pytest.raises(ApiError, match="tool_choice names 'get_time', which is not among the tools"):
        forced_call([WEATHER], {"type": "function", "function": {"name": "get_time"}})


def test_tools_are_checked_and_go_through_the_template_with_earlier_calls_as_objects(tiny_dir):
    from transformers import AutoTokenizer

    assert request_tools([WEATHER], "auto", TEMPLATE) == [WEATHER]
    assert request_tools([WEATHER], "none", TEMPLATE) is None and request_tools(None, None, TEMPLATE) is None
    with pytest.raises(ApiError, match=r"^tools\[0\] must be \{\"type\": \"function\""):
        request_tools([{"type": "function"}], None, TEMPLATE)
    with pytest.raises(ApiError, match="this model's chat template does not render tools"):
        request_tools([WEATHER], None, "{{ messages }}")
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "call_1", "type": "function",
                              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]}
    messages = chat_messages(parse_body(json.dumps(body).encode(), ChatCompletionRequest))
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir["llama"])
    rendered = tokenizer.apply_chat_template(messages, tools=[WEATHER], chat_template=TEMPLATE, tokenize=False,
                                             add_generation_prompt=True)
    assert '<tools>{"type": "function", "function": {"name": "get_weather"' in rendered  # (trim_blocks)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in rendered
    body["messages"][1]["tool_calls"][0]["function"]["arguments"] = "{city"
    with pytest.raises(ApiError, match="a tool call's arguments must be JSON, got '\\{city'"):
        chat_messages(parse_body(json.dumps(body).encode(), ChatCompletionRequest))


@pytest.fixture(scope="module")
def tools_cluster(tiny_dir, tmp_path_factory):
    """The tiny model with a chat template that renders tools."""
    model = tmp_path_factory.mktemp("tools-model") / "llama"
    shutil.copytree(tiny_dir["llama"], model)
    config_path = model / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config.pop("chat_template", None)
    config_path.write_text(json.dumps(tokenizer_config))
    (model / "chat_template.jinja").write_text(TEMPLATE)
    config = build_config(None, target=str(model), draft=f"{model}@2", mode="chain", depth=3, dtype="fp32",
                          draft_quant="none", max_sessions=4)
    thread = ClusterThread(config, ClusterConfig(targets=1, gateway_port=0))
    urls = thread.start()
    yield thread, urls
    thread.stop()


def test_a_request_with_tools_is_served_with_them_in_its_prompt(tools_cluster):
    base = tools_cluster[1]["gateway"]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    with_tools = json.loads(post(base + "/tokenize", {"messages": messages, "tools": [WEATHER]})[2])["count"]
    without = json.loads(post(base + "/tokenize", {"messages": messages})[2])["count"]
    assert with_tools > without
    for stream in (False, True):
        code, _, raw = post(base + "/v1/chat/completions", {"messages": messages, "tools": [WEATHER], "max_tokens": 6,
                                                            "temperature": 0, "stream": stream,
                                                            "stream_options": {"include_usage": True}})
        assert code == 200, raw
        if not stream:
            answer = json.loads(raw)
            assert answer["usage"]["prompt_tokens"] == with_tools
            assert "tool_calls" not in answer["choices"][0]["message"]  # random weights call nothing
        else:
            chunks = [json.loads(line[6:]) for line in raw.split(b"\n\n") if line.startswith(b"data: {")]
            assert chunks[-1]["usage"]["prompt_tokens"] == with_tools
    code, _, raw = post(base + "/v1/chat/completions", {"messages": messages, "tools": [WEATHER], "max_tokens": 2,
                                                        "tool_choice": "none"})
    assert code == 200 and json.loads(raw)["usage"]["prompt_tokens"] == without


def test_a_forced_call_comes_back_as_the_call_streamed_or_not(tools_cluster):
    base = tools_cluster[1]["gateway"]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    tool = {**WEATHER, "function": {**WEATHER["function"], "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}}}
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = {"messages": messages, "tools": [tool], "tool_choice": "required", "max_tokens": 12, "temperature": 0}
    answer = json.loads(post(base + "/v1/chat/completions", body)[2])["choices"][0]
    # "required"'s list allows any whitespace around its items (vLLM's default), which this random model takes
    # till max_tokens: the text stays content (the complete list is read back in the test above)
    assert answer["finish_reason"] == "length" and "tool_calls" not in answer["message"]
    assert answer["message"]["content"].startswith("[")
    finish = "stop"  # OpenAI's for a named call
    body = {**body, "tool_choice": named, "max_tokens": 60}
    code, _, raw = post(base + "/v1/chat/completions", body)
    assert code == 200, raw
    answer = json.loads(raw)["choices"][0]
    assert answer["finish_reason"] == finish and answer["message"]["content"] is None
    [call] = answer["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Oslo")
    code, _, raw = post(base + "/v1/chat/completions", {**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in raw.split(b"\n\n") if line.startswith(b"data: {")]
    streamed = [c["choices"][0]["delta"]["tool_calls"] for c in chunks if "tool_calls" in c["choices"][0]["delta"]]
    assert [[c["function"] for c in calls] for calls in streamed] == [[call["function"]]]
    assert chunks[-1]["choices"][0]["finish_reason"] == finish


@pytest.fixture(scope="module")
def plain_cluster(tiny_dir):
    """The tiny model as packaged: its chat template renders no tools."""
    yield from running_cluster(tiny_dir)


@pytest.mark.parametrize("route, body, param, message", [
    ("/v1/chat/completions", {"tools": [WEATHER]}, "tools",
     "this model's chat template does not render tools, so it cannot be told of them: send the request without tools"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice",
     "tool_choice forces a call, but the request gives no tools"),
    ("/v1/chat/completions", {"tool_choice": {"type": "function", "function": "get_weather"}}, "tool_choice",
     "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions", "functions are not supported: send them as tools"),
    ("/v1/completions", {"tools": [WEATHER]}, "tools", "tools are for chat completions"),
])
def test_what_tools_cannot_do_here_is_refused_by_name(plain_cluster, route, body, param, message):
    prompt = {"messages": [{"role": "user", "content": "x"}]} if "chat" in route else {"prompt": "x"}
    code, _, raw = post(plain_cluster[1]["gateway"] + route, {**prompt, "max_tokens": 2, **body})
    assert code == 400 and json.loads(raw)["error"] == {"message": message, "type": "invalid_request_error",
                                                        "param": param, "code": None}
