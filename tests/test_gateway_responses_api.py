"""OpenAI's Responses API on the gateway (gateway.responses_api, gateway.responses_reply), driven
by the official openai client: a response is the chat completion of the same messages, whole or
streamed as the Responses events; function tools in and calls out; structured text.format; what
is not served refused by name."""

import json

import openai
import pytest

from specctl.gateway.responses_api import ResponsesRequest, as_chat
from specctl.gateway.responses_reply import StreamedItems
from specctl.gateway.tool_calls import StreamedCalls, parse
from specctl.gateway.translate import chat_messages
from tests.conftest import logprobs_close
from tests.test_gateway import post
from tests.test_gateway_tools import CALL, WEATHER, tools_cluster  # noqa: F401 (a fixture)

QUESTION = "Name a colour."


def test_a_response_is_the_chat_completion_of_the_same_messages(cluster, client, tiny_dir):
    model = str(tiny_dir["llama"])
    response = client.responses.create(model=model, input=QUESTION, instructions="Be brief.", max_output_tokens=8,
                                       temperature=0)
    chat = client.chat.completions.create(model=model, max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}])
    assert response.output_text == chat.choices[0].message.content
    assert response.object == "response" and response.id.startswith("resp_") and response.model == model
    [message] = response.output
    assert (message.type, message.role, [part.type for part in message.content]) == ("message", "assistant",
                                                                                     ["output_text"])
    finish = chat.choices[0].finish_reason
    assert (response.status, message.status) == (("incomplete", "incomplete") if finish == "length"
                                                  else ("completed", "completed"))
    if finish == "length":
        assert response.incomplete_details.reason == "max_output_tokens"
    assert (response.usage.input_tokens, response.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                          chat.usage.completion_tokens)
    assert response.usage.total_tokens == chat.usage.total_tokens
    assert response.model_extra["specctl"]["rounds"] >= 1
    items = client.responses.create(model=model, max_output_tokens=8, temperature=0, instructions="Be brief.",
                                    input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}])
    assert items.output_text == response.output_text  # the same input as items with parts


def test_a_streamed_response_comes_as_the_responses_events(cluster, client, tiny_dir):
    model = str(tiny_dir["llama"])
    whole = client.responses.create(model=model, input=QUESTION, max_output_tokens=12, temperature=0)
    events = list(client.responses.create(model=model, input=QUESTION, max_output_tokens=12, temperature=0,
                                          stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    assert set(kinds[4:-4]) <= {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == events[-4].text == events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_included_logprobs_are_chats_whole_and_streamed(cluster, client, tiny_dir):
    model = str(tiny_dir["llama"])
    fields = dict(model=model, input=QUESTION, max_output_tokens=10, temperature=0, top_logprobs=2,
                  include=["message.output_text.logprobs"])
    asked = dict(model=model, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2,
                 messages=[{"role": "user", "content": QUESTION}])
    # both read the prompt from the prefix cache, as the module's earlier tests leave it (a cold
    # prefill's fp32 logprobs may round apart from a cached one's in the last digits on some hosts)
    client.chat.completions.create(**asked)
    response = client.responses.create(**fields)
    chat = client.chat.completions.create(**asked)
    [part] = response.output[0].content
    assert [lp.model_dump() for lp in part.logprobs] == \
        logprobs_close([lp.model_dump() for lp in chat.choices[0].logprobs.content])
    assert len(part.logprobs) == response.usage.output_tokens and response.top_logprobs == 2
    assert all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
    events = list(client.responses.create(**fields, stream=True))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    [done] = [e for e in events if e.type == "response.output_text.done"]
    whole = [lp.model_dump() for lp in part.logprobs]
    assert [lp.model_dump() for lp in done.logprobs] == logprobs_close(whole)
    # the rest (held back) comes with done
    assert streamed and [lp.model_dump() for lp in streamed] == logprobs_close(whole[:len(streamed)])
    assert client.responses.create(**{**fields, "include": None}).output[0].content[0].logprobs == []


def test_text_format_json_schema_holds_the_output_to_it(cluster, client, tiny_dir):
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "blue"]}}, "required": ["colour"],
              "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
    response = client.responses.create(model=str(tiny_dir["llama"]), input=QUESTION, max_output_tokens=40,
                                       text={"format": {"type": "json_schema", "name": "colour", "schema": schema}})
    assert response.status == "completed" and json.loads(response.output_text)["colour"] in ("red", "blue")
    assert response.text.format.type == "json_schema"


@pytest.mark.parametrize("fields, param, message", [
    ({"previous_response_id": "resp_1"}, "previous_response_id",
     "Previous response with id 'resp_1' not found: it was not stored (store false), was deleted, or is older than "
     "the last 256 this gateway keeps"),
    ({"background": True}, "background", "background responses are not served: leave background false"),
    ({"tools": [{"type": "web_search"}]}, "tools",
     'tools[0] must be a function tool {"type": "function", "name": ..., "parameters": {...}}: built-in tools are '
     'not served'),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
     "input[0] holds a part that is not text: only input_text and output_text are served"),
    ({"input": [{"type": "file_search_call", "queries": []}]}, "input",
     "input[0] must be a message of role user, system, developer, assistant, a function_call, a "
     "function_call_output or a reasoning item; got type 'file_search_call', role None"),
    ({"input": [{"type": "function_call_output", "output": "1"}]}, "input",
     "input[0] is a function_call_output without call_id and output"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input",
     "input[0] is a function_call without call_id, name and arguments"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format",
     "text.format type must be 'text', 'json_object' or 'json_schema', got 'grammar'"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens must be at least 1, got 0"),
    ({"include": ["message.output_text.logprobs", "reasoning.encrypted_content"]}, "include",
     "include[1] 'reasoning.encrypted_content' is not served: only 'message.output_text.logprobs'"),
    ({"include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs",
     "top_logprobs must be between 0 and 20, got 21"),
])
def test_what_is_not_served_is_refused_by_name(cluster, fields, param, message):
    code, _, raw = post(cluster[1]["gateway"] + "/v1/responses", {"input": QUESTION, **fields})
    error = json.loads(raw)["error"]
    assert (code, error["param"], error["message"]) == (400, param, message)


def test_the_client_reads_a_refusal_as_its_error(client, tiny_dir):
    with pytest.raises(openai.BadRequestError, match="Previous response with id 'resp_1' not found") as refused:
        client.responses.create(model=str(tiny_dir["llama"]), input=QUESTION, previous_response_id="resp_1")
    assert refused.value.code == "previous_response_not_found"


def test_previous_response_id_continues_the_stored_conversation(cluster, client, tiny_dir):
    model = str(tiny_dir["llama"])
    fields = dict(model=model, max_output_tokens=6, temperature=0)
    first = client.responses.create(input="My name is Ada.", instructions="Be brief.", **fields)
    second = client.responses.create(input="What is my name?", previous_response_id=first.id, **fields)
    chat = client.chat.completions.create(model=model, max_tokens=6, temperature=0, messages=[  # no instructions:
        {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])                            # they are not carried over
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert (first.store, second.store, second.previous_response_id) == (True, True, first.id)
    streamed = list(client.responses.create(input="And again?", previous_response_id=second.id, stream=True,
                                            **fields))
    third = client.responses.retrieve(streamed[-1].response.id)  # a streamed response is stored too
    assert third.output_text == streamed[-1].response.output_text and third.previous_response_id == second.id
    again = client.chat.completions.create(model=model, max_tokens=6, temperature=0, messages=[
        {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}, {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "And again?"}])
    assert third.output_text == again.choices[0].message.content


def test_a_stored_response_is_retrieved_and_deleted_and_store_false_keeps_none(cluster, client, tiny_dir):
    fields = dict(model=str(tiny_dir["llama"]), input=QUESTION, max_output_tokens=4, temperature=0)
    kept = client.responses.create(**fields)
    assert client.responses.retrieve(kept.id).model_dump() == kept.model_dump()
    assert client.responses.delete(kept.id) is None  # the client reads OpenAI's deletion object as nothing
    with pytest.raises(openai.NotFoundError, match=f"No response found with id '{kept.id}'") as missing:
        client.responses.retrieve(kept.id)
    assert missing.value.code == "response_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(kept.id)
    with pytest.raises(openai.BadRequestError, match="not found"):
        client.responses.create(**fields, previous_response_id=kept.id)
    turns = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."},
             {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    talk = client.responses.create(**{**fields, "input": turns})
    items = client.responses.input_items.list(talk.id).data  # OpenAI's default order: the latest first
    assert [(i.role, i.content[0].text) for i in items] == [("user", QUESTION), ("assistant", "Hello."), ("user", "Hi.")]
    assert all(i.type == "message" and i.id.startswith("msg_") and i.status == "completed" for i in items)
    page = client.responses.input_items.list(talk.id, order="asc", limit=2)
    assert [i.id for i in page.data] == [items[2].id, items[1].id] and page.has_more
    assert [i.id for i in client.responses.input_items.list(talk.id, order="asc", after=items[1].id).data] == [
        items[0].id]
    with pytest.raises(openai.BadRequestError, match="limit must be an integer from 1 to 100, got '0'"):
        client.responses.input_items.list(talk.id, limit=0)
    with pytest.raises(openai.BadRequestError, match="order must be 'asc' or 'desc', got 'up'"):
        client.responses.input_items.list(talk.id, extra_query={"order": "up"})
    unkept = client.responses.create(**fields, store=False)
    assert unkept.store is False and unkept.output_text == kept.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)


def test_the_store_keeps_the_last_n_used_and_none_at_zero():
    from specctl.gateway.api import ApiError, ChatMessage
    from specctl.gateway.response_store import ResponseStore, StoredResponse

    def stored(rid):
        return StoredResponse({"id": rid}, (ChatMessage(role="user", content=rid),))

    store = ResponseStore(2)
    for rid in ("a", "b"):
        store.put(stored(rid))
    assert store.history("a")[0].content == "a"  # used: "b" is now the least recently used
    store.put(stored("c"))
    assert (len(store), store.get("b"), store.read("c"), store.remove("a")) == (
        2, None, {"id": "c"}, {"id": "a", "object": "response.deleted", "deleted": True})
    none = ResponseStore(0)
    none.put(stored("a"))
    assert len(none) == 0 and none.history(None) == ()
    with pytest.raises(ApiError, match=r"keeps none \(--responses-store 0\)"):
        none.history("a")
    with pytest.raises(ValueError, match="at least 0"):
        ResponseStore(-1)


def test_function_tools_and_earlier_calls_become_the_chat_request():
    import msgspec

    req = msgspec.convert({
        "input": [{"role": "user", "content": "Weather in Paris and Oslo?"},
                  {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
                  {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
                  {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                  {"type": "function_call_output", "call_id": "call_2", "output": "snow"}],
        "tools": [{"type": "function", **WEATHER["function"]}], "tool_choice": {"type": "function", "name": "get_weather"},
        "parallel_tool_calls": False}, ResponsesRequest)
    chat = as_chat(req)
    assert chat.tools == [WEATHER] and chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.parallel_tool_calls is False
    messages = chat_messages(chat)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool"]  # both calls in one turn
    assert [c["function"]["arguments"] for c in messages[1]["tool_calls"]] == [{"city": "Paris"}, {"city": "Oslo"}]
    assert [(m["tool_call_id"], m["content"]) for m in messages[2:]] == [("call_1", "sunny"), ("call_2", "snow")]


async def test_streamed_items_open_and_close_as_text_and_calls_come():
    events = []

    async def send(kind, **fields):
        events.append((kind, fields))

    text = "Checking.\n" + CALL + "\n" + CALL.replace("Paris", "Oslo")
    items, reader = StreamedItems(send), StreamedCalls()
    for i in range(0, len(text), 4):
        await items.add(*reader.push(text[i:i + 4]))
    rest, deltas, calls = reader.finish()
    await items.add(rest, deltas)
    output = await items.close("completed")
    assert [item["type"] for item in output] == ["message", "function_call", "function_call"]
    assert output[0]["content"][0]["text"] == "Checking.\n" == parse(text)[0]
    assert [(i["call_id"], i["name"], i["arguments"]) for i in output[1:]] == [
        (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]
    kinds = [kind for kind, _ in events]
    assert [k for k in kinds if "delta" not in k] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.done",
        "response.content_part.done", "response.output_item.done"] + [
        "response.output_item.added", "response.function_call_arguments.done", "response.output_item.done"] * 2
    for index, item in enumerate(output[1:], start=1):  # each call's argument deltas join into its arguments
        pieces = [f["delta"] for k, f in events if k == "response.function_call_arguments.delta" and f["output_index"] == index]
        assert "".join(pieces) == item["arguments"] and len(pieces) > 1
    empty = StreamedItems(send)
    assert [i["content"][0]["text"] for i in await empty.close("incomplete")] == [""]  # nothing came: an empty message


def test_a_forced_call_comes_back_as_a_function_call_item_streamed_or_not(tools_cluster):  # noqa: F811
    base = tools_cluster[1]["gateway"]
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    tool = {"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}}
    fields = dict(model=model, input="Weather in Paris?", tools=[tool], max_output_tokens=100, temperature=0,
                  tool_choice={"type": "function", "name": "get_weather"})
    response = client.responses.create(**fields)
    [call] = response.output  # a forced call: no text
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    assert json.loads(call.arguments)["city"] in ("Paris", "Oslo") and call.call_id.startswith("call_")
    assert response.status == "completed"
    events = list(client.responses.create(**fields, stream=True))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(deltas) == done.arguments == call.arguments and len(deltas) > 1
    assert events[-1].type == "response.completed" and events[-1].response.output[0].arguments == call.arguments
    answered = client.responses.create(  # the call's output, continuing the stored response that made the call
        model=model, previous_response_id=response.id, max_output_tokens=8, temperature=0, tools=[tool],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    chat = client.chat.completions.create(model=model, max_tokens=8, temperature=0, tools=[
        {"type": "function", "function": {k: tool[k] for k in ("name", "parameters")}}], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}])
    assert answered.usage.input_tokens == chat.usage.prompt_tokens
    assert answered.output_text == (chat.choices[0].message.content or "")
