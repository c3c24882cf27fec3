"""A request's encoding (its chat template, its prompts' tokenization) runs on the gateway's
encoding thread, off the event loop every stream is read on: a megabyte prompt takes most of
a second to tokenize, which would stall every other request's tokens meanwhile."""

import json
import re
import threading
import urllib.request

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specctl.cluster.embedded import ClusterConfig, ClusterThread
from specctl.config import build_config
from specctl.gateway import generation, respond, responses
from tests.conftest import logprobs_close
from tests.test_gateway import PROMPT, post


@pytest.fixture(scope="module")
def gateway(tiny_dir):
    config = build_config(None, target=str(tiny_dir["llama"]), mode="ar", dtype="fp32")
    thread = ClusterThread(config, ClusterConfig(targets=1, gateway_port=0, speculate=False))
    urls = thread.start()
    yield thread, urls["gateway"]
    thread.stop()


def on_thread(seen: list, fn, name: str | None = None):
    """``fn``, noting in ``seen`` the thread each call runs on (with ``name``: (name, thread))."""
    def wrapper(*args, **kwargs):
        thread = threading.current_thread().name
        seen.append(thread if name is None else (name, thread))
        return fn(*args, **kwargs)
    return wrapper


def test_every_endpoint_encodes_its_prompts_on_the_encoding_thread(gateway, monkeypatch):
    thread, url = gateway
    seen: list[str] = []
    tokenizer = thread.cluster.gateway.generations.tokenizer
    monkeypatch.setattr(generation, "render_chat", on_thread(seen, generation.render_chat))
    monkeypatch.setattr(tokenizer, "encode", on_thread(seen, tokenizer.encode))  # every prompt's, llama.cpp's and SGLang's too
    model = thread.cluster.gateway.config.names[0]
    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2}
    for route, body in [("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}), ("/v1/chat/completions", chat),
                        ("/v1/messages", {**chat, "model": model}), ("/v1/messages/count_tokens", {**chat, "model": model}),
                        ("/tokenize", {"prompt": PROMPT}), ("/tokenize", {"messages": chat["messages"]}),
                        ("/tokenize", {"content": PROMPT}), ("/completion", {"prompt": PROMPT, "n_predict": 2}),
                        ("/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 2}})]:
        seen.clear()
        code, _, raw = post(url + route, body)
        assert code == 200 and seen and set(seen) == {"gateway-encode_0"}, (route, seen, raw)


def test_a_prompt_too_long_for_the_context_however_it_tokenizes_is_refused_before_it_is_tokenized(gateway,
                                                                                                   monkeypatch):
    """The tiny model's context is 512 tokens and its longest token 14 characters: a text past
    7,168 characters cannot fit, and tokenizing it first (0.7 KB and 3 us a token) is what a huge
    prompt would cost the gateway only to be refused after."""
    thread, url = gateway
    tokenizer = thread.cluster.gateway.generations.tokenizer
    seen: list[str] = []
    monkeypatch.setattr(tokenizer, "encode", on_thread(seen, tokenizer.encode))
    model = thread.cluster.gateway.config.names[0]
    over = "a" * (512 * 14 + 1)
    n = len(over)
    for route, body, param, chars in [
            ("/v1/completions", {"prompt": ["hi", over], "max_tokens": 2}, "prompt", n),
            ("/v1/completions", {"prompt": "def f(", "suffix": over, "max_tokens": 2}, "prompt", n + 6),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": over}]}, "messages", None),
            ("/v1/responses", {"input": over}, "messages", None),
            ("/v1/messages", {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": over}]},
             None, None),  # Anthropic's error shape names no param
            ("/tokenize", {"prompt": over}, "prompt", n), ("/tokenize", {"content": over}, "content", n),
            ("/completion", {"prompt": [1, over[:4000], over[:4000]], "n_predict": 2}, "prompt", 8000),
            ("/infill", {"input_prefix": over[:4000], "input_suffix": over[:4000]}, "input_prefix", 8000),
            ("/generate", {"text": over}, "text", n)]:
        seen.clear()
        code, _, raw = post(url + route, body)
        error = json.loads(raw)["error"]
        assert code == 400 and seen == [], (route, seen, raw)  # nothing tokenized
        said = re.fullmatch(r"This model's maximum context length is 512 tokens\. However, the prompt is (\d+) "
                            r"characters: more than 512 tokens however it is split \(a token of this model is at most "
                            r"14 characters\)\. Please reduce the length of the prompt\.", error["message"])
        assert said and int(said.group(1)) == (chars or int(said.group(1))) > 512 * 14, (route, raw)  # chat: templated
        assert error.get("param") == param and error.get("code", "context_length_exceeded") == "context_length_exceeded"
    code, _, raw = post(url + "/v1/completions", {"prompt": over[:-1], "max_tokens": 2})  # may fit: tokenized
    assert code == 400 and seen and "you requested 7170 tokens (7168 in the messages/prompt" in raw.decode()


def test_an_encoding_error_is_the_requests_400_and_the_next_request_is_served(gateway):
    _, url = gateway
    code, _, raw = post(url + "/v1/completions", {"prompt": "", "max_tokens": 2})
    assert code == 400 and json.loads(raw)["error"]["message"] == "the prompt is empty"
    code, _, raw = post(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                                                        "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert code == 400 and json.loads(raw)["error"]["param"] == "tool_choice"
    code, _, raw = post(url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert code == 200 and json.loads(raw)["usage"]["completion_tokens"] == 2


def test_logprobs_name_tokens_from_a_cache_of_their_texts_with_the_same_answer(gateway):
    """A token's text, as logprobs and prompt_logprobs name it, is decoded once and read back
    after (a long prompt's 20 alternatives a token would decode the same ids again and again)."""
    thread, url = gateway
    texts = thread.cluster.gateway.generations._token_text
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 5, "echo": True, "prompt_logprobs": 5}
    first = json.loads(post(url + "/v1/completions", body)[2])
    decoded = texts.cache_info().misses
    second = json.loads(post(url + "/v1/completions", body)[2])
    assert texts.cache_info().misses == decoded and texts.cache_info().hits > 0  # every name read back
    assert second["choices"][0]["logprobs"] == logprobs_close(first["choices"][0]["logprobs"])
    assert second["choices"][0]["prompt_logprobs"] == logprobs_close(first["choices"][0]["prompt_logprobs"])


def test_a_whole_answer_is_built_and_serialised_off_the_event_loop(gateway, monkeypatch):
    """A long prompt's prompt_logprobs with 20 alternatives each is tens of MB of JSON: built
    on the loop it would stall every stream for seconds."""
    thread, url = gateway
    model = thread.cluster.gateway.config.names[0]
    seen: list[str] = []
    monkeypatch.setattr(responses, "prompt_logprobs_body", on_thread(seen, responses.prompt_logprobs_body))
    monkeypatch.setattr(responses, "full_response", on_thread(seen, responses.full_response))
    monkeypatch.setattr(respond, "json_in_pieces", on_thread(seen, respond.json_in_pieces))
    monkeypatch.setattr(responses, "logprobs_body", on_thread(seen, responses.logprobs_body))
    for route, body, built in [
            ("/v1/completions", {"prompt": [PROMPT, "Hello"], "max_tokens": 2, "prompt_logprobs": 20, "echo": True,
                                 "logprobs": 5}, 6),  # two prompt_logprobs, two logprobs, the response, its JSON
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2,
                                      "prompt_logprobs": 3, "logprobs": True, "top_logprobs": 2}, 4),
            ("/v1/responses", {"input": PROMPT, "max_output_tokens": 2, "top_logprobs": 2,
                               "include": ["message.output_text.logprobs"]}, 2),  # its logprobs, its JSON
            ("/v1/messages", {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": PROMPT}]},
             1),  # its JSON
            ("/completion", {"prompt": PROMPT, "n_predict": 2, "n_probs": 5}, 1),
            ("/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 2}, "return_logprob": True,
                           "logprob_start_len": 0, "top_logprobs_num": 5}, 1)]:
        seen.clear()
        code, headers, raw = post(url + route, body)
        assert code == 200 and headers["Content-Type"] == "application/json; charset=utf-8"
        assert json.loads(raw)
        assert len(seen) == built and "specctl-cluster" not in seen, (route, seen)  # a worker thread's, not the loop's


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=9) | st.dictionaries(st.text(), inner, max_size=4), max_leaves=40)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_json_in_pieces_is_the_json_of_the_whole(value):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(respond, "JSON_PIECE", 2)  # lists past 2 items go a piece at a time
        assert json.loads(respond.json_in_pieces(value)) == value
    assert json.loads(respond.json_in_pieces(value)) == value


def test_a_streamed_echo_s_long_logprobs_are_built_and_serialised_off_the_event_loop(gateway, monkeypatch):
    _, url = gateway
    seen: list[tuple[str, str]] = []
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2, "stream": True}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        short = [json.loads(line[6:]) for line in response if line.startswith(b"data: {")]
    monkeypatch.setattr(respond, "JSON_PIECE", 3)  # the prompt's tokens are more: its chunk is a long one
    monkeypatch.setattr(responses, "logprobs_body", on_thread(seen, responses.logprobs_body, "logprobs"))
    monkeypatch.setattr(respond, "json_in_pieces", on_thread(seen, respond.json_in_pieces, "json"))
    with urllib.request.urlopen(request, timeout=60) as response:
        long = [json.loads(line[6:]) for line in response if line.startswith(b"data: {")]
    def kept(chunks):  # what a chunk says, not its id, time or speed
        return [{k: v for k, v in c.items() if k not in ("id", "created", "specctl")} for c in chunks]
    assert kept(short) == kept(long)  # the same chunks either way
    first = long[0]["choices"][0]["logprobs"]["tokens"]
    assert len(first) > 3 and [name for name, _ in seen] == ["logprobs", "json"] + ["logprobs"] * (len(seen) - 2)
    assert "specctl-cluster" not in {thread for _, thread in seen[:2]}  # the echo's chunk: a worker's
    assert {thread for _, thread in seen[2:]} == {"specctl-cluster"}  # a token's chunk: on the loop, as before


def test_a_streamed_response_s_events_with_every_token_s_logprobs_are_serialised_off_the_event_loop(gateway,
                                                                                                      monkeypatch):
    """With logprobs asked, a stream's done and completed events carry every token's: serialised
    on a worker thread; its deltas, a token's own, on the loop as before."""
    _, url = gateway
    seen: list[tuple[str, str]] = []
    body = {"input": PROMPT, "max_output_tokens": 3, "temperature": 0, "top_logprobs": 2, "stream": True,
            "include": ["message.output_text.logprobs"]}
    request = urllib.request.Request(url + "/v1/responses", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    monkeypatch.setattr(respond, "json_in_pieces", on_thread(seen, respond.json_in_pieces, "json"))
    with urllib.request.urlopen(request, timeout=60) as response:
        events = [json.loads(line[6:]) for line in response if line.startswith(b"data: {")]
    whole = [e["type"] for e in events if e["type"].endswith((".done", ".completed", ".incomplete"))]
    assert events[-1]["type"] in ("response.completed", "response.incomplete") and len(whole) >= 4
    assert len(seen) == len(whole) and "specctl-cluster" not in {thread for _, thread in seen}
    [done] = [e for e in events if e["type"] == "response.output_text.done"]
    assert len(done["logprobs"]) == events[-1]["response"]["usage"]["output_tokens"]
    assert events[-1]["response"]["output"][-1]["content"][0]["logprobs"] == done["logprobs"]
    seen.clear()
    request.data = json.dumps({**body, "include": None}).encode()
    with urllib.request.urlopen(request, timeout=60) as response:
        assert sum(1 for line in response if line.startswith(b"data: {")) == len(events)
    assert seen == []  # no logprobs asked: every event as before
