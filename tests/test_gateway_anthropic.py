"""Anthropic's Messages API on the gateway (gateway.anthropic_api, gateway.anthropic_reply),
through Anthropic's own client: the same text as chat completions and `specctl generate
--chat`, whole or streamed as Anthropic's events, stop reasons, token counts, tool_use blocks
(a forced call, streamed as input_json_delta pieces), tool results fed back, errors in
Anthropic's shape, the request mapping and its refusals exactly."""

import json
import re
import urllib.request

import anthropic
import pytest

from specctl.gateway.anthropic_api import MessagesRequest, as_chat, error_body
from specctl.engine.tiny import make_byte_tokenizer
from specctl.gateway.api import ApiError
from specctl.gateway.request_body import check_key, parse_body
from tests.test_gateway import post, specctl_generate
from tests.test_gateway_tools import tools_cluster  # noqa: F401 - the fixture, a cluster of this module's own

MESSAGES = [{"role": "user", "content": "Say hello"}]
GREEDY = {"temperature": 0}  # Anthropic's newer clients no longer send sampling parameters
WEATHER = {"name": "get_weather", "description": "today's weather", "input_schema": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}}


def _client(cluster) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=cluster[1]["gateway"], api_key="unused", max_retries=0)


def _parsed(body: dict, count_only: bool = False):
    return as_chat(parse_body(json.dumps(body).encode(), MessagesRequest), count_only)


def test_a_message_is_the_chat_answer_of_the_same_turns_whole_and_streamed(cluster, tiny_dir):
    reference = specctl_generate(tiny_dir, "Say hello", 16, chat=True)
    client, model = _client(cluster), str(tiny_dir["llama"])
    message = client.messages.create(model=model, max_tokens=16, messages=MESSAGES, extra_body=GREEDY)
    assert [block.type for block in message.content] == ["text"] and message.content[0].text == reference["text"]
    assert message.role == "assistant" and message.id.startswith("msg_") and message.model == model
    assert message.stop_reason == ("max_tokens" if len(reference["token_ids"]) == 16 else "end_turn")
    prompt_tokens = reference["stats"]["prompt_tokens"]
    # Anthropic's input_tokens: the prompt's tokens not read from the cache
    assert (message.usage.input_tokens + message.usage.cache_read_input_tokens, message.usage.output_tokens) == (
        prompt_tokens, len(reference["token_ids"]))
    again = client.messages.create(model=model, max_tokens=16, messages=MESSAGES, extra_body=GREEDY)
    assert again.usage.cache_read_input_tokens > 0  # the same turns again: their prompt came from the cache
    assert again.usage.input_tokens == prompt_tokens - again.usage.cache_read_input_tokens
    with client.messages.stream(model=model, max_tokens=16, messages=MESSAGES, extra_body=GREEDY) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == reference["text"] and len(texts) > 1
    assert (final.content[0].text, final.stop_reason, final.usage.output_tokens) == (
        reference["text"], message.stop_reason, message.usage.output_tokens)
    # message_start could not know the cache's share; message_delta's usage says it
    assert final.usage.cache_read_input_tokens > 0
    assert final.usage.input_tokens == prompt_tokens - final.usage.cache_read_input_tokens
    # the events as Anthropic's stream sends them: message_start, a ping, the block, the message's end
    request = urllib.request.Request(cluster[1]["gateway"] + "/v1/messages", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"model": model, "max_tokens": 16, "messages": MESSAGES,
                                                      "stream": True, **GREEDY}).encode())
    with urllib.request.urlopen(request, timeout=60) as response:
        kinds = [line[7:].strip().decode() for line in response if line.startswith(b"event: ")]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    counted = client.messages.count_tokens(model=model, messages=MESSAGES)
    assert counted.input_tokens == prompt_tokens  # all of the prompt
    # a stop sequence: the text before it, named as the reason
    word = reference["text"][5:8]
    cut = client.messages.create(model=model, max_tokens=16, messages=MESSAGES, stop_sequences=[word],
                                 extra_body=GREEDY)
    assert (cut.content[0].text, cut.stop_reason, cut.stop_sequence) == (
        reference["text"][: reference["text"].index(word)], "stop_sequence", word)


def test_errors_come_in_anthropic_s_shape_through_its_client(cluster, tiny_dir):
    client = _client(cluster)
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-opus-4", max_tokens=8, messages=MESSAGES)
    assert missing.value.body["error"]["type"] == "not_found_error"
    assert "The model `claude-opus-4` does not exist" in missing.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model=str(tiny_dir["llama"]), max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert refused.value.body == {"type": "error", "error": {"type": "invalid_request_error", "message": (
        "messages[0].content[0]: a 'image' block is not served in a user message: give text, tool_use (assistant) "
        "or tool_result (user) blocks")}}
    status, _, body = post(cluster[1]["gateway"] + "/v1/messages", b"{not json")
    assert status == 400 and json.loads(body)["type"] == "error"


def test_a_max_tokens_past_the_context_is_cut_to_the_room_the_prompt_leaves(cluster, tiny_dir):
    """As llama.cpp serves Claude Code (32,000 tokens asked on every request) on a small context;
    chat keeps vLLM's 400, and a prompt that leaves no room is the 400 here too."""
    client, model = _client(cluster), str(tiny_dir["llama"])
    long = [{"role": "user", "content": "word " * 94}]  # 489 of the cluster's 512 tokens: a short answer
    status, _, body = post(cluster[1]["gateway"] + "/v1/messages", {  # (Anthropic's client asks to stream this)
        "model": model, "max_tokens": 32000, "messages": long, "ignore_eos": True, **GREEDY})
    message = json.loads(body)
    assert status == 200, message
    usage = message["usage"]
    room = 512 - usage["input_tokens"] - usage["cache_read_input_tokens"]  # the cluster's context: 512
    assert (message["stop_reason"], usage["output_tokens"]) == ("max_tokens", room) and room < 40
    status, _, body = post(cluster[1]["gateway"] + "/v1/chat/completions",
                           {"model": model, "max_tokens": 32000, "messages": MESSAGES})
    assert status == 400 and "maximum context length is 512 tokens" in json.loads(body)["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model=model, max_tokens=8, messages=[{"role": "user", "content": "word " * 600}])
    assert "maximum context length is 512 tokens" in refused.value.body["error"]["message"]


def test_a_last_assistant_message_is_the_answer_s_beginning_which_it_goes_on_from(cluster, tiny_dir):
    """Anthropic's prefill: the answer continues the last assistant turn (vLLM's
    continue_final_message) and holds only what follows it."""
    client, model, base = _client(cluster), str(tiny_dir["llama"]), cluster[1]["gateway"]
    turns = [*MESSAGES, {"role": "assistant", "content": "Well,"}]
    continued = json.loads(post(base + "/v1/chat/completions", {
        "messages": turns, "max_tokens": 12, "add_generation_prompt": False, "continue_final_message": True,
        **GREEDY})[2])["choices"][0]["message"]["content"]
    anew = json.loads(post(base + "/v1/chat/completions", {"messages": turns, "max_tokens": 12, **GREEDY})[2])
    message = client.messages.create(model=model, max_tokens=12, messages=turns, extra_body=GREEDY)
    assert message.content[0].text == continued != anew["choices"][0]["message"]["content"]
    with client.messages.stream(model=model, max_tokens=12, messages=turns, extra_body=GREEDY) as stream:
        assert "".join(stream.text_stream) == continued
    prompt = json.loads(post(base + "/tokenize", {"messages": turns, "add_generation_prompt": False,
                                                  "continue_final_message": True})[2])["count"]
    assert client.messages.count_tokens(model=model, messages=turns).input_tokens == prompt
    assert prompt < anew["usage"]["prompt_tokens"]  # the turn left open: no end of turn, no new turn begun


def test_only_a_last_assistant_turn_of_text_is_continued():
    def options(messages):
        req = _parsed({"max_tokens": 4, "messages": messages})
        return req.add_generation_prompt, req.continue_final_message

    assert options(MESSAGES) == (True, False)
    assert options([*MESSAGES, {"role": "assistant", "content": [{"type": "text", "text": "Hi"}]}]) == (False, True)
    assert options([*MESSAGES, {"role": "assistant", "content": ""}]) == (True, False)
    assert options([*MESSAGES, {"role": "assistant", "content": [  # a call awaits its result: a new turn
        {"type": "text", "text": "Let me look."}, {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]) == (
        True, False)


def test_a_forced_tool_call_comes_back_as_a_tool_use_block_whole_and_streamed(tools_cluster):  # noqa: F811
    client = _client(tools_cluster)
    model = client.models.list().data[0].id
    asked = {"model": model, "max_tokens": 100, "extra_body": GREEDY, "tools": [WEATHER],
             "tool_choice": {"type": "tool", "name": "get_weather"},
             "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    message = client.messages.create(**asked)
    [call] = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and call.name == "get_weather" and call.input["city"] in ("Paris", "Oslo")
    assert all(block.type != "text" for block in message.content)
    with client.messages.stream(**asked) as stream:
        events = list(stream)
        final = stream.get_final_message()
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"
              and e.delta.type == "input_json_delta"]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == call.input  # the arguments as they come
    assert [b.type for b in final.content] == ["tool_use"] and final.content[0].input == call.input
    assert re.fullmatch("toolu_[0-9a-f]{24}", call.id) and re.fullmatch("toolu_[0-9a-f]{24}", final.content[0].id)
    assert final.stop_reason == "tool_use"
    # the call and its result fed back: the template renders them as chat's tool turns
    follow = client.messages.create(**{**asked, "tool_choice": {"type": "none"}, "max_tokens": 4, "messages": [
        *asked["messages"], {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name,
                                                                "input": call.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}]}]})
    as_chat_turns = [*asked["messages"], {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": call.id}]
    tokenized = json.loads(post(tools_cluster[1]["gateway"] + "/tokenize", {"messages": as_chat_turns})[2])
    assert follow.usage.input_tokens == tokenized["count"] and "sunny" in make_byte_tokenizer().decode(
        tokenized["tokens"])


def test_the_request_maps_to_chat_turns_and_what_is_not_served_is_refused():
    req = _parsed({"model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "Be brief."}],
                   "stop_sequences": ["\n"], "temperature": 0.5, "top_k": 4, "tools": [WEATHER],
                   "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
                   "thinking": {"type": "enabled", "budget_tokens": 1024}, "metadata": {"user_id": "u"},
                   "messages": [
                       {"role": "user", "content": "Weather?"},
                       {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                                         {"type": "text", "text": "Let me look."},
                                                         {"type": "tool_use", "id": "toolu_t1", "name": "get_weather",
                                                          "input": {"city": "Oslo"}}]},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_t1",
                                                     "content": [{"type": "text", "text": "rain"}]},
                                                    {"type": "text", "text": "And tomorrow?",
                                                     "cache_control": {"type": "ephemeral"}}]}]})
    assert [(m.role, m.content, m.tool_call_id) for m in req.messages] == [
        ("system", "Be brief.", None), ("user", "Weather?", None), ("assistant", "Let me look.", None),
        ("tool", "rain", "t1"), ("user", "And tomorrow?", None)]  # ids as the model wrote them (toolu_ taken off)
    [call] = req.messages[2].tool_calls
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == ("t1", "get_weather", {"city": "Oslo"})
    assert (req.max_completion_tokens, req.stop, req.temperature, req.top_k, req.tool_choice, req.parallel_tool_calls,
            req.chat_template_kwargs) == (9, ["\n"], 0.5, 4, "required", False, {"enable_thinking": True})
    assert req.tools == [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["input_schema"],
                                                           "description": "today's weather"}}]
    assert _parsed({"messages": MESSAGES}, count_only=True).max_completion_tokens is None
    for body, message, param in (
            ({"messages": MESSAGES}, "max_tokens: a number of tokens of at least 1 is required, got None", "max_tokens"),
            ({"max_tokens": 4, "messages": []}, "messages: at least one message is required", "messages"),
            ({"max_tokens": 4, "messages": [{"role": "tool", "content": "x"}]},
             "messages[0].role must be 'user', 'assistant' or 'system', got 'tool'", "messages"),
            ({"max_tokens": 4, "messages": [{"role": "system", "content": [{"type": "image"}]}]},
             "messages[0].content: only text blocks are served here", "messages"),
            ({"max_tokens": 4, "messages": MESSAGES, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
             "tools[0] must be a client tool {\"name\": ..., \"input_schema\": {...}}: Anthropic's server tools are "
             "not served", "tools"),
            ({"max_tokens": 4, "messages": MESSAGES, "tool_choice": {"type": "some"}},
             "tool_choice.type must be 'auto', 'any', 'tool' (with name) or 'none', got 'some'", "tool_choice"),
            ({"max_tokens": 4, "messages": MESSAGES, "thinking": {"type": "always"}},
             "thinking.type must be one of 'enabled', 'disabled', 'adaptive', 'between_tools', got 'always'", "thinking"),
            ({"max_tokens": 4, "messages": MESSAGES, "output_config": {"format": {"type": "text"}}},
             "output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}", "output_config"),
            ({"max_tokens": 4, "messages": MESSAGES, "mcp_servers": [{"url": "https://x"}]},
             "mcp_servers are not served: call the tools yourself and send tool_result blocks", "mcp_servers"),
            ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
             "messages[0].content[0]: a tool_result block needs tool_use_id", "messages")):
        with pytest.raises(ApiError) as refused:
            _parsed(body)
        assert (refused.value.status, str(refused.value), refused.value.param) == (400, message, param)


def test_a_system_message_among_the_turns_stays_where_it_stands():
    """Claude Code (beta mid-conversation-system) sends one after its first user message."""
    req = _parsed({"max_tokens": 4, "system": [{"type": "text", "text": "Be brief."}], "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": [{"type": "text", "text": "Agents: "}, {"type": "text", "text": "none."}]},
        {"role": "assistant", "content": "Hello."}, {"role": "system", "content": "Now in French."},
        {"role": "user", "content": "Bye"}]})
    assert [(m.role, m.content) for m in req.messages] == [
        ("system", "Be brief."), ("user", "Hi"), ("system", "Agents: none."), ("assistant", "Hello."),
        ("system", "Now in French."), ("user", "Bye")]


def test_the_key_comes_as_x_api_key_or_bearer_and_errors_name_anthropic_s_types():
    class Request:
        def __init__(self, headers):
            self.headers = headers

    check_key(Request({"x-api-key": "k"}), "k")
    check_key(Request({"Authorization": "Bearer k"}), "k")
    with pytest.raises(ApiError) as refused:
        check_key(Request({"x-api-key": "wrong"}), "k")
    assert error_body(refused.value) == {"type": "error", "error": {
        "type": "authentication_error", "message": "Incorrect API key provided: send `Authorization: Bearer <key>`"}}
    assert error_body(ApiError(503, "busy"))["error"]["type"] == "overloaded_error"
    assert error_body(ApiError(502, "target down"))["error"]["type"] == "api_error"


def test_streamed_blocks_open_and_close_in_order_and_whitespace_opens_no_text_block():
    import asyncio

    from specctl.gateway.anthropic_reply import StreamedBlocks

    def run(steps, show_thinking=True) -> list[tuple]:
        sent = []

        async def send(kind, **fields):
            sent.append((kind, fields.get("index"), fields.get("content_block", fields.get("delta"))))

        async def go():
            blocks = StreamedBlocks(send, show_thinking)
            for kind, *args in steps:
                await (blocks.think(*args) if kind == "think" else blocks.add(*args))
            await blocks.close()
        asyncio.run(go())
        return sent

    call = {"index": 0, "id": "call_t1", "type": "function", "function": {"name": "f", "arguments": ""}}
    assert run([("think", "hm"), ("add", "\n\n", []), ("add", "", [call]),
                ("add", "", [{"index": 0, "function": {"arguments": '{"a": 1}'}}])]) == [
        ("content_block_start", 0, {"type": "thinking", "thinking": "", "signature": ""}),
        ("content_block_delta", 0, {"type": "thinking_delta", "thinking": "hm"}),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, {"type": "tool_use", "id": "toolu_t1", "name": "f", "input": {}}),
        ("content_block_delta", 1, {"type": "input_json_delta", "partial_json": '{"a": 1}'}),
        ("content_block_stop", 1, None)]
    assert run([("think", "hm"), ("add", "\n", []), ("add", "Hi", [])], show_thinking=False) == [
        ("content_block_start", 0, {"type": "thinking", "thinking": "", "signature": ""}),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, {"type": "text", "text": ""}),
        ("content_block_delta", 1, {"type": "text_delta", "text": "\nHi"}),  # the whitespace goes with the text
        ("content_block_stop", 1, None)]
    assert run([]) == [("content_block_start", 0, {"type": "text", "text": ""}), ("content_block_stop", 0, None)]
