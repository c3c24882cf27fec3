"""vLLM's reasoning parsers (gateway.reasoning, `--reasoning-parser`): a chat answer's thinking
apart from its content, whole or streamed (the pieces join into the whole answer's fields), tool
calls read from the content alone, include_reasoning and Qwen3's enable_thinking."""

import json
import urllib.request

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specctl.cluster.embedded import ClusterConfig, ClusterThread
from specctl.config import build_config
from specctl.gateway.reasoning import StreamedReasoning, check_parser, split_reasoning, thinks
from tests.test_gateway import post
from tests.test_gateway_tools import TEMPLATE, WEATHER


@pytest.mark.parametrize("text, thinking, expected", [
    ("<think>\nplan\n</think>\n\nanswer", True, ("\nplan\n", "\n\nanswer")),  # Qwen3 (2504) writes its <think>
    ("plan</think>answer", True, ("plan", "answer")),  # R1 / Qwen3.5: the template opened it in the prompt
    ("  <think>plan", True, ("plan", None)),  # cut by max_tokens: all thinking
    ("plan", True, ("plan", None)),
    ("<think></think>", True, ("", None)),
    ("", True, ("", None)),
    ("a <think> b</think>c", True, ("a <think> b", "c")),  # only a leading <think> opens
    ("plan</think>x</think>y", True, ("plan", "x</think>y")),  # the first </think> ends it
    ("<think>plan</think>answer", False, (None, "<think>plan</think>answer")),  # thinking off: all answer
])
def test_a_whole_output_splits_at_the_first_end_tag(text, thinking, expected):
    assert split_reasoning(text, thinking) == expected


def test_which_outputs_start_in_thought_and_the_parser_names():
    assert thinks("qwen3", None) and thinks("qwen3", {"enable_thinking": True}) and thinks("qwen3", {"other": 1})
    assert not thinks("qwen3", {"enable_thinking": False})
    assert thinks("deepseek_r1", {"enable_thinking": False})  # R1's template always opens a <think>
    # a continued final message: in thought only where its text left one open
    assert not thinks("qwen3", None, "The answer is") and not thinks("deepseek_r1", None, "")
    assert thinks("qwen3", {"enable_thinking": False}, "<think>hm") and thinks("qwen3", None, "<think>a</think><think>b")
    assert not thinks("deepseek_r1", None, "<think>a</think> b")
    check_parser(None)
    check_parser("qwen3")
    with pytest.raises(ValueError, match=r"^--reasoning-parser must be one of qwen3, deepseek_r1, openai_gptoss, got 'hermes'$"):
        check_parser("hermes")


PIECES = ["<think>", "</think>", "<", "</", "</th", "think>", ">", "/", " ", "\n", "a", "b", "<tool_call>"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=12), st.lists(st.integers(0, 40), max_size=6), st.booleans())
def test_streamed_pieces_join_into_the_whole_answers_fields(pieces, cuts, thinking):
    text = "".join(pieces)
    bounds = sorted({min(c, len(text)) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)])]
    parser, reasoning, content = StreamedReasoning(thinking), [], []
    for chunk in chunks:
        thought, answer = parser.push(chunk)
        reasoning.append(thought)
        content.append(answer)
    reasoning.append(parser.finish())
    whole_reasoning, whole_content = split_reasoning(text, thinking)
    assert "".join(reasoning) == (whole_reasoning or "") and "".join(content) == (whole_content or "")


def test_an_end_tag_split_over_pieces_is_held_until_known():
    parser = StreamedReasoning(True)
    assert parser.push("<thi") == ("", "")
    assert parser.push("nk>plan</th") == ("plan", "")
    assert parser.push("ink>ans") == ("", "ans")
    assert parser.push("wer</think>") == ("", "wer</think>")  # in the answer every tag is text
    assert parser.finish() == ""
    parser = StreamedReasoning(True)
    assert parser.push("plan </") == ("plan ", "") and parser.push("b") == ("</b", "")


# The scripted model's lines: its next token is a function of its last one (layers that add
# nothing, one-hot embeddings, an LM head that maps each token to its successor), so over the
# real gateway it writes exactly these tokens. <think> and </think> are tokens of their own, as
# in Qwen3's vocabulary; in the second line the end tag is text split over two tokens.
THOUGHT_TOKENS = ["<think>", "\nplan it", "</think>", "\n\nthe answer"]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
CALL_TOKENS = ["look it up", "</", "think>" + CALL]  # the second line: chosen when the first is barred
JSON_CALL_TOKENS = ['{"name": "get_weather", ', '"parameters": {"city": "Oslo"}}']  # the third: both barred
PYTHONIC_CALL_TOKENS = ["[get_weather(", 'city="Oslo")]']  # the fourth: the first three barred
# the fifth, the first four barred: content, then Mistral's call after its [TOOL_CALLS], a special token
MISTRAL_CALL_TOKENS = ["Checking. ", "[TOOL_CALLS]", 'get_weather[ARGS]{"city": "Oslo"}']
# the sixth and seventh, the first five (six) barred: gpt-oss's harmony messages, <|channel|> and <|end|>
# special tokens as in its vocabulary — a thought, then the answer; a thought, then a call (<|call|>: EOS)
HARMONY_TOKENS = ["<|channel|>", "analysis<|message|>", "Weather asked.", "<|end|>",
                  "<|start|>assistant<|channel|>final<|message|>", "Sunny in Oslo."]
HARMONY_CALL_TOKENS = ["<|channel|>analysis<|message|>Call the tool.<|end|>",
                       "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>",
                       '{"city": "Oslo"}']
THOUGHT_TEXT = "".join(THOUGHT_TOKENS)


def scripted_model(directory):
    """A tiny Llama whose greedy output after the chat prompt is THOUGHT_TOKENS then EOS, or,
    with the first of them barred (logit_bias -100), CALL_TOKENS then EOS; with the first of
    both barred, JSON_CALL_TOKENS then EOS; with the first of all three barred, PYTHONIC_CALL_TOKENS;
    with the first of all four barred, MISTRAL_CALL_TOKENS (its tag a special token, as Mistral's);
    then HARMONY_TOKENS and HARMONY_CALL_TOKENS, each with the first of all before it barred."""
    from transformers import AddedToken, AutoModelForCausalLM

    from specctl.engine.tiny import make_byte_tokenizer, tiny_config

    tokenizer = make_byte_tokenizer()
    tokenizer.add_tokens(THOUGHT_TOKENS + CALL_TOKENS + JSON_CALL_TOKENS + PYTHONIC_CALL_TOKENS
                         + [MISTRAL_CALL_TOKENS[0], MISTRAL_CALL_TOKENS[2]]
                         + [HARMONY_TOKENS[i] for i in (1, 2, 4, 5)] + HARMONY_CALL_TOKENS)
    tokenizer.add_tokens([AddedToken(token, special=True)
                          for token in (MISTRAL_CALL_TOKENS[1], HARMONY_TOKENS[0], HARMONY_TOKENS[3])])
    tokenizer.chat_template = TEMPLATE
    config = tiny_config("llama", vocab_size=len(tokenizer), tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config)
    line = [tokenizer.encode("\n")[0], *tokenizer.convert_tokens_to_ids(THOUGHT_TOKENS), config.eos_token_id]
    other = [line[0], *tokenizer.convert_tokens_to_ids(CALL_TOKENS), config.eos_token_id]
    third = [line[0], *tokenizer.convert_tokens_to_ids(JSON_CALL_TOKENS), config.eos_token_id]
    fourth = [line[0], *tokenizer.convert_tokens_to_ids(PYTHONIC_CALL_TOKENS), config.eos_token_id]
    fifth = [line[0], *tokenizer.convert_tokens_to_ids(MISTRAL_CALL_TOKENS), config.eos_token_id]
    sixth = [line[0], *tokenizer.convert_tokens_to_ids(HARMONY_TOKENS), config.eos_token_id]
    seventh = [line[0], *tokenizer.convert_tokens_to_ids(HARMONY_CALL_TOKENS), config.eos_token_id]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = model.lm_head.weight
        head.zero_()
        lines = (line, other, third, fourth, fifth, sixth, seventh)
        for basis, token in enumerate(sorted({token for tokens in lines for token in tokens[:-1]})):
            model.model.embed_tokens.weight[token] = torch.nn.functional.one_hot(torch.tensor(basis), 64).float()
        embed = model.model.embed_tokens.weight
        for tokens, strength in zip(lines, (1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625)):
            for before, after in zip(tokens, tokens[1:]):
                head[after] += strength * embed[before]
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def scripted_cluster(tmp_path_factory, name: str, **options):
    """The scripted model behind one target instance and a gateway with ``options``
    (ClusterConfig's): yields (thread, urls, the model's folder)."""
    model = scripted_model(tmp_path_factory.mktemp(name) / "scripted")
    config = build_config(None, target=str(model), draft=f"{model}@2", mode="chain", depth=3, dtype="fp32",
                          draft_quant="none", max_sessions=4)
    thread = ClusterThread(config, ClusterConfig(targets=1, gateway_port=0, **options))
    urls = thread.start()
    yield thread, urls, model
    thread.stop()


@pytest.fixture(scope="module")
def reasoning_cluster(tmp_path_factory):
    """The scripted model (its template renders tools) behind a gateway with --reasoning-parser qwen3."""
    yield from scripted_cluster(tmp_path_factory, "reasoning-model", reasoning_parser="qwen3")


def _chat(base: str, body: dict) -> dict:
    code, _, raw = post(base + "/v1/chat/completions", body)
    assert code == 200, raw
    return json.loads(raw)


def _streamed(base: str, body: dict) -> list[dict]:
    request = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return [json.loads(line[6:])["choices"][0] for line in response if line.startswith(b"data: {")]


def _joined(chunks: list[dict], field: str) -> str:
    return "".join(c["delta"].get(field) or "" for c in chunks)


THOUGHT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "temperature": 0}


def test_the_scripted_model_writes_its_line(reasoning_cluster):
    code, _, raw = post(reasoning_cluster[1]["gateway"] + "/v1/completions",
                        {"prompt": "x\n", "max_tokens": 40, "temperature": 0})  # completions are not parsed
    assert code == 200 and json.loads(raw)["choices"][0]["text"] == THOUGHT_TEXT
    assert json.loads(raw)["choices"][0]["finish_reason"] == "stop"


def test_thinking_comes_apart_from_the_answer_whole_and_streamed(reasoning_cluster):
    base = reasoning_cluster[1]["gateway"]
    message = _chat(base, THOUGHT)["choices"][0]["message"]
    assert message["reasoning"] == message["reasoning_content"] == "\nplan it"
    assert message["content"] == "\n\nthe answer"
    chunks = _streamed(base, THOUGHT)
    assert _joined(chunks, "reasoning") == _joined(chunks, "reasoning_content") == "\nplan it"
    assert _joined(chunks, "content") == "\n\nthe answer"
    assert not any(c["delta"].get("reasoning") and c["delta"].get("content") for c in chunks)  # one kind a chunk
    assert chunks[-1]["finish_reason"] == "stop"
    # logprobs still cover every token, the thinking's included
    with_logprobs = _chat(base, {**THOUGHT, "logprobs": True})["choices"][0]["logprobs"]["content"]
    assert [entry["token"] for entry in with_logprobs] == THOUGHT_TOKENS
    streamed = [c["logprobs"]["content"] for c in _streamed(base, {**THOUGHT, "logprobs": True}) if c.get("logprobs")]
    assert [entry["token"] for part in streamed for entry in part] == THOUGHT_TOKENS


def test_include_reasoning_false_leaves_the_thinking_out_and_thinking_off_keeps_all_as_content(reasoning_cluster):
    base = reasoning_cluster[1]["gateway"]
    message = _chat(base, {**THOUGHT, "include_reasoning": False})["choices"][0]["message"]
    assert message["reasoning"] is None and message["content"] == "\n\nthe answer"
    chunks = _streamed(base, {**THOUGHT, "include_reasoning": False})
    assert _joined(chunks, "reasoning") == "" and _joined(chunks, "content") == "\n\nthe answer"
    off = {**THOUGHT, "chat_template_kwargs": {"enable_thinking": False}}
    message = _chat(base, off)["choices"][0]["message"]
    assert message["reasoning"] is None and message["content"] == THOUGHT_TEXT
    assert _joined(_streamed(base, off), "content") == message["content"]


def test_reasoning_effort_is_the_template_s_variable_and_none_turns_thinking_off():
    """OpenAI's reasoning_effort as vLLM passes it: the template's ``reasoning_effort``; ``none``
    also sets Qwen3's enable_thinking false — unless chat_template_kwargs sets it."""
    from specctl.gateway.api import ApiError, ChatCompletionRequest
    from specctl.gateway.translate import chat_template_options, template_variables

    def asked(**fields) -> dict:
        return template_variables(ChatCompletionRequest(messages=[], **fields))

    assert asked() == {} and asked(chat_template_kwargs={"x": 1}) == {"x": 1}
    assert asked(reasoning_effort="low") == {"reasoning_effort": "low"}
    assert asked(reasoning_effort="none") == {"reasoning_effort": "none", "enable_thinking": False}
    assert asked(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}) == {
        "reasoning_effort": "none", "enable_thinking": True}
    assert chat_template_options(ChatCompletionRequest(messages=[], reasoning_effort="high")) == {
        "reasoning_effort": "high", "add_generation_prompt": True, "continue_final_message": False}
    with pytest.raises(ApiError, match="^reasoning_effort must be one of none, minimal, low, medium, high, xhigh, "
                                       "got 'max'$") as refused:
        asked(reasoning_effort="max")
    assert (refused.value.status, refused.value.param) == (400, "reasoning_effort")


def test_reasoning_effort_none_answers_without_thinking_in_chat_and_responses(reasoning_cluster):
    """Through the gateway: effort none keeps the whole output as the answer (as enable_thinking
    false), another effort thinks as by default; the Responses API's reasoning.effort the same,
    echoed in the response; an unknown reasoning option is a 400."""
    import openai

    base = reasoning_cluster[1]["gateway"]
    message = _chat(base, {**THOUGHT, "reasoning_effort": "none"})["choices"][0]["message"]
    assert message["reasoning"] is None and message["content"] == THOUGHT_TEXT
    message = _chat(base, {**THOUGHT, "reasoning_effort": "low"})["choices"][0]["message"]
    assert message["reasoning"] == "\nplan it" and message["content"] == "\n\nthe answer"
    code, _, raw = post(base + "/v1/chat/completions", {**THOUGHT, "reasoning_effort": "max"})
    assert code == 400 and json.loads(raw)["error"]["param"] == "reasoning_effort"
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    plain = client.responses.create(model=model, input="hi", max_output_tokens=40, temperature=0,
                                    reasoning={"effort": "none"})
    assert [item.type for item in plain.output] == ["message"] and plain.output_text == THOUGHT_TEXT
    assert plain.reasoning.effort == "none"
    thought = client.responses.create(model=model, input="hi", max_output_tokens=40, temperature=0,
                                      reasoning={"effort": "medium", "summary": "auto"})
    assert [item.type for item in thought.output] == ["reasoning", "message"]
    assert (thought.reasoning.effort, thought.reasoning.summary) == ("medium", "auto")
    code, _, raw = post(base + "/v1/responses", {"input": "hi", "reasoning": {"effort": "low", "budget": 9}})
    assert code == 400 and "budget" in json.loads(raw)["error"]["message"]


def test_a_cut_thought_is_all_reasoning_its_held_tail_included(reasoning_cluster):
    from transformers import AutoTokenizer

    base = reasoning_cluster[1]["gateway"]
    barred = AutoTokenizer.from_pretrained(reasoning_cluster[2]).convert_tokens_to_ids(THOUGHT_TOKENS[0])
    body = {**THOUGHT, "max_tokens": 2, "logit_bias": {str(barred): -100}}  # the second line, cut inside "</think>"
    cut = _chat(base, body)["choices"][0]
    assert cut["finish_reason"] == "length"
    assert cut["message"]["reasoning"] == "look it up</" and cut["message"]["content"] is None
    chunks = _streamed(base, body)  # the "</" held back, then handed out as thinking when the choice ends
    assert _joined(chunks, "reasoning") == "look it up</" and chunks[-1]["finish_reason"] == "length"


def test_tool_calls_are_read_from_the_answer_after_the_thinking(reasoning_cluster):
    base = reasoning_cluster[1]["gateway"]
    from transformers import AutoTokenizer

    barred = AutoTokenizer.from_pretrained(reasoning_cluster[2]).convert_tokens_to_ids(THOUGHT_TOKENS[0])
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER], "max_tokens": 40,
            "temperature": 0, "logit_bias": {str(barred): -100}}
    choice = _chat(base, body)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning"] == "look it up"
    assert choice["message"]["content"] is None
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    chunks = _streamed(base, body)
    assert _joined(chunks, "reasoning") == "look it up" and _joined(chunks, "content") == ""
    calls = [call for c in chunks for call in c["delta"].get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "get_weather"
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Oslo"}'
    assert chunks[-1]["finish_reason"] == "tool_calls"


def test_structured_output_starts_after_the_thinking(reasoning_cluster):
    """The grammar holds the answer, not the thinking: the scripted thought goes through and its
    answer is held to the regex; with thinking off the regex holds the output from its start."""
    base = reasoning_cluster[1]["gateway"]
    message = _chat(base, {**THOUGHT, "guided_regex": "\\s*the answer"})["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == ("\nplan it", "\n\nthe answer")
    held = _chat(base, {**THOUGHT, "guided_regex": "[a-z]+"})["choices"][0]["message"]
    assert held["reasoning"] == "\nplan it" and held["content"].strip().isalpha()  # not the scripted answer
    off = _chat(base, {**THOUGHT, "guided_regex": "[a-z]+", "chat_template_kwargs": {"enable_thinking": False}})
    assert off["choices"][0]["message"]["content"].isalpha()


def test_a_gateway_without_a_parser_answers_as_before_and_a_bad_parser_is_refused(cluster):
    code, _, raw = post(cluster[1]["gateway"] + "/v1/chat/completions",
                        {**THOUGHT, "guided_regex": "<think>ab</think>cd"})
    message = json.loads(raw)["choices"][0]["message"]
    assert code == 200 and "reasoning" not in message and message["content"] == "<think>ab</think>cd"
    with pytest.raises(ValueError, match=r"^--reasoning-parser must be one of qwen3, deepseek_r1, openai_gptoss, got 'r1'$"):
        ClusterConfig(reasoning_parser="r1")


async def test_streamed_response_items_put_the_thinking_first_and_close_it_when_the_answer_begins():
    from specctl.gateway.responses_reply import StreamedItems
    from specctl.gateway.tool_calls import StreamedCalls
    from tests.test_gateway_tools import CALL

    events = []

    async def send(kind, **fields):
        events.append((kind, fields))

    text = "<think>plan it</think>Checking.\n" + CALL
    items, thoughts, reader = StreamedItems(send), StreamedReasoning(True), StreamedCalls()
    for i in range(0, len(text), 3):
        thought, answer = thoughts.push(text[i:i + 3])
        await items.think(thought)
        await items.add(*reader.push(answer))
    await items.think(thoughts.finish())
    rest, deltas, _ = reader.finish()
    await items.add(rest, deltas)
    output = await items.close("completed")
    assert [(item["type"], item["status"]) for item in output] == [
        ("reasoning", "completed"), ("message", "completed"), ("function_call", "completed")]
    assert output[0]["content"] == [{"type": "reasoning_text", "text": "plan it"}] and output[0]["summary"] == []
    assert output[1]["content"][0]["text"] == "Checking.\n"
    kinds = [kind for kind, _ in events]
    assert kinds[:1] == ["response.output_item.added"] and events[0][1]["item"]["type"] == "reasoning"
    first_done = kinds.index("response.reasoning_text.done")
    assert set(kinds[1:first_done]) == {"response.reasoning_text.delta"}
    assert "".join(f["delta"] for k, f in events if k == "response.reasoning_text.delta") == "plan it"
    assert kinds[first_done + 1] == "response.output_item.done" and events[first_done + 1][1]["output_index"] == 0
    assert events[first_done + 2][1]["output_index"] == 1  # the message comes next
    cut, events[:] = StreamedItems(send), []  # thinking cut by max_output_tokens: no empty message after it
    await cut.think("half a th")
    assert [(i["type"], i["status"]) for i in await cut.close("incomplete")] == [("reasoning", "incomplete")]


def test_a_response_s_thinking_is_its_reasoning_item_before_the_message(reasoning_cluster):
    """The Responses API over the same parser: a reasoning item, then the message; cut while
    thinking, the reasoning item alone (incomplete)."""
    import openai
    from transformers import AutoTokenizer

    base = reasoning_cluster[1]["gateway"]
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    response = client.responses.create(model=model, input="hi", max_output_tokens=40, temperature=0)
    thought, answer = response.output
    assert (thought.type, thought.status, answer.type, response.status) == ("reasoning", "completed", "message",
                                                                             "completed")
    assert thought.content[0].text == "\nplan it" and response.output_text == "\n\nthe answer"
    tokenizer = AutoTokenizer.from_pretrained(reasoning_cluster[2])
    assert response.usage.output_tokens_details.reasoning_tokens == len(tokenizer.encode("\nplan it")) == 1
    events = list(client.responses.create(model=model, input="hi", max_output_tokens=40, temperature=0, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    done = kinds.index("response.reasoning_text.done")
    assert kinds[done + 1:done + 3] == ["response.output_item.done", "response.output_item.added"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "\nplan it"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "\n\nthe answer"
    assert events[-1].type == "response.completed"
    assert events[-1].response.model_dump()["output"] == [
        {**item, "id": streamed["id"]} for item, streamed in zip(response.model_dump()["output"],
                                                                 events[-1].response.model_dump()["output"])]
    cut = client.responses.create(model=model, input="hi", max_output_tokens=2, temperature=0)
    [item] = cut.output
    assert (item.type, item.status, cut.status, item.content[0].text) == ("reasoning", "incomplete", "incomplete",
                                                                         "\nplan it")
    # its output sent back as input: the reasoning item is the assistant's turn, its text left out
    again = client.responses.create(model=model, max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": "hi"}, *[i.model_dump(exclude_none=True) for i in cut.output],
        {"role": "user", "content": "and?"}])
    plain = client.responses.create(model=model, max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}, {"role": "user", "content": "and?"}])
    assert again.usage.input_tokens == plain.usage.input_tokens


def test_an_anthropic_message_s_thinking_is_its_thinking_block_before_the_text(reasoning_cluster):
    """Anthropic's Messages API over the same parser: a thinking block, then the text, whole and
    streamed (thinking_delta, then text_delta); display "omitted" sends the block without its text."""
    import anthropic

    base = reasoning_cluster[1]["gateway"]
    client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    model = json.loads(urllib.request.urlopen(base + "/v1/models", timeout=30).read())["data"][0]["id"]
    asked = {"model": model, "max_tokens": 40, "messages": [{"role": "user", "content": "hi"}],
             "extra_body": {"temperature": 0}}
    message = client.messages.create(**asked)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == [
        ("thinking", "\nplan it"), ("text", "\n\nthe answer")]
    assert message.stop_reason == "end_turn"
    with client.messages.stream(**asked) as stream:
        events = list(stream)
    deltas = [(e.index, e.delta.type) for e in events if e.type == "content_block_delta"]
    assert sorted(set(deltas)) == [(0, "thinking_delta"), (1, "text_delta")] and deltas == sorted(deltas)
    assert "".join(e.delta.thinking for e in events if e.type == "content_block_delta"
                   and e.delta.type == "thinking_delta") == "\nplan it"
    hidden = client.messages.create(**asked, thinking={"type": "adaptive", "display": "omitted"})
    assert [(b.type, getattr(b, "thinking", None)) for b in hidden.content][0] == ("thinking", "")


def test_a_thinking_budget_ends_the_thought_at_its_token_count(reasoning_cluster):
    """vLLM's thinking_token_budget: the scripted model's thought is "<think>", "\nplan it",
    "</think>"; budget 0 forces </think> right after its <think>, 1 leaves it as written. Anthropic's
    thinking.budget_tokens is the same budget."""
    import anthropic

    base = reasoning_cluster[1]["gateway"]
    cut = _chat(base, {**THOUGHT, "thinking_token_budget": 0})["choices"][0]["message"]
    assert (cut["reasoning"], cut["content"]) == ("", "\n\nthe answer")
    chunks = _streamed(base, {**THOUGHT, "thinking_token_budget": 0})
    assert (_joined(chunks, "reasoning"), _joined(chunks, "content")) == ("", "\n\nthe answer")
    kept = _chat(base, {**THOUGHT, "thinking_token_budget": 1})["choices"][0]["message"]
    assert (kept["reasoning"], kept["content"]) == ("\nplan it", "\n\nthe answer")
    code, _, raw = post(base + "/v1/completions", {"prompt": "x\n", "max_tokens": 40, "temperature": 0,
                                                   "thinking_token_budget": 0})  # a raw completion's too
    assert code == 200 and json.loads(raw)["choices"][0]["text"] == "<think></think>\n\nthe answer"
    code, _, raw = post(base + "/v1/chat/completions", {**THOUGHT, "thinking_token_budget": -1})
    assert code == 400 and json.loads(raw)["error"]["message"] == "thinking_token_budget must be >= 0, got -1"
    client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    message = client.messages.create(model="", max_tokens=40, messages=[{"role": "user", "content": "hi"}],
                                     thinking={"type": "enabled", "budget_tokens": 0}, extra_body={"temperature": 0})
    assert [(b.type, b.text) for b in message.content] == [("text", "\n\nthe answer")]  # no thought left to show


def test_a_thinking_budget_needs_a_parser_that_knows_where_a_thought_ends(tiny_dir):
    from specctl.gateway.reasoning import marker_ids, thinking_budget
    from specctl.engine.tiny import make_byte_tokenizer

    tokenizer = make_byte_tokenizer()
    assert thinking_budget(None, None, tokenizer) is None
    with pytest.raises(ValueError, match=r"^thinking_token_budget needs to know where a thought ends: start the gateway "
                                         r"with --reasoning-parser qwen3 or deepseek_r1$"):
        thinking_budget(5, "openai_gptoss", tokenizer)
    assert thinking_budget(5, None, tokenizer, required=False) is None  # Anthropic's budget_tokens: accepted
    text = tuple(tokenizer.encode("</think>", add_special_tokens=False))  # no token of its own: its text's
    assert thinking_budget(5, "qwen3", tokenizer) == (5, (marker_ids(tokenizer, "<think>"), text)) and len(text) > 1
    tokenizer.add_tokens(["</think>"])
    assert marker_ids(tokenizer, "</think>") == (tokenizer.convert_tokens_to_ids("</think>"),)


@pytest.mark.parametrize("items, turns", [
    ([("user", "hi"), "reasoning", ("assistant", "yes"), ("user", "and?")], [("user", "hi"), ("assistant", "yes"),
                                                                           ("user", "and?")]),
    ([("user", "hi"), "reasoning", "reasoning", ("user", "and?")], [("user", "hi"), ("assistant", ""),
                                                                    ("user", "and?")]),
    ([("user", "hi"), "reasoning", "call", "call"], [("user", "hi"), ("assistant", None)]),
    ([("user", "hi"), "reasoning", ("user", "and?")], [("user", "hi"), ("assistant", ""), ("user", "and?")]),
])
def test_a_reasoning_item_sent_back_is_the_assistant_turn_it_began(items, turns):
    import msgspec

    from specctl.gateway.responses_api import ResponsesRequest, as_chat

    def item(spec):
        if spec == "reasoning":
            return {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]}
        if spec == "call":
            return {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
        return {"role": spec[0], "content": spec[1]}

    request = msgspec.convert({"input": [item(spec) for spec in items]}, ResponsesRequest)
    messages = as_chat(request).messages
    assert [(m.role, m.content) for m in messages] == turns
    if "call" in items:
        assert len(messages[-1].tool_calls) == 2  # both calls in the one turn


async def test_chat_shows_the_thinking_apart_and_keeps_it_out_of_the_reply(reasoning_cluster):
    from specctl.chat.commands import ChatState
    from specctl.chat.repl import stream_reply

    base = reasoning_cluster[1]["gateway"]
    state = ChatState(max_tokens=40)
    state.messages.append({"role": "user", "content": "hi"})
    texts, thoughts = [], []
    text, usage, _ = await stream_reply(base, state, texts.append, None, thoughts.append)
    assert "".join(thoughts) == "\nplan it" and text == "".join(texts) == "\n\nthe answer"
    assert usage["completion_tokens"] == len(THOUGHT_TOKENS)


@pytest.mark.parametrize("command", [["chat"], ["up"], ["gateway", "--target", "127.0.0.1:1"]])
def test_a_bad_reasoning_parser_is_one_line_before_anything_starts(command):
    from tests.conftest import run_here
    from tests.test_cli import _assert_one_line_error

    _assert_one_line_error(run_here(*command, "--reasoning-parser", "r1"),
                           "--reasoning-parser must be one of qwen3, deepseek_r1, openai_gptoss, got 'r1'")
