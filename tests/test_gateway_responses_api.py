"""OpenAI's Responses API on the gateway (gateway.responses_api), driven by the official openai
client: a response is the chat completion of the same messages, whole or streamed as the
Responses events; structured text.format; what is not served refused by name."""

import json

import openai
import pytest

from tests.test_gateway import post

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


def test_text_format_json_schema_holds_the_output_to_it(cluster, client, tiny_dir):
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "blue"]}}, "required": ["colour"],
              "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
    response = client.responses.create(model=str(tiny_dir["llama"]), input=QUESTION, max_output_tokens=40,
                                       text={"format": {"type": "json_schema", "name": "colour", "schema": schema}})
    assert response.status == "completed" and json.loads(response.output_text)["colour"] in ("red", "blue")
    assert response.text.format.type == "json_schema"


@pytest.mark.parametrize("fields, param, message", [
    ({"previous_response_id": "resp_1"}, "previous_response_id",
     "previous_response_id needs stored responses, which this gateway does not keep: send the whole conversation in "
     "input"),
    ({"background": True}, "background", "background responses are not served: leave background false"),
    ({"tools": [{"type": "function", "name": "f"}]}, "tools",
     "tools on /v1/responses are not served: use /v1/chat/completions for tool calls"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
     "input[0] holds a part that is not text: only input_text and output_text are served"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input",
     "input[0] must be a message of role user, system, developer, assistant; got type 'function_call_output', "
     "role None"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format",
     "text.format type must be 'text', 'json_object' or 'json_schema', got 'grammar'"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens must be at least 1, got 0"),
])
def test_what_is_not_served_is_refused_by_name(cluster, fields, param, message):
    code, _, raw = post(cluster[1]["gateway"] + "/v1/responses", {"input": QUESTION, **fields})
    error = json.loads(raw)["error"]
    assert (code, error["param"], error["message"]) == (400, param, message)


def test_the_client_reads_a_refusal_as_its_error(client, tiny_dir):
    with pytest.raises(openai.BadRequestError, match="previous_response_id needs stored responses"):
        client.responses.create(model=str(tiny_dir["llama"]), input=QUESTION, previous_response_id="resp_1")
