"""Tool calling (gateway.tools, gateway.tool_calls): tools rendered by the model's own chat
template, the target's text read back for Hermes ``<tool_call>`` blocks — whole, or streamed
name first and arguments as they come — and what cannot be served (legacy functions, a
template without tools) refused by name."""

import json
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specctl.cluster.embedded import ClusterConfig, ClusterThread
from specctl.config import build_config
from specctl.engine.tiny import make_byte_tokenizer
from specctl.gateway.api import ApiError, ChatCompletionRequest
from specctl.gateway.request_body import parse_body
from specctl.gateway.harmony import harmony_calls
from specctl.gateway.glm_calls import StreamedGlmCalls as GlmCalls, glm_calls
from specctl.gateway.tool_parsers import FunctoolsCalls, JsonCalls, MistralCalls, functools_calls, json_calls
from specctl.gateway.pythonic_calls import StreamedPythonicCalls as PythonicCalls, pythonic_calls
from specctl.gateway.mistral_calls import mistral_calls
from specctl.gateway.respond import call_chunks
from specctl.gateway.tool_calls import ForcedCalls, StreamedCalls, parse, read_whole
from specctl.gateway.tools import forced_call, request_tools
from specctl.spec.json_schema import served_schema
from specctl.gateway.translate import chat_messages
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


def joined(deltas: list[dict]) -> list[dict]:
    """Streamed tool-call deltas joined as OpenAI's client joins them: by index, strings appended."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        call = calls.setdefault(delta["index"], {"function": {"name": "", "arguments": ""}})
        call.update({k: v for k, v in delta.items() if k in ("id", "type")})
        for key, piece in delta.get("function", {}).items():
            call["function"][key] += piece
    return [calls[i] for i in sorted(calls)]


def streamed(reader, text: str, size: int) -> tuple[str, list[list[dict]], list[dict] | None]:
    """``text`` pushed ``size`` characters at a time: (content, the deltas of each push and of the
    finish, the calls)."""
    content, pushes = "", []
    for i in range(0, len(text), size):
        piece, deltas = reader.push(text[i:i + size])
        content += piece
        pushes.append(deltas)
    rest, deltas, calls = reader.finish()
    return content + rest, pushes + [deltas], calls


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_a_streamed_call_comes_name_first_then_its_arguments_as_written(size):
    two = ("Checking <b>now</b>.\n" + CALL + "\n" + CALL.replace("Paris", "Oslo, </tool>{x}")
           .replace('"arguments"', ' "arguments" ') + "\n")
    content, pushes, calls = streamed(StreamedCalls(), two, size)
    whole = parse(two)
    assert content == "Checking <b>now</b>.\n" == whole[0]
    deltas = [d for push in pushes for d in push]
    assert [{**c, "id": ""} for c in joined(deltas)] == [{**c, "id": ""} for c in calls] == [{**c, "id": ""} for c in whole[1]]
    assert [c["function"]["arguments"] for c in calls] == ['{"city": "Paris"}', '{"city": "Oslo, </tool>{x}"}']
    assert [(d["index"], d["function"]["name"]) for d in deltas if "id" in d] == [(0, "get_weather"), (1, "get_weather")]
    if size == 1:  # the name goes out with the arguments' first character; the rest piece by piece
        first = next(i for i, push in enumerate(pushes) if push)
        assert first == two.index('{"city"')
        assert pushes[first] == [{"index": 0, "id": calls[0]["id"], "type": "function",
                                  "function": {"name": "get_weather", "arguments": ""}},
                                 {"index": 0, "function": {"arguments": "{"}}]
        assert sum(1 for push in pushes for d in push if d["index"] == 0 and "id" not in d) >= 10


def test_streamed_content_stops_at_the_first_call_and_odd_blocks_are_read_when_they_close():
    plain = StreamedCalls()
    assert plain.push("a <tool") == ("a ", []) and plain.push("box> b") == ("<toolbox> b", [])  # held back, then out
    assert plain.push(" <tool_c") == (" ", []) and plain.finish() == ("<tool_c", [], None)  # never a call: text after all
    odd = StreamedCalls()  # keys the other way round, or no arguments: a call once the block closes
    assert odd.push('<tool_call>{"arguments": {"a": 1}, "name": "f"}') == ("", [])
    _, deltas = odd.push('</tool_call><tool_call>{"name": "g"}')
    assert [(d["function"]["name"], d["function"]["arguments"]) for d in deltas] == [("f", '{"a": 1}')]
    _, deltas, calls = odd.finish()  # the last block ended without its tag: read at the finish
    assert [(d["function"]["name"], d["function"]["arguments"]) for d in deltas] == [("g", "{}")] and len(calls) == 2


def test_a_call_cut_short_or_malformed_stays_streamed_but_a_whole_answer_keeps_the_text():
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    content, pushes, calls = streamed(StreamedCalls(), cut, 3)
    assert content == "" and calls is None and parse(cut) is None
    assert joined([d for push in pushes for d in push])[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Par'}
    extra = '<tool_call>{"name": "f", "arguments": {"a": 1}, "more": 2}</tool_call>'  # not {name, arguments}
    _, pushes, calls = streamed(StreamedCalls(), extra, 4)
    assert calls is None and parse(extra) is None
    assert joined([d for push in pushes for d in push])[0]["function"]["name"] == "f"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["<tool_call>", "</tool_call>", "<tool", "_call>", '{"name": "f", "arguments": ',
                                 '{"arguments": {}, "name": "h"}', "{", "}", " ", "\n", '"a"', ":", "1", ",", "x", '"',
                                 "\\", "ok "]), max_size=24).map("".join),
       st.integers(min_value=1, max_value=7), st.sampled_from([None, 1]))
def test_streamed_hermes_calls_cut_anywhere_are_the_whole_output_s(text, piece, max_calls):
    """Any text in any pieces: the content and calls are those of reading it in one piece, and
    the streamed pieces join into each call's arguments (or, when the whole text is no calls,
    all of it is content, or the calls streamed so far stay with no whole ones)."""
    reader = StreamedCalls(max_calls)
    content, deltas = _streamed_in(reader, [text[i:i + piece] for i in range(0, len(text), piece)])
    calls = reader.finish()[2]
    whole_reader = StreamedCalls(max_calls)
    whole_content, _ = _streamed_in(whole_reader, [text])
    whole = whole_reader.finish()[2]
    if whole is not None:
        assert content == whole_content and [c["function"] for c in calls] == [c["function"] for c in whole]
        assert _joined(deltas) == [(c["function"]["name"], c["function"]["arguments"]) for c in whole]
    else:
        assert calls is None and (content == text or (deltas and content == text[:text.find("<tool_call>")]))


def test_parallel_tool_calls_false_keeps_the_first_call_streamed_or_whole():
    two = CALL + "\n" + CALL.replace("Paris", "Oslo") + "\n<tool_call>{broken"
    content, pushes, calls = streamed(StreamedCalls(max_calls=1), two, 3)
    assert content == "" and [c["function"]["arguments"] for c in calls] == ['{"city": "Paris"}']
    assert [{**c, "id": ""} for c in joined([d for push in pushes for d in push])] == [{**calls[0], "id": ""}]
    schema = forced_call([WEATHER], "required", parallel=False).structured[1]
    assert json.loads(schema)["maxItems"] == 1 and "maxItems" not in json.loads(
        forced_call([WEATHER], "required").structured[1])


def test_a_forced_call_is_held_to_its_schema_and_read_back_as_the_call():
    named, structured, native = forced_call([WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    assert (named, structured, native) == ("get_weather", ("json", json.dumps(WEATHER["function"]["parameters"])),
                                           False)  # vLLM's: the arguments alone
    reader = ForcedCalls(named)
    (content, first), (more, second) = reader.push('{"city": '), reader.push('"Oslo"}')
    rest, last, calls = reader.finish()
    assert content + more + rest == "" and last == []
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'} == joined(first + second)[0]["function"]
    assert first == [{"index": 0, "id": calls[0]["id"], "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"city": '}}]
    assert reader.finish_reason == "stop"  # OpenAI's for a named call
    named, (kind, schema), _ = forced_call([WEATHER], "required")
    assert named is None and json.loads(schema)["items"]["anyOf"][0]["properties"]["name"] == {"const": "get_weather"}
    reader = ForcedCalls(None)
    assert reader.push('[{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_weather", '
                       '"parameters": {}}]') == ("", [])  # read at the end
    _, deltas, calls = reader.finish()
    assert [c["function"]["arguments"] for c in calls] == ['{"city": "Rome"}', "{}"] and reader.finish_reason == "tool_calls"
    assert joined(deltas) == calls
    cut = ForcedCalls(None)
    cut.push('[{"name": "get_we')  # max_tokens came first: no call, the text stays content
    assert cut.finish() == ('[{"name": "get_we', [], None)
    assert forced_call([WEATHER], "auto") is None and forced_call(None, None) is None
    with pytest.raises(ApiError, match="tool_choice names 'get_time', which is not among the tools"):
        forced_call([WEATHER], {"type": "function", "function": {"name": "get_time"}})


def test_a_named_call_with_the_hermes_parser_is_held_to_the_model_s_own_call_format():
    """The named function's call as the template writes one, its tags the tokenizer's added tokens
    where it has them (a grammar's quoted text cannot be an added token); "required" keeps vLLM's
    JSON list; the hermes reader reads the call back with a named call's finish_reason."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    schema = json.dumps(served_schema(WEATHER["function"]["parameters"]))  # as a json constraint's
    byte_level = make_byte_tokenizer()  # its tags are text
    assert forced_call([WEATHER], named, parser="hermes", tokenizer=byte_level) == (
        "get_weather", ("grammar", 'start: "<tool_call>" "\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": " '
                                   'arguments "}\\n" "</tool_call>"\narguments: %json ' + schema + "\n"), True)
    tagged = make_byte_tokenizer()
    tagged.add_tokens(["<tool_call>", "</tool_call>"])
    opened, closed = tagged.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    grammar = forced_call([WEATHER], named, parser="hermes", tokenizer=tagged).structured[1]
    assert grammar.startswith(f"start: <[{opened}]> ") and f" <[{closed}]>\n" in grammar
    assert forced_call([WEATHER], "required", parser="hermes", tokenizer=tagged) == forced_call([WEATHER], "required")
    assert forced_call([WEATHER], named, parser="llama3_json", tokenizer=tagged) == forced_call([WEATHER], named)
    reader = StreamedCalls(1, "stop")  # generation's reader of such a call
    content, calls = read_whole(reader, CALL)
    assert content == "" and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert reader.finish_reason == "stop"


def test_a_push_s_call_deltas_go_out_in_chunks_that_hold_one_entry_a_call():
    first = {"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": ""}}
    piece, other = {"index": 0, "function": {"arguments": "{"}}, {"index": 1, "function": {"arguments": "}"}}
    assert call_chunks([first, piece, other, {"index": 1, "function": {"arguments": "x"}}]) == [
        [first], [piece, other], [{"index": 1, "function": {"arguments": "x"}}]]
    assert call_chunks([]) == [] and call_chunks([piece, other]) == [[piece, other]]


def test_one_tool_is_one_prompt_whichever_api_carried_it_in_whichever_key_order():
    """vLLM's order (name, description, parameters, then the rest as sent) and no nulls: the
    chat template renders each tool's JSON, so pydantic-ai's output tool sent by chat (with
    "strict") and by the Responses API (its own key order) gave different prompts and outputs
    (Rome's population 2873568 against 4893000)."""
    import msgspec

    from specctl.gateway.anthropic_api import MessagesRequest, as_chat as anthropic_chat
    from specctl.gateway.responses_api import ResponsesRequest, as_chat as responses_chat

    schema = WEATHER["function"]["parameters"]
    expected = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                 "parameters": schema, "strict": True}}
    shuffled = {"type": "function", "function": {"strict": True, "parameters": schema, "name": "get_weather",
                                                 "description": "Weather of a city", "title": None}}
    as_responses = msgspec.convert({"input": "x", "tools": [
        {"name": "get_weather", "parameters": schema, "strict": True, "type": "function",
         "description": "Weather of a city"}]}, ResponsesRequest)
    for tools in ([shuffled], responses_chat(as_responses).tools):
        rendered = request_tools(tools, "auto", TEMPLATE)
        assert rendered == [expected] and list(rendered[0]["function"]) == list(expected["function"])
    as_anthropic = msgspec.convert({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
                                    "tools": [{"input_schema": schema, "name": "get_weather",
                                               "description": "Weather of a city"}]}, MessagesRequest)
    rendered = request_tools(anthropic_chat(as_anthropic).tools, "auto", TEMPLATE)[0]["function"]
    assert list(rendered) == ["name", "description", "parameters"]  # an Anthropic tool has no strict


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
    body = {**body, "tool_choice": named, "max_tokens": 100}  # the call's tags and name are 45 tokens here
    code, _, raw = post(base + "/v1/chat/completions", body)
    assert code == 200, raw
    answer = json.loads(raw)["choices"][0]
    assert answer["finish_reason"] == finish and answer["message"]["content"] is None
    [call] = answer["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Oslo")
    written = make_byte_tokenizer().decode(json.loads(post(base + "/v1/chat/completions", {
        **body, "return_token_ids": True})[2])["choices"][0]["token_ids"])  # the model's own call format
    assert written == ('<tool_call>\n{"name": "get_weather", "arguments": ' + call["function"]["arguments"]
                       + "}\n</tool_call><|endoftext|>")  # token_ids hold the EOS that ended it (vLLM's)
    code, _, raw = post(base + "/v1/chat/completions", {**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in raw.split(b"\n\n") if line.startswith(b"data: {")]
    for c in chunks:  # one entry a call in a chunk, as OpenAI streams
        indexes = [d["index"] for d in c["choices"][0]["delta"].get("tool_calls", [])]
        assert len(indexes) == len(set(indexes))
    deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", [])]
    assert [c["function"] for c in joined(deltas)] == [call["function"]]
    assert len(deltas) > 2 and deltas[0]["function"]["name"] == "get_weather"  # the arguments as they come
    import openai
    from openai.lib.streaming.chat import ChatCompletionStreamState

    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    state = ChatCompletionStreamState()  # the official client joins the deltas into the whole call
    for chunk in client.chat.completions.create(**body, model=client.models.list().data[0].id, stream=True):
        state.handle_chunk(chunk)
    [joined_call] = state.current_completion_snapshot.choices[0].message.tool_calls
    assert (joined_call.function.name, joined_call.function.arguments) == (call["function"]["name"],
                                                                         call["function"]["arguments"])
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


LLAMA3_JSON = [
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', [("get_weather", {"city": "Oslo"})]),
    (' \n{"name": "a", "arguments": {}}; {"name": "b", "parameters": {"x": [1]}}', [("a", {}), ("b", {"x": [1]})]),
    ('<|python_tag|>{"name": "a", "parameters": {}}', [("a", {})]),  # the tag kept (skip_special_tokens false)
    ('{"name": "a", "parameters": {}} and then', None),  # text after a call: not calls, all content
    ('{"name": "a"}', None),
    ('{"name": "a", "parameters": {"x": ', None),  # cut by max_tokens
    ("It is sunny.", None),
]


def test_llama3_json_streams_content_as_it_comes_and_each_call_s_name_then_its_arguments():
    reader = JsonCalls()
    assert reader.push(" ") == ("", []) and reader.push("It ") == (" It ", []) and reader.push("is.") == ("is.", [])
    assert reader.finish() == ("", [], None)
    reader = JsonCalls(max_calls=1)  # parallel_tool_calls false: the first call
    text = '{"name": "a", "parameters": {"x": 1}};{"name": "b", "parameters": {}}'
    deltas = [d for i in range(0, len(text), 5) for d in _pushed(reader, text[i:i + 5])]
    rest, last, calls = reader.finish()
    assert rest == "" and last == [] and [c["function"]["name"] for c in calls] == ["a"]
    assert deltas[0] == {"index": 0, "id": calls[0]["id"], "type": "function", "function": {"name": "a", "arguments": ""}}
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"x": 1}' == calls[0]["function"]["arguments"]
    broken = JsonCalls()
    assert broken.push('{"name": ') == ("", []) and broken.finish() == ('{"name": ', [], None)  # held, then content


def _pushed(reader, piece: str) -> list[dict]:
    content, deltas = reader.push(piece)
    assert content == ""
    return deltas


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_llama3_json_calls_streamed_in_any_pieces_join_into_the_whole_answer_s_calls(size):
    """Each call's name as soon as it is read, its arguments as written: joined, the pieces are
    the calls the whole text holds (vLLM's llama3_json streams them so)."""
    text = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "days": [1, {"a": "}"}]}}; '
            '{"parameters": {"q": "x\\"y"}, "name": "search"};\n{"name": "c", "arguments": {}}')
    reader = JsonCalls()
    deltas = [d for i in range(0, len(text), size) for d in _pushed(reader, text[i:i + size])]
    rest, last, calls = reader.finish()
    deltas += last
    assert rest == "" and calls == [dict(c, id=calls[i]["id"]) for i, c in enumerate(json_calls(text))]
    for i, call in enumerate(calls):
        mine = [d for d in deltas if d["index"] == i]
        assert mine[0]["function"]["name"] == call["function"]["name"] and mine[0]["id"] == call["id"]
        assert json.loads("".join(d["function"]["arguments"] for d in mine)) == json.loads(
            call["function"]["arguments"])
    # the name-first calls went out before their objects closed
    first_args = next(i for i, d in enumerate(deltas) if d["index"] == 0 and d["function"]["arguments"])
    assert size == 1000 or first_args < len([d for d in deltas if d["index"] == 0]) - 1


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(['{"name": "a", "parameters": ', '{"name": "b", "arguments": ', '{"parameters": ',
                                 '"name": "c"', "{", "}", "[", "]", ",", ":", ";", " ", "\n", '"x"', '"\\""', "1",
                                 "<|python_tag|>", '"}"', "and"]), max_size=30).map("".join),
       st.integers(1, 9))
def test_llama3_json_streamed_reads_any_text_as_the_whole_parser_does(text, size):
    """Streamed in any pieces, the reader never raises, and its calls are the whole text's."""
    reader = JsonCalls()
    for i in range(0, len(text), size):
        reader.push(text[i:i + size])
    _, _, calls = reader.finish()
    whole = json_calls(text)
    assert (calls is None) == (whole is None)
    if calls is not None:
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["functools[", '{"name": "a", "arguments": ', '{"name": "b", "parameters": ',
                                 "{", "}", "[", "]", ",", ":", " ", '"x"', "1", '"name"', "then"]),
                max_size=25).map("".join), st.integers(1, 9))
def test_phi4_mini_json_streamed_reads_any_text_as_the_whole_parser_does(text, size):
    reader = FunctoolsCalls()
    deltas = []
    for i in range(0, len(text), size):
        deltas += reader.push(text[i:i + size])[1]
    _, last, calls = reader.finish()
    whole = functools_calls(text)
    assert (calls is None) == (whole is None), (calls, whole)
    if calls is not None:
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole]
        assert json.loads("".join(d["function"]["arguments"] for d in deltas + last if d["index"] == 0)) == \
            json.loads(calls[0]["function"]["arguments"])


def test_a_llama3_json_call_already_streamed_stays_when_what_follows_is_not_a_call():
    reader = JsonCalls()
    deltas = _pushed(reader, '{"name": "a", "parameters": {"x": 1}}')
    assert [d["function"]["name"] for d in deltas if "name" in d["function"]] == ["a"]
    assert reader.push(" and then") == ("", [])
    assert reader.finish()[2] is None  # not calls after all: a whole answer keeps its text as content
    assert read_whole(JsonCalls(), '{"name": "a", "parameters": {"x": 1}} and then')[1] is None


PYTHONIC = [
    ('[get_weather(city="Oslo")]', [("get_weather", {"city": "Oslo"})]),
    ("[a(), b(x=[1, 2.5], flag=True, none=None, nested={'k': (1, 'v')})]",
     [("a", {}), ("b", {"x": [1, 2.5], "flag": True, "none": None, "nested": {"k": [1, "v"]}})]),
    ('<|python_start|>[a(x=-1)]<|python_end|>', [("a", {"x": -1})]),  # Llama 4's tags kept
    (" \n[a(x='Oslo')] ", [("a", {"x": "Oslo"})]),
    ("[a('Oslo')]", None),  # positional: not a call by name
    ("[a(**kw)]", None),
    ("[a(x=open('f'))]", None),  # not a literal: read, never evaluated
    ("[a(x={1, 2})]", None),  # a set: no JSON
    ("[obj.a(x=1)]", None),
    ("[]", None),
    ("[1, 2, 3]", None),
    ("[a(x=1)] then", None),
    ('[get_weather(city="Os', None),  # cut by max_tokens
    ("Sunny.", None),
]


FUNCTOOLS = [  # Phi-4-mini's
    ('functools[{"name": "get_weather", "arguments": {"city": "Oslo"}}]', [("get_weather", {"city": "Oslo"})]),
    (' functools[{"name": "a", "parameters": {"x": 1}}, {"name": "b"}]\n', [("a", {"x": 1}), ("b", {})]),
    ('functools[{"name": "a", "arguments": "x"}]', None),
    ('functools[{"arguments": {}}]', None),
    ("functools[]", None),
    ('functools[{"name": "a"}] then', None),
    ('functools[{"name": "a", "argu', None),  # cut by max_tokens
    ("fun times", None),
]


@pytest.mark.parametrize("read, reader, text, calls", [(json_calls, JsonCalls, *case) for case in LLAMA3_JSON]
                         + [(pythonic_calls, PythonicCalls, *case) for case in PYTHONIC]
                         + [(functools_calls, FunctoolsCalls, *case) for case in FUNCTOOLS])
def test_a_whole_output_format_s_calls_are_the_whole_output_or_none(read, reader, text, calls):
    """llama3_json, pythonic and phi4_mini_json: the calls an output holds, or none (then all of
    it is content)."""
    found = read(text)
    assert (None if found is None else [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                        for c in found]) == calls
    content, read = read_whole(reader(), text)
    assert (content, read) == (text, None) if calls is None else (content == "" and len(read) == len(calls))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(list("[](){}=,'\"xa1. _*:;") + ["<|python_start|>", "True", "None", "lambda",
                                                                 '"name"', '"parameters"', '"arguments"',
                                                                 "[TOOL_CALLS]", "[ARGS]", "functools[",
                                                                 "<tool_call>", "</tool_call>", "\n", "<arg_key>",
                                                                 "</arg_key>", "<arg_value>", "</arg_value>", "<|call|>",
                                                                 "<|channel|>commentary to=functions.f<|message|>"]),
                max_size=40).map("".join))
def test_a_whole_output_parser_reads_any_text_without_raising(text):
    """What a model writes is arbitrary: the parsers answer calls or None, never an exception."""
    for read in (pythonic_calls, json_calls, mistral_calls, functools_calls, glm_calls, harmony_calls):
        calls = read(text)
        assert calls is None or all(isinstance(json.loads(c["function"]["arguments"]), dict) for c in calls)


def test_an_output_nested_past_json_s_depth_is_content_not_a_crash():
    """Found by writing the property test above: json's decoder raised RecursionError on a model
    output nested 100,000 deep (a 500 for the request); every reader now calls it no call."""
    deep = '{"name": "a", "parameters": ' + "[" * 100_000
    assert json_calls(deep) is None and pythonic_calls("[a(x=" + "[" * 100_000 + ")]") is None
    assert parse(f"<tool_call>{deep}</tool_call>") is None
    assert harmony_calls("<|channel|>commentary to=functions.f<|message|>" + "[" * 100_000) is None
    deep = "[" * 100_000
    deep_value = json.loads(glm_calls(f"<tool_call>f\n<arg_key>a</arg_key><arg_value>{deep}</arg_value></tool_call>")[0]
                            ["function"]["arguments"])
    assert deep_value == {"a": deep}  # not JSON: the text
    assert read_whole(ForcedCalls(None), "[" * 100_000) == ("[" * 100_000, None)


def _streamed_in(reader, pieces: list[str]) -> tuple[str, list[dict]]:
    """(content, tool-call deltas) of pushing ``pieces`` one by one and finishing."""
    content, deltas = "", []
    for piece in pieces:
        text, more = reader.push(piece)
        content, deltas = content + text, deltas + more
    rest, last, _ = reader.finish()
    return content + rest, deltas + last


def _joined(deltas: list[dict]) -> list[tuple[str, str]]:
    """Each streamed call's (name, arguments): its pieces joined, as a client joins them."""
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        function = delta["function"]
        call = calls.setdefault(delta["index"], [function.get("name", ""), ""])
        call[1] += function["arguments"]
    return [tuple(calls[i]) for i in sorted(calls)]


def test_pythonic_calls_stream_each_name_at_its_parenthesis_and_each_argument_at_its_comma():
    reader = PythonicCalls()
    assert reader.push("<|py") == ("", []) and reader.push("thon_start|>[get_") == ("", [])
    _, [named] = reader.push("weather(")  # the name, at once, with an id
    assert named["index"] == 0 and named["id"].startswith("call_")
    assert named["function"] == {"name": "get_weather", "arguments": ""}
    assert reader.push('city="Oslo (N)"') == ("", [])  # a bracket in a string does not close it; a value goes out whole
    assert reader.push(", days=") == ("", [{"index": 0, "function": {"arguments": '{"city": "Oslo (N)"'}}])
    assert reader.push("[1, 2") == ("", [])  # a comma inside the value's brackets ends no argument
    assert reader.push("])") == ("", [{"index": 0, "function": {"arguments": ', "days": [1, 2]}'}}])
    assert reader.calls[0]["function"]["arguments"] == '{"city": "Oslo (N)", "days": [1, 2]}'
    _, deltas = reader.push(", b()]<|python_end|>")
    assert [d["function"] for d in deltas] == [{"name": "b", "arguments": ""}, {"arguments": "{}"}]
    rest, last, calls = reader.finish()
    assert (rest, last) == ("", []) and [c["function"]["name"] for c in calls] == ["get_weather", "b"]
    # parallel_tool_calls false: the first call only, the rest not read
    reader = PythonicCalls(max_calls=1)
    assert [d["function"].get("name") for d in reader.push("[a(x=1), b()]")[1]] == ["a", None]
    assert [c["function"]["name"] for c in reader.finish()[2]] == ["a"]
    # content is content as it comes
    reader = PythonicCalls()
    assert reader.push("<b>") == ("<b>", []) and reader.push(" bold") == (" bold", []) and reader.finish() == ("", [], None)
    # not calls before any went out: all of it is content
    broken = PythonicCalls()
    assert broken.push("[not python") == ("", []) and broken.finish() == ("[not python", [], None)
    # a call streamed stays streamed when a later one is malformed or cut short: no calls whole
    for tail in (", b('positional')]", ', b(x="cut', " b()]", ", b()] and more"):
        reader = PythonicCalls()
        content, deltas = _streamed_in(reader, ["[a(x=1)", tail])
        assert content == "" and _joined(deltas)[0] == ("a", '{"x": 1}')
        assert reader.finish()[2] is None


TRIPLE = """[note(text='''it's "quoted" (twice)''', n=2)]"""


@pytest.mark.parametrize("text", [case for case, calls in PYTHONIC if calls is not None] + [TRIPLE])
@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_pythonic_calls_cut_anywhere_stream_the_calls_of_the_whole_output(text, cuts):
    """However the text arrives, the pieces join into the calls read whole (a quote, a triple
    quote or the tag cut in two is waited for)."""
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    content, deltas = _streamed_in(PythonicCalls(), [text[a:b] for a, b in zip(bounds, bounds[1:])])
    assert content == ""
    assert _joined(deltas) == [(c["function"]["name"], c["function"]["arguments"]) for c in pythonic_calls(text)]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(list("[](){}=,'\"xa1. _*:;\\") + ["<|python_start|>", "<|python_end|>", "True",
                                                                 "'''", '"""', "\n", "b(", "x="]),
                max_size=30).map("".join), st.integers(min_value=1, max_value=5))
def test_streamed_pythonic_calls_never_raise_and_complete_only_as_the_whole_output_reads(text, piece):
    reader = PythonicCalls()
    content, deltas = _streamed_in(reader, [text[i:i + piece] for i in range(0, len(text), piece)])
    calls = reader.finish()[2]
    if calls is not None:
        whole = pythonic_calls(text)
        assert whole is not None and [c["function"] for c in calls] == [c["function"] for c in whole]
        assert _joined(deltas) == [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    assert content in ("", text)


MISTRAL = [  # (the text after [TOOL_CALLS], the calls or None)
    (' [{"name": "get_weather", "arguments": {"city": "Oslo"}}]', [("get_weather", {"city": "Oslo"})]),  # before v11
    ('[{"name": "a", "arguments": {}}, {"name": "b"}]</s> more', [("a", {}), ("b", {})]),  # after the list: ignored
    ('get_weather[ARGS]{"city": "Oslo"}', [("get_weather", {"city": "Oslo"})]),  # v11+, [ARGS] kept
    ('a{"x": 1}[TOOL_CALLS]b[ARGS]{"y": [2]}', [("a", {"x": 1}), ("b", {"y": [2]})]),
    ('[{"name": "a", "arguments": [1]}]', None),
    ('[{"arguments": {}}]', None),
    ("[]", None),
    ('get_weather[ARGS]{"city": "Os', None),  # cut by max_tokens
    ('a{"x": 1} and more', None),
    ('a[ARGS][1, 2]', None),
    ("I cannot call a tool.", None),
    ("", None),
]


@pytest.mark.parametrize("text, calls", MISTRAL)
def test_mistral_calls_follow_the_tag_in_either_tokenizer_s_shape(text, calls):
    found = mistral_calls(text)
    assert (None if found is None else [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                        for c in found]) == calls
    content, read = read_whole(MistralCalls(), "Let me see. [TOOL_CALLS]" + text)
    if calls is None:
        assert (content, read) == ("Let me see. [TOOL_CALLS]" + text, None)
    else:  # the content before the tag stays; ids as Mistral's templates want them: 9 letters and digits
        assert content == "Let me see. " and len(read) == len(calls)
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in read)


def test_mistral_streams_content_until_the_tag_then_each_call_s_name_and_arguments():
    reader = MistralCalls()
    assert reader.push("It is") == ("It is", []) and reader.push(" [TOOL") == (" ", [])  # a tag begun: held
    assert reader.push("S] sunny") == ("[TOOLS] sunny", []) and reader.finish() == ("", [], None)
    reader = MistralCalls(max_calls=1)  # parallel_tool_calls false: the first call
    content, deltas = reader.push("[TOOL_CALLS]a{")
    assert content == "" and deltas == [{"index": 0, "id": reader.reader.calls[0]["id"], "type": "function",
                                         "function": {"name": "a", "arguments": ""}},
                                        {"index": 0, "function": {"arguments": "{"}}]
    assert reader.push("}[TOOL_CALLS]b{}") == ("", [{"index": 0, "function": {"arguments": "}"}}])
    rest, deltas, calls = reader.finish()
    assert (rest, deltas) == ("", []) and [c["function"]["name"] for c in calls] == ["a"]
    broken = MistralCalls()
    assert broken.push("ok [TOOL_CALLS]a") == ("ok ", []) and broken.finish() == ("[TOOL_CALLS]a", [], None)


@pytest.mark.parametrize("size", [1, 4, 1000])
@pytest.mark.parametrize("body", ['get_weather[ARGS]{"city": "Oslo", "n": [1, {"a": "}"}]}[TOOL_CALLS] b{"x": "[ARGS]"}',
                                  ' [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "b"},'
                                  ' {"arguments": {"y": 2}, "name": "c"}] and then'])
def test_mistral_calls_streamed_in_any_pieces_join_into_the_whole_answer_s(size, body):
    """v11's named calls and the earlier list alike: the names first, the arguments as written."""
    text = "Checking. [TOOL_CALLS]" + body
    reader, content, deltas = MistralCalls(), "", []
    for i in range(0, len(text), size):
        piece, more = reader.push(text[i:i + size])
        content, deltas = content + piece, deltas + more
    rest, last, calls = reader.finish()
    assert content + rest == "Checking. " and last == []
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in mistral_calls(body)]
    for i, call in enumerate(calls):
        mine = [d for d in deltas if d["index"] == i]
        assert mine[0]["id"] == call["id"] and len(call["id"]) == 9 and call["id"].isalnum()
        assert json.loads("".join(d["function"]["arguments"] for d in mine)) == json.loads(
            call["function"]["arguments"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["[TOOL_CALLS]", "[ARGS]", "a", "b", "{", "}", "[", "]", ",", ":", " ", '"x"', "1",
                                 '{"name": "a", "arguments": ', '"name"', '"arguments"', "text"]),
                max_size=25).map("".join), st.integers(1, 9))
def test_mistral_streamed_reads_any_text_as_the_whole_parser_does(text, size):
    reader = MistralCalls()
    for i in range(0, len(text), size):
        reader.push(text[i:i + size])
    _, _, calls = reader.finish()
    start = text.find("[TOOL_CALLS]")
    whole = None if start < 0 else mistral_calls(text[start + len("[TOOL_CALLS]"):])
    assert (calls is None) == (whole is None), (calls, whole)
    if calls is not None:
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole]


@pytest.fixture(scope="module")
def mistral_cluster(tmp_path_factory):
    from tests.test_gateway_reasoning import scripted_cluster

    yield from scripted_cluster(tmp_path_factory, "mistral-tools", tool_call_parser="mistral")


def test_a_mistral_call_comes_back_after_its_content_streamed_or_not(mistral_cluster):
    """The scripted model's fifth line: "Checking. ", [TOOL_CALLS] (a special token, kept in the
    text of a request with tools, as vLLM's mistral parser keeps it), then the v11 call."""
    from transformers import AutoTokenizer

    from tests.test_gateway_reasoning import (CALL_TOKENS, JSON_CALL_TOKENS, MISTRAL_CALL_TOKENS,
                                              PYTHONIC_CALL_TOKENS, THOUGHT_TOKENS, _chat, _streamed)

    base, model = mistral_cluster[1]["gateway"], mistral_cluster[2]
    barred = AutoTokenizer.from_pretrained(model).convert_tokens_to_ids(
        [THOUGHT_TOKENS[0], CALL_TOKENS[0], JSON_CALL_TOKENS[0], PYTHONIC_CALL_TOKENS[0]])
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER], "max_tokens": 10,
            "temperature": 0, "logit_bias": {str(i): -100 for i in barred}}
    choice = _chat(base, body)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking. "
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert len(call["id"]) == 9 and call["id"].isalnum()
    chunks = _streamed(base, body)
    assert "".join(c["delta"].get("content") or "" for c in chunks) == "Checking. "
    deltas = [c for d in chunks for c in d["delta"].get("tool_calls") or []]  # the name, then the arguments
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert "".join(c["function"]["arguments"] for c in deltas) == '{"city": "Oslo"}'
    assert chunks[-1]["finish_reason"] == "tool_calls"
    plain = _chat(base, {**body, "tools": None})["choices"][0]  # no tools: the tag is skipped as any special token
    assert plain["message"]["content"] == MISTRAL_CALL_TOKENS[0] + MISTRAL_CALL_TOKENS[2] and plain["finish_reason"] == "stop"
    assert "tool_calls" not in plain["message"]


@pytest.fixture(scope="module")
def pythonic_cluster(tmp_path_factory):
    from tests.test_gateway_reasoning import scripted_cluster

    yield from scripted_cluster(tmp_path_factory, "pythonic-tools", tool_call_parser="pythonic")


def _whole_call_over_http(cluster, barred: list[str]) -> tuple[str, dict, list[int]]:
    """The scripted model's line after ``barred`` first tokens (logit_bias -100) with the weather
    tool, read by the cluster's parser: one get_weather call, whole and streamed, no content.
    Returns (gateway URL, the request body, the barred ids)."""
    from transformers import AutoTokenizer

    from tests.test_gateway_reasoning import _chat, _streamed

    base, model = cluster[1]["gateway"], cluster[2]
    ids = AutoTokenizer.from_pretrained(model).convert_tokens_to_ids(barred)
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER], "max_tokens": 10,
            "temperature": 0, "logit_bias": {str(i): -100 for i in ids}}
    choice = _chat(base, body)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    chunks = _streamed(base, body)
    assert "".join(c["delta"].get("content") or "" for c in chunks) == ""
    deltas = [c for d in chunks for c in d["delta"].get("tool_calls") or []]
    assert [c["function"]["name"] for c in deltas if "name" in c["function"]] == ["get_weather"]
    assert "".join(c["function"]["arguments"] for c in deltas) == '{"city": "Oslo"}'  # whole, or in pieces
    assert chunks[-1]["finish_reason"] == "tool_calls"
    return base, body, ids


def test_a_pythonic_call_comes_back_as_the_call_streamed_or_not(pythonic_cluster):
    from tests.test_gateway_reasoning import CALL_TOKENS, JSON_CALL_TOKENS, THOUGHT_TOKENS, _chat

    # the scripted model's fourth line: its pythonic call
    base, body, ids = _whole_call_over_http(pythonic_cluster, [THOUGHT_TOKENS[0], CALL_TOKENS[0], JSON_CALL_TOKENS[0]])
    # the hermes line read by the pythonic parser: content, as it is
    hermes = _chat(base, {**body, "logit_bias": {str(ids[0]): -100}})["choices"][0]
    assert hermes["message"]["content"] == "".join(CALL_TOKENS) and "tool_calls" not in hermes["message"]


@pytest.fixture(scope="module")
def json_tools_cluster(tmp_path_factory):
    """The scripted model (tests.test_gateway_reasoning) behind a gateway with --tool-call-parser llama3_json."""
    from tests.test_gateway_reasoning import scripted_cluster

    yield from scripted_cluster(tmp_path_factory, "json-tools", tool_call_parser="llama3_json")


def test_a_llama3_json_call_comes_back_as_the_call_streamed_or_not(json_tools_cluster):
    from tests.test_gateway_reasoning import CALL_TOKENS, THOUGHT_TOKENS, _chat

    # the scripted model's third line: its JSON call
    base, body, _ = _whole_call_over_http(json_tools_cluster, [THOUGHT_TOKENS[0], CALL_TOKENS[0]])
    plain = _chat(base, {**body, "tools": None, "logit_bias": {}})["choices"][0]  # no tools: the text as it is
    assert plain["message"]["content"] == "".join(THOUGHT_TOKENS) and "tool_calls" not in plain["message"]
    # llama3_json streams: the call's name in one chunk, its arguments in later ones
    from tests.test_gateway_reasoning import _streamed

    deltas = [c for d in _streamed(base, body) for c in d["delta"].get("tool_calls") or []]
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""} and len(deltas) >= 2
    with pytest.raises(ValueError, match=r"^--tool-call-parser must be one of hermes, llama3_json, pythonic, mistral, phi4_mini_json, openai, glm45, got 'xlam'$"):
        ClusterConfig(tool_call_parser="xlam")


@pytest.mark.parametrize("command", [["up"], ["gateway", "--target", "127.0.0.1:1"]])
def test_a_bad_tool_call_parser_is_one_line_before_anything_starts(command):
    from tests.conftest import run_here
    from tests.test_cli import _assert_one_line_error

    _assert_one_line_error(run_here(*command, "--tool-call-parser", "xlam", "--enable-auto-tool-choice"),
                           "--tool-call-parser must be one of hermes, llama3_json, pythonic, mistral, phi4_mini_json, openai, glm45, got 'xlam'")


GLM_CALL = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n<arg_key>days</arg_key>\n" \
           "<arg_value>3</arg_value>\n</tool_call>"


@pytest.mark.parametrize("text, calls", [
    (GLM_CALL, [("get_weather", {"city": "Oslo", "days": 3})]),  # a JSON value is JSON, any other the text
    (GLM_CALL + "\n" + GLM_CALL.replace("get_weather", "get_time"),
     [("get_weather", {"city": "Oslo", "days": 3}), ("get_time", {"city": "Oslo", "days": 3})]),
    ("<tool_call>now\n</tool_call>", [("now", {})]),  # no arguments
    # a key given twice: written twice, read as JSON readers read it (the last)
    ("<tool_call>f\n<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>a</arg_key><arg_value>2</arg_value></tool_call>",
     [("f", {"a": 2})]),
    ('<tool_call>f\n<arg_key>q</arg_key><arg_value>{"a": [1, 2]}</arg_value></tool_call>', [("f", {"q": {"a": [1, 2]}})]),
    ("<tool_call>f\n<arg_key>a</arg_key>", None),  # cut by max_tokens
    ("<tool_call>\n</tool_call>", None),  # no name
    (GLM_CALL + " and more", None),  # text after the calls
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call>', None),  # Hermes' shape, not GLM's
])
def test_glm45_calls_are_blocks_of_argument_pairs(text, calls):
    found = glm_calls(text)
    assert (None if found is None else [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                        for c in found]) == calls


def test_glm45_streams_content_until_the_first_block_then_each_name_and_its_arguments():
    reader = GlmCalls()
    assert reader.push("Checking.\n<tool") == ("Checking.\n", []) and reader.push("_call>get_wea") == ("", [])
    content, [named] = reader.push("ther\n<arg_key>city")  # the name once its line ends
    assert content == "" and named["id"].startswith("call_")
    assert named["function"] == {"name": "get_weather", "arguments": ""}
    assert reader.push("</arg_key>\n<arg_value>Os") == ("", [])  # a value goes out whole
    assert reader.push("lo</arg_value>\n<arg_key>days</arg_key>\n") == (  # each argument once its value ends
        "", [{"index": 0, "function": {"arguments": '{"city": "Oslo"'}}])
    assert reader.push("<arg_value>3</arg_value>\n</tool_call>") == (
        "", [{"index": 0, "function": {"arguments": ', "days": 3}'}}])
    assert reader.calls[0]["function"]["arguments"] == '{"city": "Oslo", "days": 3}'
    rest, deltas, calls = reader.finish()
    assert (rest, deltas) == ("", []) and reader.finish_reason == "tool_calls"
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    # not a block before any call went out: the text from the tag on is content, as it was
    broken = GlmCalls()
    assert broken.push("ok <tool_call>f") == ("ok ", []) and broken.finish() == ("<tool_call>f", [], None)
    broken = GlmCalls()
    assert broken.push("<tool_call></tool_call>") == ("", []) and broken.finish() == ("<tool_call></tool_call>", [], None)
    # parallel_tool_calls false: the first block only
    reader = GlmCalls(max_calls=1)
    assert len(reader.push(GLM_CALL + "\n" + GLM_CALL)[1]) == 2 and len(reader.finish()[2]) == 1
    # a call streamed stays when what follows is not a block: no calls whole
    for tail in (" and more", "\n<tool_call>f\n<arg_key>a</arg_key>", "\n<tool_call>f\n<arg_value>1</arg_value></tool_call>",
                 "\n<tool_call>f\n <arg_key>a</arg_key><arg_value>1</arg_value>"):  # pairs begin at the line's start
        reader = GlmCalls()
        content, deltas = _streamed_in(reader, [GLM_CALL, tail])
        assert content == "" and _joined(deltas) == [("get_weather", '{"city": "Oslo", "days": 3}')] + (
            [("f", "")] if "<tool_call>f" in tail else [])
        assert reader.finish()[2] is None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
                                 "\n", " ", "f", "x", "1", "<", "{}", "<tool", "_call>", "ok"]), max_size=24).map("".join),
       st.integers(min_value=1, max_value=7))
def test_streamed_glm45_calls_cut_anywhere_are_the_whole_output_s(text, piece):
    """Any text in any pieces: the content and calls are those of reading it whole — content up
    to the first tag, then the blocks' calls when they are the rest (else all of it content, or
    the calls streamed so far and no whole ones)."""
    reader = GlmCalls()
    content, deltas = _streamed_in(reader, [text[i:i + piece] for i in range(0, len(text), piece)])
    calls = reader.finish()[2]
    tag = text.find("<tool_call>")
    whole = glm_calls(text[tag:]) if tag >= 0 else None
    if whole is not None:
        assert content == text[:tag] and [c["function"] for c in calls] == [c["function"] for c in whole]
        assert _joined(deltas) == [(c["function"]["name"], c["function"]["arguments"]) for c in whole]
    else:
        assert calls is None and (content == text or (deltas and content == text[:tag]))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["{", "}", "[", "]", '"', "\\", "a", ",", " "]), max_size=30).map("".join))
def test_the_json_end_scanner_fed_piece_by_piece_finds_what_one_scan_finds(text):
    """The streamed readers' bracket counter keeps its place: fed growing prefixes it answers as a
    scan of each whole prefix does, reading each character once."""
    from specctl.gateway.json_calls import JsonEnd, json_end

    body = "{" + text
    scanner = JsonEnd(0)
    for size in range(1, len(body) + 1):
        assert scanner.find(body[:size]) == json_end(body[:size], 0)
