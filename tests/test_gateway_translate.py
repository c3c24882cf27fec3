"""gateway.translate through the gateway: vLLM's chat-template fields (add_generation_prompt,
continue_final_message and chat_template_kwargs on /v1/chat/completions and /tokenize) and its
truncate_prompt_tokens, and what is refused by name."""

import json

import msgspec
import pytest

from specctl.engine.loader import load_model
from specctl.gateway.api import ApiError, ChatCompletionRequest
from specctl.gateway.translate import bad_words, chat_messages, chat_template_options, truncated
from tests.test_gateway import post

MESSAGES = [{"role": "user", "content": "Write a word."}, {"role": "assistant", "content": "Sure: hel"}]


def test_the_options_become_the_templates_arguments():
    req = ChatCompletionRequest(messages=[], add_generation_prompt=False, continue_final_message=True,
                                chat_template_kwargs={"enable_thinking": False})
    assert chat_template_options(req) == {"enable_thinking": False, "add_generation_prompt": False,
                                          "continue_final_message": True}
    assert chat_template_options(ChatCompletionRequest(messages=[])) == {"add_generation_prompt": True,
                                                                         "continue_final_message": False}
    with pytest.raises(ApiError, match="cannot go with add_generation_prompt"):
        chat_template_options(ChatCompletionRequest(messages=[], continue_final_message=True))
    for key in ("tools", "add_generation_prompt", "tokenize", "not a name"):
        with pytest.raises(ApiError, match=f"^chat_template_kwargs cannot set {key!r}"):
            chat_template_options(ChatCompletionRequest(messages=[], chat_template_kwargs={key: 1}))


def test_a_final_message_continued_is_the_prompt_tokenize_shows_and_the_reply_continues_it(cluster, tiny_dir):
    base = cluster[1]["gateway"]
    tokenizer = load_model("tiny", tiny_dir["llama"], "fp32").tokenizer
    fields = {"add_generation_prompt": False, "continue_final_message": True}
    code, _, raw = post(base + "/tokenize", {"messages": MESSAGES, **fields})
    assert code == 200, raw
    continued = json.loads(raw)["tokens"]
    assert tokenizer.decode(continued).endswith("Sure: hel")  # left open: no end of turn, no new turn
    new_turn = json.loads(post(base + "/tokenize", {"messages": MESSAGES})[2])["tokens"]
    assert len(new_turn) > len(continued) and new_turn[:len(continued)] == continued
    body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0, **fields,
            "chat_template_kwargs": {"enable_thinking": False}}  # a variable this template ignores
    code, _, raw = post(base + "/v1/chat/completions", body)
    assert code == 200, raw
    answer = json.loads(raw)
    assert answer["usage"]["prompt_tokens"] == len(continued)
    completion = json.loads(post(base + "/v1/completions", {"prompt": continued, "max_tokens": 4, "temperature": 0})[2])
    assert answer["choices"][0]["message"]["content"] == completion["choices"][0]["text"]  # the same prompt, continued


@pytest.mark.parametrize("route, fields, param, message", [
    ("/v1/chat/completions", {"continue_final_message": True}, "continue_final_message",
     "continue_final_message leaves the last message open for the model to continue; it cannot go with "
     "add_generation_prompt, which starts a new one: set that to false"),
    ("/tokenize", {"continue_final_message": True}, "continue_final_message", "cannot go with add_generation_prompt"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs",
     "chat_template_kwargs cannot set 'messages': the gateway sets it (or it is no template variable); use the "
     "request's own field"),
    ("/v1/chat/completions", {"max_completion_tokens": 0, "max_tokens": 5}, "max_completion_tokens",
     "max_completion_tokens must be at least 1, got 0"),  # it was read as unset: max_tokens counted
    ("/v1/chat/completions", {"chat_template_kwargs": ["x"]}, None,
     "invalid request: Expected `object | null`, got `array` - at `$.chat_template_kwargs`"),
])
def test_what_the_template_cannot_take_is_refused_by_name(cluster, route, fields, param, message):
    code, _, raw = post(cluster[1]["gateway"] + route, {"messages": MESSAGES, **fields})
    error = json.loads(raw)["error"]
    assert code == 400 and message in error["message"] and (param is None or error["param"] == param)


def test_truncate_prompt_tokens_keeps_the_last_tokens_and_counts_what_it_kept(cluster):
    base = cluster[1]["gateway"]
    assert truncated([[1, 2, 3], [4]], 2, 8) == [[2, 3], [4]] and truncated([[1, 2, 3]], -1, 2) == [[2, 3]]
    assert truncated([[1, 2, 3]], None, 2) == [[1, 2, 3]]
    prompt = list(range(40, 80))
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": True}
    cut = json.loads(post(base + "/v1/completions", {**body, "truncate_prompt_tokens": 10})[2])
    tail = json.loads(post(base + "/v1/completions", {**body, "prompt": prompt[-10:]})[2])
    assert cut["usage"]["prompt_tokens"] == 10 and cut["choices"][0]["text"] == tail["choices"][0]["text"]
    whole = json.loads(post(base + "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})[2])
    chat = json.loads(post(base + "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2,
                                                           "truncate_prompt_tokens": 5})[2])
    assert chat["usage"]["prompt_tokens"] == 5 < whole["usage"]["prompt_tokens"]
    for keep, message in ((0, "truncate_prompt_tokens must be at least 1 (or -1: as many as the context holds), "
                              "got 0"),
                          (513, "truncate_prompt_tokens value (513) is greater than max_model_len (512). Please, "
                                "select a smaller truncation size.")):
        code, _, raw = post(base + "/v1/completions", {**body, "truncate_prompt_tokens": keep})
        assert code == 400 and json.loads(raw)["error"]["message"] == message


def test_bad_words_are_barred_as_vllm_encodes_them_and_the_text_is_the_target_alones(cluster, tiny_dir):
    from specctl.spec.params import SamplingParams
    from specctl.spec.rounds import generate

    model = load_model("tiny", tiny_dir["llama"], "fp32")
    tok = model.tokenizer
    prompt = list(range(40, 60))
    free = generate(model.decoder, prompt, SamplingParams(max_tokens=24, ignore_eos=True))[0]
    # a pair of the free text's tokens that is a word of its own (it encodes back to that pair)
    word = next(tok.decode(free[i:i + 2]) for i in range(len(free) - 1)
                if tok.encode(tok.decode(free[i:i + 2]).lstrip(), add_special_tokens=False) == free[i:i + 2])
    barred = bad_words([word], tok)
    assert barred[0] == tuple(tok.encode(word.lstrip(), add_special_tokens=False))
    with pytest.raises(ApiError, match="bad_words must not hold an empty word"):
        bad_words([" "], tok)
    reference = generate(model.decoder, prompt, SamplingParams(max_tokens=24, ignore_eos=True, bad_words=barred))[0]
    assert reference != free
    code, _, raw = post(cluster[1]["gateway"] + "/v1/completions", {
        "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "bad_words": [word]})
    assert code == 200, raw
    text = json.loads(raw)["choices"][0]["text"]
    # special tokens (the tiny vocabulary's FIM tokens) are left out of the text, as vLLM leaves them
    assert text == tok.decode(reference, skip_special_tokens=True) and word.lstrip() not in text


@pytest.mark.parametrize("field, value, message", [
    ("use_beam_search", True, "beam search is not served: speculative decoding gives the target's own greedy or "
                              "sampled text (n choices sample n texts)"),
    ("prompt_embeds", "AAAA", "prompt_embeds are not served: give the prompt as text or token ids"),
])
def test_vllm_s_beam_search_and_prompt_embeds_are_refused_by_name(field, value, message):
    from specctl.gateway.api import CompletionRequest
    from specctl.gateway.request_checks import refuse_unsupported

    for req in (CompletionRequest(prompt="x", **{field: value}),
                ChatCompletionRequest(messages=[], **{field: value})):
        with pytest.raises(ApiError) as refused:
            refuse_unsupported(req)
        assert (refused.value.status, str(refused.value), refused.value.param) == (400, message, field)
    refuse_unsupported(CompletionRequest(prompt="x", use_beam_search=False))  # vLLM's default, as clients send it


@pytest.mark.parametrize("messages, message, param", [
    ([{"role": "user"}], "messages[0] (user) has no content: a user message needs content", "messages[0].content"),
    ([{"role": "system", "content": "be brief"}, {"role": "user", "content": None}],
     "messages[1] (user) has no content: a user message needs content", "messages[1].content"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant"}],
     "messages[1] (assistant) has no content: an assistant message needs content or tool_calls", "messages[1].content"),
    ([{"role": "tool", "tool_call_id": "c1"}], "messages[0] (tool) has no content: a tool message needs content",
     "messages[0].content"),
])
def test_a_message_without_content_is_refused_by_its_place_as_openai_does(messages, message, param):
    with pytest.raises(ApiError) as caught:
        chat_messages(msgspec.convert({"messages": messages}, ChatCompletionRequest))
    assert (caught.value.status, str(caught.value), caught.value.param) == (400, message, param)


def test_an_assistant_turn_that_called_tools_may_leave_its_content_out():
    req = msgspec.convert({"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "w", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]}, ChatCompletionRequest)
    turns = chat_messages(req)
    assert [turn["content"] for turn in turns] == ["weather?", "", "sunny"]
    assert turns[1]["tool_calls"] == [{"type": "function", "function": {"name": "w", "arguments": {}}}]
