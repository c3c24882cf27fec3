"""The OpenAI-compatible gateway over a real cluster (draft server, 2 target instances,
gateway; tiny fp32 models, loopback TCP and HTTP), driven by the official openai client."""

import asyncio
import dataclasses
import json
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from specctl.cluster.embedded import ClusterConfig, ClusterThread
from specctl.config import build_config
from specctl.gateway.choices import Choices
from tests.conftest import logprobs_close, poll_until

PROMPT = "The quick brown fox"


def specctl_generate(tiny_dir, prompt, max_tokens, chat=False):
    proc = subprocess.run(
        [sys.executable, "-m", "specctl", "generate", "--target", str(tiny_dir["llama"]), "--mode", "ar",
         "--dtype", "fp32", "--prompt", prompt, "--max-tokens", str(max_tokens), "--json", *(["--chat"] if chat else [])],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def post(url, body, headers=None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_completions_equal_specctl_generate(cluster, client, tiny_dir):
    reference = specctl_generate(tiny_dir, PROMPT, 20)
    full = client.completions.create(model=str(tiny_dir["llama"]), prompt=PROMPT, max_tokens=20, temperature=0)
    assert full.choices[0].text == reference["text"]
    assert full.usage.completion_tokens == len(reference["token_ids"])
    assert full.usage.prompt_tokens == reference["stats"]["prompt_tokens"]
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    chunks = list(client.completions.create(model=str(tiny_dir["llama"]), prompt=PROMPT, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference["text"]
    assert chunks[-1].usage.completion_tokens == len(reference["token_ids"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert all(c.usage is None for c in chunks[:-1])
    running = list(client.completions.create(  # vLLM's continuous_usage_stats: the usage so far on every chunk
        model=str(tiny_dir["llama"]), prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in running]
    assert counts == sorted(counts) and counts[-1] == counts[-2] == len(reference["token_ids"])
    assert all(c.usage.prompt_tokens == full.usage.prompt_tokens for c in running) and counts[0] > 0
    assert "".join(c.choices[0].text for c in running if c.choices) == reference["text"]
    # several choices: each chunk's usage is its own choice's (its prompt, its tokens so far), as
    # vLLM's; the last chunk's is the request's
    prompts = [PROMPT, PROMPT + " and then some more words"]
    whole = client.completions.create(model=str(tiny_dir["llama"]), prompt=prompts, max_tokens=12, temperature=0, n=2)
    running = list(client.completions.create(
        model=str(tiny_dir["llama"]), prompt=prompts, max_tokens=12, temperature=0, n=2, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    lengths = [client.completions.create(model=str(tiny_dir["llama"]), prompt=p, max_tokens=1).usage.prompt_tokens
               for p in prompts]
    assert lengths[0] < lengths[1]
    seen: dict[int, list[int]] = {}
    for c in running[:-1]:
        index = c.choices[0].index  # prompt_idx * n + i, as vLLM's
        seen.setdefault(index, []).append(c.usage.completion_tokens)
        assert c.usage.prompt_tokens == lengths[index // 2]
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    assert sorted(seen) == [0, 1, 2, 3] and all(counts == sorted(counts) and counts[-1] == 12 for counts in seen.values())
    assert running[-1].usage.completion_tokens == whole.usage.completion_tokens == 48
    assert running[-1].usage.prompt_tokens == whole.usage.prompt_tokens == sum(lengths)  # a prompt once, as vLLM


def test_chat_completions_equal_specctl_generate_chat(cluster, client, tiny_dir):
    reference = specctl_generate(tiny_dir, "Say hello", 16, chat=True)
    messages = [{"role": "user", "content": "Say hello"}]
    full = client.chat.completions.create(model=str(tiny_dir["llama"]), messages=messages, max_tokens=16, temperature=0)
    assert full.choices[0].message.content == reference["text"]
    assert full.choices[0].message.role == "assistant"
    assert full.usage.prompt_tokens == reference["stats"]["prompt_tokens"]
    assert full.usage.completion_tokens == len(reference["token_ids"])
    stream = client.chat.completions.create(model=str(tiny_dir["llama"]), messages=messages, max_tokens=16,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference["text"]
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_models_health_and_seeded_sampling(cluster, client, tiny_dir):
    [card] = client.models.list().data
    assert card.id == str(tiny_dir["llama"]) and card.model_extra["max_model_len"] == 512  # the tiny model's context
    assert client.models.retrieve(card.id) == card  # GET /v1/models/{model}, slashes and all
    with pytest.raises(openai.NotFoundError, match="The model `gpt-4` does not exist"):
        client.models.retrieve("gpt-4")
    from specctl import __version__

    with urllib.request.urlopen(cluster[1]["gateway"] + "/version", timeout=10) as response:
        assert json.loads(response.read()) == {"version": __version__}
    with urllib.request.urlopen(cluster[1]["gateway"] + "/health", timeout=10) as response:
        assert json.loads(response.read()) == {"status": "ok", "targets_up": 2, "targets": 2}
    # vLLM's /ping and /load, SGLang's /health_generate (a token generated now, its session freed after)
    with urllib.request.urlopen(cluster[1]["gateway"] + "/ping", timeout=10) as response:
        assert response.status == 200 and json.loads(response.read())["status"] == "ok"
    with urllib.request.urlopen(cluster[1]["gateway"] + "/load", timeout=10) as response:
        assert json.loads(response.read()) == {"server_load": 0}
    with urllib.request.urlopen(cluster[1]["gateway"] + "/health_generate", timeout=60) as response:
        assert response.status == 200 and json.loads(response.read()) == {"status": "ok"}
    poll_until(lambda: sum(t.active for t in cluster[0].cluster.targets), lambda active: active == 0, timeout=10)
    runs = [client.completions.create(model=str(tiny_dir["llama"]), prompt=PROMPT, max_tokens=12, temperature=1.0,
                                      top_p=0.9, seed=1234, extra_body={"top_k": 50}).choices[0].text for _ in range(2)]
    assert runs[0] == runs[1]


def test_served_model_names_are_what_clients_give_and_answers_carry_the_first(cluster, client, tiny_dir):
    config = cluster[0].cluster.gateway.config  # as `--served-model-name gpt-x --served-model-name alias` sets it
    real = str(tiny_dir["llama"])
    config.served_model_names = ("gpt-x", "alias")
    try:
        cards = client.models.list().data
        assert [(c.id, c.model_extra["root"]) for c in cards] == [("gpt-x", real), ("alias", real)]
        assert client.models.retrieve("alias").id == "alias"
        reply = client.chat.completions.create(model="alias", max_tokens=4, temperature=0,
                                               messages=[{"role": "user", "content": "hi"}])
        assert reply.model == "gpt-x"
        assert client.responses.create(model="alias", input="hi", max_output_tokens=4).model == "gpt-x"
        with pytest.raises(openai.NotFoundError, match=r"This gateway serves `gpt-x`, `alias`\.$"):
            client.completions.create(model=real, prompt="hi", max_tokens=2)  # only the served names, as vLLM
    finally:
        config.served_model_names = ()
    with pytest.raises(ValueError, match="a served model name must not be empty"):
        dataclasses.replace(config, served_model_names=(" ",))


def _http(method: str, url: str, headers: dict, body: dict | None = None) -> tuple[int, dict, bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json",
                                                                            **headers})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_browser_origins_get_cors_headers_only_when_allowed(cluster):
    base, config = cluster[1]["gateway"], cluster[0].cluster.gateway.config
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    ask = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}
    code, headers, _ = _http("OPTIONS", base + "/v1/chat/completions", ask)
    assert code == 405 and "Access-Control-Allow-Origin" not in headers  # none allowed by default
    code, headers, _ = _http("POST", base + "/v1/chat/completions", {"Origin": "http://localhost:3000"}, chat)
    assert code == 200 and "Access-Control-Allow-Origin" not in headers
    config.allowed_origins = ("http://localhost:3000",)  # as --allowed-origins http://localhost:3000 sets it
    try:
        code, headers, _ = _http("OPTIONS", base + "/v1/chat/completions", ask)
        assert code == 204 and headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
        assert headers["Access-Control-Allow-Headers"] == "authorization, content-type"
        assert "POST" in headers["Access-Control-Allow-Methods"]
        code, headers, raw = _http("POST", base + "/v1/chat/completions", {"Origin": "http://localhost:3000"}, chat)
        assert code == 200 and headers["Access-Control-Allow-Origin"] == "http://localhost:3000"  # a stream too
        assert raw.endswith(b"data: [DONE]\n\n")
        code, headers, _ = _http("POST", base + "/v1/chat/completions", {"Origin": "http://localhost:3000"}, {})
        assert code == 400 and headers["Access-Control-Allow-Origin"] == "http://localhost:3000"  # errors too
        code, headers, _ = _http("GET", base + "/v1/models", {"Origin": "http://evil.example"})
        assert code == 200 and "Access-Control-Allow-Origin" not in headers
        config.allowed_origins = ("*",)
        assert _http("GET", base + "/v1/models", {"Origin": "http://evil.example"})[1][
            "Access-Control-Allow-Origin"] == "*"
    finally:
        config.allowed_origins = ()


def test_stop_strings_cut_the_text_and_finish_with_stop(cluster, client, tiny_dir):
    reference = client.completions.create(model=str(tiny_dir["llama"]), prompt=PROMPT, max_tokens=24, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].text
    stop = reference[len(reference) // 2:][:3]  # several rounds in
    _, before = _metrics(cluster[1]["gateway"])
    cut = client.completions.create(model=str(tiny_dir["llama"]), prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].text == reference[: reference.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    # The target was stopped with CANCEL and answered with its stats: the cut request counts.
    rounds = cut.model_extra["specctl"]["rounds"]
    assert rounds >= 1
    _, after = _metrics(cluster[1]["gateway"])
    drafts = "specctl:spec_decode_num_drafts_total"
    assert after[drafts] - before[drafts] == rounds
    # vLLM's stop_reason: the stop string that ended it (a decoy that never comes is not it); none at the length limit
    assert client.completions.create(model=str(tiny_dir["llama"]), prompt=PROMPT, max_tokens=24, temperature=0,
                                     stop=["\x00never", stop], extra_body={"ignore_eos": True}
                                     ).choices[0].model_extra["stop_reason"] == stop
    assert client.completions.create(model=str(tiny_dir["llama"]), prompt=PROMPT, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].model_extra["stop_reason"] is None


@pytest.mark.parametrize("body, status, needle", [
    (b"{not json", 400, "not valid JSON"),
    (b'{"prompt": "\xff\xfe"}', 400, "not valid UTF-8 JSON: a string holds byte 0xff, which is not UTF-8"),
    (b"\xff{}", 400, "not valid JSON"),
    (b"", 400, "empty"),
    ({"max_tokens": 4}, 400, "prompt"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature must be between 0 and 100"),
    ({"prompt": "x", "top_p": 1.5}, 400, "top_p must be in (0, 1]"),
    ({"prompt": "x", "temperature": "hot"}, 400, "Expected `float | null`"),
    ({"prompt": "x", "n": 0}, 400, "n must be between 1 and 128, got 0"),
    ({"prompt": ["x"] * 65, "n": 2, "max_tokens": 2}, 400,
     "this request asks for 130 generations (n times the prompts); at most 128"),
    ({"prompt": ["x", 3]}, 400, "prompt must be a string, a list of token ids, or a list of strings or of token-id"),
    ({"prompt": [[]]}, 400, "the prompt is empty"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens must be at least 1"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "The model `gpt-4` does not exist"),
    ({"prompt": "word " * 600, "max_tokens": 8}, 400, "maximum context length is 512 tokens"),
    ({"prompt": "x" * (2 << 20)}, 413, "request body too large (limit 1048576 bytes): send fewer prompts a request, "
                                       "or start the gateway with a larger --max-body-kb"),
])
def test_errors_are_openai_style_and_the_gateway_carries_on(cluster, client, tiny_dir, body, status, needle):
    code, _headers, raw = post(cluster[1]["gateway"] + "/v1/completions", body)
    error = json.loads(raw)["error"]
    assert code == status, error
    assert needle in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    if status == 400 and isinstance(body, dict) and "prompt" in body and "max_tokens" not in body:
        assert error["param"] in ("temperature", "top_p", "n", "prompt"), error
    if body == {"max_tokens": 4}:
        assert error["param"] == "prompt"
    after = client.completions.create(model=str(tiny_dir["llama"]), prompt=PROMPT, max_tokens=3, temperature=0)
    assert after.usage.completion_tokens >= 1


def test_bad_chat_bodies_and_unknown_routes(cluster):
    base = cluster[1]["gateway"]
    code, _, raw = post(base + "/v1/chat/completions", {"messages": []})
    assert code == 400 and json.loads(raw)["error"]["param"] == "messages"
    code, _, raw = post(base + "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]})
    assert code == 400 and "unknown message role 'wizard'" in json.loads(raw)["error"]["message"]
    code, _, raw = post(base + "/v1/chat/completions", {"messages": [{"role": "user"}]})
    assert (code, json.loads(raw)["error"]["message"]) == (400, "messages[0] (user) has no content: a user message "
                                                                "needs content")
    code, _, raw = post(base + "/v1/nothing", {})
    assert code == 404 and json.loads(raw)["error"]["message"] == "no route POST /v1/nothing"
    error = json.loads(post(base + "/v1/completions", {"prompt": "x", "max_tokens": 4, "temperature": 0})[2])
    assert "error" not in error


def _target_logprobs(tiny_dir, prompt_ids, output_ids):
    """The tiny target's raw log-softmax at each output token's row, one forward over the text."""
    from specctl.engine.loader import load_decoder

    target = load_decoder(tiny_dir["llama"])
    text = prompt_ids + output_ids
    logits = target(torch.tensor(text[:-1]), torch.arange(len(text) - 1), target.new_cache(len(text) + 1))
    return logits[len(prompt_ids) - 1:].float().log_softmax(-1)


def test_logprobs_are_the_targets_in_both_api_shapes_streamed_or_not(cluster, tiny_dir):
    base = cluster[1]["gateway"]
    # the prompt's KV stored first: every request below restores it (an fp32 target's restored prefix differs
    # from a fresh prefill by ~1e-7); their logprobs still agree only to ~1e-6, rounded by verification widths
    post(base + "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "temperature": 0})
    reference = specctl_generate(tiny_dir, PROMPT, 12)
    prompt_ids = json.loads(post(base + "/tokenize", {"prompt": PROMPT})[2])["tokens"]
    expected = _target_logprobs(tiny_dir, prompt_ids, reference["token_ids"])
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 2}
    code, _, raw = post(base + "/v1/completions", body)
    choice = json.loads(raw)["choices"][0]
    logprobs = choice["logprobs"]
    assert code == 200 and choice["text"] == reference["text"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == json.loads(raw)["usage"]["completion_tokens"] == 12
    for i, token in enumerate(reference["token_ids"]):
        assert logprobs["token_logprobs"][i] == pytest.approx(float(expected[i, token]), abs=1e-4)
        top = logprobs["top_logprobs"][i]
        assert top[logprobs["tokens"][i]] == logprobs["token_logprobs"][i]  # greedy: the token is its likeliest
        assert sorted(top.values(), reverse=True) == pytest.approx(expected[i].topk(len(top)).values.tolist(), abs=1e-4)
    widths = [len(t) for t in logprobs["tokens"]]
    assert logprobs["text_offset"] == [sum(widths[:i]) for i in range(len(widths))]
    # streamed: the chunks' logprobs join into the same lists
    request = urllib.request.Request(base + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        chunks = [json.loads(line[6:]) for line in response if line.startswith(b"data: {")]
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert sum((s["token_logprobs"] for s in streamed), []) == logprobs_close(logprobs["token_logprobs"])
    assert sum((s["text_offset"] for s in streamed), []) == logprobs["text_offset"]
    # chat: logprobs true and top_logprobs n
    messages = [{"role": "user", "content": PROMPT}]
    code, _, raw = post(base + "/v1/chat/completions", {"messages": messages, "max_tokens": 6, "temperature": 0,
                                                        "logprobs": True, "top_logprobs": 3})
    content = json.loads(raw)["choices"][0]["logprobs"]["content"]
    assert code == 200 and len(content) == json.loads(raw)["usage"]["completion_tokens"]
    assert bytes(sum((entry["bytes"] for entry in content), [])).decode() == json.loads(raw)["choices"][0]["message"]["content"]
    for entry in content:
        assert len(entry["top_logprobs"]) == 3
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]  # greedy
    code, _, raw = post(base + "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "logprobs": True})
    assert all(entry["top_logprobs"] == [] for entry in json.loads(raw)["choices"][0]["logprobs"]["content"])
    code, _, raw = post(base + "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert json.loads(raw)["choices"][0]["logprobs"] is None  # not asked for


def test_a_tokens_bytes_are_its_raw_bytes_so_a_split_character_rebuilds(tiny_dir):
    """OpenAI's logprobs ``bytes``: a character split over byte-level tokens, each token's own
    text U+FFFD, comes back whole from the tokens' bytes."""
    from transformers import AutoTokenizer

    from specctl.engine.text import token_bytes_of

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_dir["llama"]))
    token_bytes = token_bytes_of(tokenizer)
    ids = tokenizer.encode("é🙂 x")
    assert len(ids) > 3 and "\ufffd" in tokenizer.decode([ids[0]])  # the tiny tokenizer is one byte a token
    assert b"".join(token_bytes(i) for i in ids) == "é🙂 x".encode()
    assert token_bytes(tokenizer.convert_tokens_to_ids("<|endoftext|>")) == b"<|endoftext|>"


@pytest.mark.parametrize("route, extra, message", [
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
    ("/v1/chat/completions", {"logprobs": 2}, "logprobs must be true or false for chat; top_logprobs gives the "
                                              "alternatives"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs must be between 0 and 20, got 21"),
    ("/v1/completions", {"logprobs": 21}, "logprobs must be between 0 and 20, got 21"),
    ("/v1/completions", {"logprobs": True}, "logprobs for completions is the number of alternatives (0-20); "
                                           "top_logprobs is for chat"),
])
def test_logprobs_out_of_range_or_in_the_wrong_shape_are_refused(cluster, route, extra, message):
    body = {"prompt": "x"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    code, _, raw = post(cluster[1]["gateway"] + route, {**body, "max_tokens": 2, **extra})
    assert code == 400 and json.loads(raw)["error"]["message"] == message


def test_include_stop_str_in_output_ends_the_text_with_the_stop_string_whole_and_streamed(client, tiny_dir):
    model = str(tiny_dir["llama"])
    reference = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].text
    stop = reference[len(reference) // 2:][:3]
    wanted = reference[: reference.index(stop) + len(stop)]
    body = {"ignore_eos": True, "include_stop_str_in_output": True}
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                      extra_body=body)
    assert whole.choices[0].text == wanted and whole.choices[0].finish_reason == "stop"
    assert whole.choices[0].model_extra["stop_reason"] == stop
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                            stream=True, extra_body=body))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == wanted


@pytest.mark.parametrize("route", ["/v1/completions", "/completion", "/generate"])
def test_many_stop_strings_are_served_as_vllm_llama_cpp_and_sglang_serve_them_within_bounds(client, cluster, tiny_dir,
                                                                                           route):
    """Their servers take any number of stop strings (a llama.cpp front end sends one per chat
    turn marker); 64 strings of 4,096 characters in all bound each token's check of them."""
    reference = client.completions.create(model=str(tiny_dir["llama"]), prompt=PROMPT, max_tokens=24, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].text
    stop = reference[len(reference) // 2:][:3]
    stops = [f"<never {i}>" for i in range(63)] + [stop]
    body = {"/v1/completions": {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True},
            "/completion": {"prompt": PROMPT, "n_predict": 24, "temperature": 0, "ignore_eos": True},
            "/generate": {"text": PROMPT, "sampling_params": {"max_new_tokens": 24, "temperature": 0,
                                                              "ignore_eos": True}}}[route]
    with_stops = (lambda stop: {**body, "sampling_params": {**body["sampling_params"], "stop": stop}}
                  if route == "/generate" else {**body, "stop": stop})
    code, _, raw = post(cluster[1]["gateway"] + route, with_stops(stops))
    answer = json.loads(raw)
    text = answer.get("content", answer.get("text")) if route != "/v1/completions" else answer["choices"][0]["text"]
    assert code == 200 and text == reference[: reference.index(stop)], answer
    for stops, message in ((stops + ["x"], "at most 64 stop strings, got 65"),
                           (["y" * 4000, "z" * 97], "stop strings may hold 4,096 characters in all, got 4,097")):
        code, _, raw = post(cluster[1]["gateway"] + route, with_stops(stops))
        assert code == 400 and json.loads(raw)["error"]["message"] == message


def test_stop_token_ids_end_the_generation_before_the_stop_token(cluster, tiny_dir):
    reference = specctl_generate(tiny_dir, PROMPT, 20)
    ids = reference["token_ids"]
    k = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])  # the first token not seen before it
    body = {"prompt": PROMPT, "max_tokens": 20, "temperature": 0, "stop_token_ids": [ids[k]]}
    code, _, raw = post(cluster[1]["gateway"] + "/v1/completions", body)
    choice, usage = json.loads(raw)["choices"][0], json.loads(raw)["usage"]
    assert code == 200 and choice["finish_reason"] == "stop" and usage["completion_tokens"] == k
    assert reference["text"].startswith(choice["text"])
    assert choice["stop_reason"] == ids[k]  # vLLM's: the stop token id that ended it
    chunks = [json.loads(line[6:]) for line in post(cluster[1]["gateway"] + "/v1/completions", {**body, "stream": True}
                                                   )[2].decode().splitlines() if line.startswith("data: {")]
    assert [(c["choices"][0]["finish_reason"], c["choices"][0]["stop_reason"]) for c in chunks][-1] == ("stop", ids[k])
    code, _, raw = post(cluster[1]["gateway"] + "/v1/completions", {**body, "stop_token_ids": [10**6]})
    assert code == 400 and "target instance: stop_token_ids must be in [0, " in json.loads(raw)["error"]["message"]
    code, _, raw = post(cluster[1]["gateway"] + "/v1/completions", {**body, "stop_token_ids": list(range(65))})
    assert code == 400 and json.loads(raw)["error"] == {"message": "at most 64 stop_token_ids, got 65",
                                                        "type": "invalid_request_error", "param": "stop_token_ids",
                                                        "code": None}


def test_fields_at_their_no_op_values_are_served():
    from specctl.gateway.api import CompletionRequest
    from specctl.gateway.request_body import parse_body
    from specctl.gateway.request_checks import refuse_unsupported

    body = {"prompt": "x", "logit_bias": {"42": 0}, "response_format": {"type": "text"},
            "tools": [], "tool_choice": "none", "min_p": 0.0, "min_tokens": 0, "repetition_penalty": 1.0,
            "stop_token_ids": [], "guided_json": None}
    refuse_unsupported(parse_body(json.dumps(body).encode(), CompletionRequest))  # raises nothing


def test_an_unknown_field_is_ignored_and_named_once_in_the_log(caplog):
    from specctl.gateway import request_body
    from specctl.gateway.api import CompletionRequest

    request_body._warned_fields.difference_update({"zz_flavour", "store"})
    with caplog.at_level("WARNING", logger="specctl.gateway"):
        for _ in range(3):
            req = request_body.parse_body(b'{"prompt": "x", "zz_flavour": "mint", "store": false}', CompletionRequest)
            assert req.prompt == "x"
    named = [r.getMessage() for r in caplog.records if "zz_flavour" in r.getMessage()]
    assert named == ["ignoring request field(s) store, zz_flavour: not a field this gateway serves on /v1/completions"]
    # Names are remembered up to a bound: a client inventing names cannot grow the gateway's memory.
    for i in range(request_body.MAX_WARNED_FIELDS + 10):
        request_body.parse_body(json.dumps({"prompt": "x", f"zz_{i}": 1}).encode(), CompletionRequest)
    assert len(request_body._warned_fields) == request_body.MAX_WARNED_FIELDS


def test_sixteen_concurrent_streams_all_end_with_done(cluster):
    import aiohttp

    async def one(session, i):
        body = {"prompt": f"client {i} says", "max_tokens": 12, "temperature": 0, "stream": True, "ignore_eos": True}
        async with session.post(cluster[1]["gateway"] + "/v1/completions", json=body) as response:
            assert response.status == 200
            lines = [line.decode().strip() async for line in response.content if line.strip()]
        assert lines[-1] == "data: [DONE]"
        return "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1])

    async def main():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(one(session, i) for i in range(16)))

    texts = asyncio.run(main())
    assert len(texts) == 16 and all(texts)
    # One pooled connection per target instance carried them all, and carries the next ones.
    links = cluster[0].cluster.gateway.upstream.targets
    pooled = [link.connection for link in links]
    assert all(c is not None and not c.closed for c in pooled)
    assert len(asyncio.run(main())) == 16
    assert [link.connection for link in links] == pooled and not any(c.closed for c in pooled)


def _metrics(base):
    with urllib.request.urlopen(base + "/metrics", timeout=10) as response:
        families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
    return families, {s.name: s.value for f in families.values() for s in f.samples if not s.labels}


def test_metrics_parse_and_counters_grow(cluster, client, tiny_dir):
    base = cluster[1]["gateway"]
    client.completions.create(model=str(tiny_dir["llama"]), prompt=PROMPT, max_tokens=8, temperature=0)
    families, before = _metrics(base)
    reply = client.completions.create(model=str(tiny_dir["llama"]), prompt=PROMPT, max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True})
    _, after = _metrics(base)
    for name in ("specctl:spec_decode_num_drafts_total", "specctl:spec_decode_num_draft_tokens_total",
                 "specctl:generation_tokens_total"):
        assert after[name] > before[name], name
    accepted = after["specctl:spec_decode_num_accepted_tokens_total"]
    # the request's own accepted tokens, as its specctl summary counts them (alone in this module's run, the
    # 2-layer self-draft accepts none of this prompt's: a cumulative "> 0" held only after the earlier tests)
    assert accepted - before["specctl:spec_decode_num_accepted_tokens_total"] == reply.model_extra["specctl"]["accepted"]
    assert reply.model_extra["specctl"]["drafted"] > 0
    per_pos = [s for s in _metrics(base)[0]["specctl:spec_decode_num_accepted_tokens_per_pos"].samples
               if s.name.endswith("_total")]
    assert sum(s.value for s in per_pos) == accepted
    assert after["specctl:generation_tokens_total"] - before["specctl:generation_tokens_total"] == 16
    assert "specctl:spec_decode_num_accepted_tokens_per_pos" in families
    # vLLM's latency histograms: one observation for the generation, each a positive time
    for histogram in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        name = f"specctl:{histogram}"
        assert after[f"{name}_count"] - before[f"{name}_count"] == 1, name
        assert after[f"{name}_sum"] > before[f"{name}_sum"], name
    ttft = after["specctl:time_to_first_token_seconds_sum"] - before["specctl:time_to_first_token_seconds_sum"]
    e2e = after["specctl:e2e_request_latency_seconds_sum"] - before["specctl:e2e_request_latency_seconds_sum"]
    assert ttft <= e2e  # the first token comes before the end
    with urllib.request.urlopen(base + "/v1/stats", timeout=30) as response:
        gateway = json.loads(response.read())["gateway"]  # the monitor's latency line: the same generations
    assert gateway["generations"] == min(100, after["specctl:e2e_request_latency_seconds_count"])
    assert 0 < gateway["ttft_ms_p50"] <= gateway["ttft_ms_p90"] and 0 < gateway["e2e_ms_p50"] <= gateway["e2e_ms_p90"]
    for gauge in ("specctl:draft_load", "specctl:T_idle_ms", "specctl:T_wait_ms", "specctl:queue_depth",
                  "specctl:sessions", "specctl:tokens_per_s", "specctl:role_up"):
        assert gauge in families, gauge
    roles = {s.labels["role"] for s in families["specctl:role_up"].samples if s.value == 1}
    assert roles == {"draft", "target"}


def _requests_by_status(base: str) -> dict[str, float]:
    return {s.labels["status"]: s.value for s in _metrics(base)[0]["specctl:requests"].samples
            if s.name.endswith("_total") and s.labels["endpoint"] == "completions"}


def _stream_and_leave(base: str, body: dict, until: bytes) -> bytes:
    """A streamed request read over a raw socket until ``until`` comes, then the connection
    closed at once (as httpx-based clients close a stream once they read [DONE])."""
    host, port = base.removeprefix("http://").split(":")
    data = json.dumps({**body, "stream": True}).encode()
    with socket.create_connection((host, int(port)), timeout=60) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(data) + data)
        received = b""
        while until not in received:
            received += conn.recv(65536) or pytest.fail(f"closed before {until!r}: {received!r}")
    return received


def test_a_client_that_leaves_after_done_was_served_one_that_leaves_before_was_not(cluster, tiny_dir, monkeypatch):
    """The requests counter's status: a client that closes the connection on reading [DONE] got
    the whole answer ("ok"; it was "cancelled": the close cancelled the handler while it ended
    the stream, as it often did behind real instances); one that leaves after its first chunk is
    "cancelled". The gateway's ending is slowed here so that the close always comes first."""
    ending = Choices.__aexit__

    async def slow_ending(self, *exc_info):
        await asyncio.sleep(0.5)
        await ending(self, *exc_info)

    monkeypatch.setattr(Choices, "__aexit__", slow_ending)  # the cluster runs in this process
    base = cluster[1]["gateway"]
    body = {"model": str(tiny_dir["llama"]), "prompt": PROMPT, "temperature": 0, "ignore_eos": True}
    before = _requests_by_status(base)
    _stream_and_leave(base, {**body, "max_tokens": 4}, b"data: [DONE]")
    poll_until(lambda: _requests_by_status(base), lambda after: sum(after.values()) > sum(before.values()))
    after = _requests_by_status(base)
    assert (after.get("ok", 0) - before.get("ok", 0), after.get("cancelled", 0) - before.get("cancelled", 0)) == (1, 0)
    _stream_and_leave(base, {**body, "max_tokens": 200}, b"data: {")
    poll_until(lambda: _requests_by_status(base), lambda later: sum(later.values()) > sum(after.values()))
    later = _requests_by_status(base)
    assert (later.get("ok", 0) - after.get("ok", 0), later.get("cancelled", 0) - after.get("cancelled", 0)) == (0, 1)


def test_a_repeated_prompt_is_served_from_one_targets_prefix_cache_with_the_same_text(cluster, client, tiny_dir):
    """Cache-aware routing sends the second request where the first finished (two instances
    here), whose prefix cache holds its text: usage says how many prompt tokens it served, and
    the text is the target alone's (a fresh process with no cache)."""
    prompt = "Prefix caching: the same long opening, sent twice, is computed once. " * 3
    reference = specctl_generate(tiny_dir, prompt, 12)
    model = str(tiny_dir["llama"])
    first = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1
    assert first.choices[0].text == second.choices[0].text == reference["text"]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference["text"]
    families, _ = poll_until(lambda: _metrics(cluster[1]["gateway"]), lambda m: any(
        s.value > 0 for s in m[0]["specctl:prefix_cache_hit_tokens"].samples if s.labels["role"] == "target"))
    assert "specctl:prefix_cache_hit_rate" in families and "specctl:prefix_cache_mb" in families
    assert "specctl:shared_prefills" in families  # engine.prefill_gate (none here: the requests came one by one)


def test_a_prompt_in_flight_serves_the_same_prompt_sent_while_it_decodes(cluster, client, tiny_dir):
    """An instance stores a prompt's KV when its prefill runs, and the gateway routes by the
    prompts an instance prefilled: a second request sent while the first still streams finds
    the prompt in the same instance's cache (the first is not finished yet). (The embedded
    cluster's instances share one model and so one cache: where the second went is checked.)"""
    targets = cluster[0].cluster.targets
    prompt = "A shared system prompt, long enough to be worth caching, for requests at once. " * 3
    request = urllib.request.Request(cluster[1]["gateway"] + "/v1/completions",
                                     headers={"Content-Type": "application/json"},
                                     data=json.dumps({"prompt": prompt, "max_tokens": 200, "temperature": 0,
                                                      "stream": True, "ignore_eos": True}).encode())
    response = urllib.request.urlopen(request, timeout=60)
    try:
        assert response.readline().startswith(b"data: ")  # its prefill has run
        holder = next(t for t in targets if t.active == 1)
        done = [t.sessions_done for t in targets]
        second = client.completions.create(model=str(tiny_dir["llama"]), prompt=prompt, max_tokens=8, temperature=0)
        assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1
        assert [t.sessions_done - d for t, d in zip(targets, done)] == [int(t is holder) for t in targets]
        assert second.choices[0].text == specctl_generate(tiny_dir, prompt, 8)["text"]
    finally:
        response.close()


def test_a_request_s_choices_go_to_one_instance_which_prefills_their_prompt_once(cluster, client, tiny_dir):
    """The gateway counts a prompt as an instance's from the moment it sends it there, so a
    request's second choice follows the first (one request more than the least loaded is
    within the balance), and that instance's prefill gate makes it wait for the first's prefill
    and restore it (engine.prefill_gate). Before, the second went to the idle instance, which
    prefilled the prompt again."""
    targets = cluster[0].cluster.targets
    prompt = "Two choices of one request share their prompt: it is prefilled once, not twice. " * 3
    done, shared = [t.sessions_done for t in targets], [t.snapshot()["shared_prefills"] for t in targets]
    reply = client.completions.create(model=str(tiny_dir["llama"]), prompt=prompt, max_tokens=8, temperature=0, n=2)
    moved = [t.sessions_done - d for t, d in zip(targets, done)]
    assert sorted(moved) == [0, 2]
    holder = targets[moved.index(2)]
    # one prefill shared: the instances run over one model, so they share its prefix cache and its
    # gate, and report the same count, as they report the same prefix-cache figures
    assert [t.snapshot()["shared_prefills"] - s for t, s in zip(targets, shared)] == [1, 1]
    assert holder.prefill_gate is targets[1 - targets.index(holder)].prefill_gate
    assert [c.text for c in reply.choices] == [specctl_generate(tiny_dir, prompt, 8)["text"]] * 2


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}),
    ("/completion", {"prompt": PROMPT, "n_predict": 400, "temperature": 0, "stream": True, "ignore_eos": True}),
    ("/generate", {"text": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": 400, "temperature": 0,
                                                                      "ignore_eos": True}}),
], ids=["openai", "llama.cpp", "sglang"])
def test_client_disconnect_cancels_the_generation_everywhere(cluster, tiny_dir, path, body):
    thread, urls = cluster
    request = urllib.request.Request(urls["gateway"] + path, headers={"Content-Type": "application/json"},
                                     data=json.dumps(body).encode())
    response = urllib.request.urlopen(request, timeout=60)
    assert response.readline().startswith(b"data: ")
    busy = sum(t.active for t in thread.cluster.targets)
    assert busy == 1
    response.close()
    deadline = time.time() + 20
    while time.time() < deadline:
        if sum(t.active for t in thread.cluster.targets) == 0 and thread.cluster.draft_server.table.snapshot()["sessions"] == 0:
            break
        time.sleep(0.1)
    assert sum(t.active for t in thread.cluster.targets) == 0
    assert thread.cluster.draft_server.table.snapshot()["sessions"] == 0
    poll_until(lambda: thread.cluster.gateway.running, lambda running: running == 0, timeout=10)
    # Cancelled by a CANCEL on the pooled connection, which stays up for the next request.
    assert all(link.connection is None or not link.connection.closed for link in thread.cluster.gateway.upstream.targets)


def test_stats_feed_has_every_role(cluster):
    with urllib.request.urlopen(cluster[1]["gateway"] + "/v1/stats", timeout=10) as response:
        feed = json.loads(response.read())
    assert [t["up"] for t in feed["targets"]] == [True, True]
    assert [d["address"] for d in feed["drafters"]] == [cluster[1]["draft"]]
    assert {"load", "T_idle_ms", "T_wait_ms", "t_s_ms", "R_q", "sessions"} <= set(feed["drafters"][0]["stats"])
    assert {"R_p", "tokens_per_s", "acceptance_rate", "mean_accepted_length", "prediction_accepted",
            "prediction_rejected"} <= set(feed["targets"][0]["stats"])  # the last two: the monitor's predicted row


async def test_no_reachable_target_is_503_with_retry_after_and_api_key_is_checked(tiny_dir):
    import aiohttp
    from transformers import AutoTokenizer

    from specctl.bench.processes import free_port
    from specctl.gateway.metrics import GatewayMetrics
    from specctl.gateway.server import Gateway, GatewayConfig
    from specctl.gateway.upstream import Upstream

    metrics = GatewayMetrics()
    gateway = Gateway(GatewayConfig(model_name="tiny", context=512, port=0, api_key="k3y"),
                      AutoTokenizer.from_pretrained(tiny_dir["llama"]),
                      Upstream([f"127.0.0.1:{free_port()}"], metrics=metrics, poll_interval_s=0.1), metrics)
    port = await gateway.start()
    try:
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{port}/v1/completions"
            async with session.post(url, json={"prompt": "x"}) as response:
                assert response.status == 401
                assert (await response.json())["error"]["code"] == "invalid_api_key"
            for _ in range(2):  # and again: nothing is stuck after the first refusal
                async with session.post(url, json={"prompt": "x"}, headers={"Authorization": "Bearer k3y"}) as response:
                    assert response.status == 503
                    assert response.headers["Retry-After"] == "1"
                    body = await response.json()
                    assert re.fullmatch(r"no target instance is reachable \(127\.0\.0\.1:\d+: cannot reach "
                                        r"127\.0\.0\.1:\d+: connection refused\); retry later", body["error"]["message"])
                    assert body["error"]["code"] == "no_capacity"
            async with session.get(f"http://127.0.0.1:{port}/health") as response:
                assert response.status == 503
            async with session.get(f"http://127.0.0.1:{port}/health_generate") as response:
                assert response.status == 503 and (await response.json())["error"].startswith(
                    "no target instance is reachable")
    finally:
        await gateway.close()


def test_monitor_feed_straight_from_the_roles(cluster):
    from specctl.bench.processes import free_port
    from specctl.monitor.source import roles_feed

    urls = cluster[1]
    dead = f"127.0.0.1:{free_port()}"
    feed = asyncio.run(roles_feed([urls["draft"]], [*urls["targets"], dead]))
    assert [d["up"] for d in feed["drafters"]] == [True]
    assert [t["up"] for t in feed["targets"]] == [True, True, False]
    assert feed["targets"][2]["error"] and feed["targets"][2]["address"] == dead
    assert feed["drafters"][0]["stats"]["targets"] == 2  # two target instances hold a link to the draft server


_any_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=12)
_fields = ["model", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "stream", "n", "logprobs",
           "ignore_eos", "prompt", "messages", "echo", "best_of", "stream_options", "max_completion_tokens",
           "logit_bias", "top_logprobs", "response_format", "tools", "tool_choice", "min_p", "stop_token_ids",
           "guided_regex", "guided_choice", "structured_outputs"]
_bodies = st.one_of(
    st.binary(max_size=40),  # random bytes, invalid UTF-8 among them
    st.binary(max_size=8).map(lambda b: b'{"prompt": "' + b + b'"}'),  # bytes inside a string
    st.integers(1, 3000).map(lambda depth: b"[" * depth + b"]" * depth),  # deeply nested JSON
    st.dictionaries(st.sampled_from(_fields), _any_json, max_size=6).map(lambda d: json.dumps(d).encode()),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=_bodies, chat=st.booleans())
def test_any_body_gets_an_answer_never_a_server_error(cluster, body, chat):
    """Wrong types in every field, random bytes, invalid UTF-8, deep nesting: a 2xx or a 4xx
    with an OpenAI-style error, never a 500; and the gateway still serves."""
    url = cluster[1]["gateway"] + ("/v1/chat/completions" if chat else "/v1/completions")
    code, _headers, raw = post(url, body)
    assert code < 500, raw[:300]
    if code >= 400:
        error = json.loads(raw)["error"]
        assert error["message"] and error["type"]


def test_a_pre_speculating_drafts_cache_is_exported_as_gauges():
    from specctl.gateway.metrics import GatewayMetrics

    metrics = GatewayMetrics()
    metrics.record_role("draft", "d:9000", True, {"load": 0.5, "proposal_bytes_mean": 812.5, "prespec": {
        "hit_rate": 0.62, "ready_rate": 0.41, "hits": 31, "misses": 19, "branches_drafted": 400, "branches_used": 31,
        "leftover_used": 0.45, "fallback_jit": 12, "fallback_ngram": 7}})
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(metrics.exposition().decode()) for s in family.samples}
    assert samples[("specctl:prespec_hit_rate", (("address", "d:9000"),))] == 0.62
    assert samples[("specctl:prespec_ready_rate", (("address", "d:9000"),))] == 0.41
    assert samples[("specctl:prespec_branches_drafted", (("address", "d:9000"),))] == 400
    assert samples[("specctl:prespec_leftover_used", (("address", "d:9000"),))] == 0.45
    assert samples[("specctl:prespec_fallbacks", (("address", "d:9000"), ("kind", "ngram")))] == 7
    assert samples[("specctl:proposal_bytes_mean", (("address", "d:9000"), ("role", "draft")))] == 812.5


def test_specpipes_predicted_chains_are_exported_as_gauges():
    from specctl.gateway.metrics import GatewayMetrics

    metrics = GatewayMetrics()
    metrics.record_role("target", "t:9100", True, {"specpipe_predicted": 180, "specpipe_hit_rate": 0.9})
    metrics.record_role("draft", "d:9000", True, {"level_grafts": 7, "levels_sent": 40})
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(metrics.exposition().decode()) for s in family.samples}
    assert samples[("specctl:specpipe_predicted", (("address", "t:9100"), ("role", "target")))] == 180
    assert samples[("specctl:specpipe_level_grafts", (("address", "d:9000"), ("role", "draft")))] == 7


def test_a_targets_drafters_are_exported_as_gauges_by_drafter():
    from specctl.gateway.metrics import GatewayMetrics

    metrics = GatewayMetrics()
    metrics.record_role("target", "t:9100", True, {"drafters": {
        "d:9000": {"chosen_rounds": 12, "accepted_tokens": 30, "failures": 1, "mean_score": 0.5, "connected": True,
                   "benched": False},
        "d:9001": {"chosen_rounds": 0, "accepted_tokens": 0, "failures": 3, "mean_score": None, "connected": True,
                   "benched": True},
        "ngram": {"chosen_rounds": 3, "accepted_tokens": 4, "failures": 0, "mean_score": None, "connected": True,
                  "benched": False}}})
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(metrics.exposition().decode()) for s in family.samples}
    assert samples[("specctl:drafter_chosen_rounds", (("address", "t:9100"), ("drafter", "d:9000")))] == 12
    assert samples[("specctl:drafter_accepted_tokens", (("address", "t:9100"), ("drafter", "ngram")))] == 4
    assert samples[("specctl:drafter_mean_score", (("address", "t:9100"), ("drafter", "d:9000")))] == 0.5
    assert ("specctl:drafter_mean_score", (("address", "t:9100"), ("drafter", "ngram"))) not in samples
    assert samples[("specctl:drafter_benched", (("address", "t:9100"), ("drafter", "d:9001")))] == 1
    assert samples[("specctl:drafter_benched", (("address", "t:9100"), ("drafter", "d:9000")))] == 0


@pytest.mark.parametrize("n", [1, 3])
def test_a_target_that_dies_mid_stream_ends_the_stream_with_its_error_then_503(tiny_dir, n, caplog):
    """kill the only target instance mid-stream: none can go on from the output so far, so the
    stream ends with an error event naming it (once, whatever the choices) and [DONE]; the
    gateway then answers 503 with Retry-After, and carries on."""
    import dataclasses

    config = build_config(None, target=str(tiny_dir["llama"]), mode="ar", dtype="fp32", max_sessions=4)
    thread = ClusterThread(config, ClusterConfig(targets=1, gateway_port=0, speculate=False))
    urls = thread.start()
    try:
        target = thread.cluster.targets[0]
        target.config = dataclasses.replace(target.config, verify_delay_s=0.02)  # a round a slow device takes
        body = {"prompt": PROMPT, "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True, "n": n}
        request = urllib.request.Request(urls["gateway"] + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            events = [response.readline()]  # the first chunk: the target is streaming
            asyncio.run_coroutine_threadsafe(target.close(), thread.loop).result(30)
            events += [line for line in response if line.strip()]
        data = [line.decode().removeprefix("data: ").strip() for line in events if line.startswith(b"data: ")]
        assert data[-1] == "[DONE]"
        error = json.loads(data[-2])["error"]
        assert re.fullmatch(r"target instance 127\.0\.0\.1:\d+ closed the connection mid-stream; going on from "
                            r"its \d+ tokens: no other instance is up", error["message"])
        assert error["type"] == "server_error"
        assert all("choices" in json.loads(d) for d in data[:-2])
        said = [r.getMessage() for r in caplog.records if r.name == "specctl.gateway"]
        down = [line for line in said if " is down: " in line]  # once, whatever the choices
        assert len(down) == 1 and re.fullmatch(r"target 127\.0\.0\.1:\d+ is down: target instance 127\.0\.0\.1:\d+ "
                                               r"closed the connection mid-stream", down[0]), said
        assert sum(line.endswith(": could not go on: no other instance is up") for line in said) == n, said
        poll_until(lambda: thread.cluster.gateway.running, lambda running: running == 0, timeout=10)
        code, headers, raw = post(urls["gateway"] + "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
        assert code == 503 and headers["Retry-After"] == "1"
        assert json.loads(raw)["error"]["code"] == "no_capacity"
    finally:
        thread.stop()


def test_tokenize_and_detokenize_as_vllm_does(cluster, tiny_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_dir["llama"]))
    base = cluster[1]["gateway"]
    code, _, raw = post(base + "/tokenize", {"prompt": PROMPT})
    ids = tokenizer.encode(PROMPT)
    assert code == 200 and json.loads(raw) == {"count": len(ids), "max_model_len": 512, "tokens": ids}
    code, _, raw = post(base + "/tokenize", {"prompt": PROMPT, "return_token_strs": True})
    assert json.loads(raw)["token_strs"] == tokenizer.convert_ids_to_tokens(ids)  # vLLM's return_token_strs
    # the ids a completion of that prompt is counted with
    code, _, raw = post(base + "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "temperature": 0})
    assert json.loads(raw)["usage"]["prompt_tokens"] == len(ids)
    code, _, raw = post(base + "/detokenize", {"tokens": ids})
    assert code == 200 and json.loads(raw) == {"prompt": tokenizer.decode(ids), "content": tokenizer.decode(ids)}
    messages = [{"role": "user", "content": PROMPT}]
    code, _, raw = post(base + "/tokenize", {"messages": messages})
    chat_ids = json.loads(raw)["tokens"]
    code, _, raw = post(base + "/v1/chat/completions", {"messages": messages, "max_tokens": 1, "temperature": 0})
    assert json.loads(raw)["usage"]["prompt_tokens"] == len(chat_ids) > len(ids)
    for path, body, status, message in [
        ("/tokenize", {}, 400, "give one of prompt, messages (vLLM's) or content (llama.cpp's)"),
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400,
         "give one of prompt, messages (vLLM's) or content (llama.cpp's)"),
        ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "The model `gpt-4` does not exist"),
        ("/detokenize", {"tokens": [len(tokenizer)]}, 400, f"token ids must be in [0, {len(tokenizer)})"),
        ("/detokenize", {"tokens": "abc"}, 400, "Expected `array`"),
    ]:
        code, _, raw = post(base + path, body)
        assert code == status and message in json.loads(raw)["error"]["message"], (path, body, raw)


def test_penalties_logit_bias_and_min_tokens_are_the_targets_own_through_the_gateway(cluster, tiny_dir):
    from specctl.engine.loader import load_decoder
    from specctl.spec.params import SamplingParams
    from specctl.spec.rounds import generate

    base = cluster[1]["gateway"]
    ids = json.loads(post(base + "/tokenize", {"prompt": PROMPT})[2])["tokens"]
    penalties = {"presence_penalty": 0.5, "frequency_penalty": 0.4, "repetition_penalty": 1.6}
    code, _, raw = post(base + "/v1/completions", {"prompt": ids, "max_tokens": 16, "temperature": 0,
                                                   "ignore_eos": True, **penalties})
    assert code == 200, raw
    target = load_decoder(tiny_dir["llama"])
    expected, _, _ = generate(target, ids, SamplingParams(max_tokens=16, ignore_eos=True, **penalties))
    plain, _, _ = generate(target, ids, SamplingParams(max_tokens=16, ignore_eos=True))
    assert json.loads(raw)["choices"][0]["text"] == target_text(tiny_dir, expected) != target_text(tiny_dir, plain)
    assert json.loads(raw)["usage"]["completion_tokens"] == 16
    # logit_bias and min_tokens: the target's own with them too
    rules = {"logit_bias": {str(plain[0]): -100, str(plain[3]): 4.5}, "min_tokens": 10, "stop_token_ids": [plain[5]]}
    code, _, raw = post(base + "/v1/completions", {"prompt": ids, "max_tokens": 16, "temperature": 0,
                                                   "ignore_eos": True, **rules})
    assert code == 200, raw
    expected, _, _ = generate(target, ids, SamplingParams(max_tokens=16, ignore_eos=True, min_tokens=10,
                                                          logit_bias=((plain[0], -100.0), (plain[3], 4.5)),
                                                          stop_token_ids=(plain[5],)))
    assert json.loads(raw)["choices"][0]["text"] == target_text(tiny_dir, expected)
    assert json.loads(raw)["usage"]["completion_tokens"] == len(expected) >= 10
    for field, value, message in (("presence_penalty", 3, "presence_penalty must be between -2 and 2, got 3.0"),
                                  ("repetition_penalty", 0, "repetition_penalty must be in (0, 100] (1 = off), got 0.0"),
                                  ("min_p", 2, "min_p must be between 0 and 1, got 2.0"),
                                  ("min_tokens", 9, "min_tokens must be between 0 and max_tokens (2), got 9"),
                                  ("logit_bias", {"x": 1}, "logit_bias keys are token ids, got 'x'"),
                                  ("logit_bias", {"3": 300}, "logit_bias maps token ids (>= 0) to values between -100 "
                                                            "and 100, got 3: 300.0")):
        code, _, raw = post(base + "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, field: value})
        assert code == 400 and json.loads(raw)["error"]["message"] == message
        assert json.loads(raw)["error"]["param"] == field
    code, _, raw = post(base + "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "logit_bias": {"99999": 1}})
    assert code == 400 and json.loads(raw)["error"]["message"] == \
        "target instance: logit_bias token ids must be in [0, 320), got 99999..99999"


def test_allowed_token_ids_hold_the_output_to_them_as_the_target_alone_does(cluster, tiny_dir):
    """vLLM's allowed_token_ids through the star (the draft follows them too): the target alone's
    text with them, every token one of them; an empty list and ids past the vocabulary are 400s."""
    from specctl.engine.loader import load_decoder
    from specctl.spec.params import SamplingParams
    from specctl.spec.rounds import generate

    base = cluster[1]["gateway"]
    ids = json.loads(post(base + "/tokenize", {"prompt": PROMPT})[2])["tokens"]
    allowed = list(range(60, 140, 2))
    code, _, raw = post(base + "/v1/completions", {"prompt": ids, "max_tokens": 16, "temperature": 0,
                                                   "ignore_eos": True, "allowed_token_ids": allowed,
                                                   "return_tokens_as_token_ids": True, "logprobs": 0})
    assert code == 200, raw
    expected, _, _ = generate(load_decoder(tiny_dir["llama"]), ids, SamplingParams(
        max_tokens=16, ignore_eos=True, allowed_token_ids=tuple(allowed)))
    answer = json.loads(raw)["choices"][0]
    assert answer["text"] == target_text(tiny_dir, expected) and set(expected) <= set(allowed)
    assert [int(t.removeprefix("token_id:")) for t in answer["logprobs"]["tokens"]] == expected
    for value, message in (([], "allowed_token_ids must not be empty: leave it out to allow every token"),
                           ([5, 99999], "target instance: allowed_token_ids must be in [0, 320), got 5..99999")):
        code, _, raw = post(base + "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "allowed_token_ids": value})
        assert code == 400 and json.loads(raw)["error"]["message"] == message, raw


def target_text(tiny_dir, tokens):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir["llama"]).decode(tokens, skip_special_tokens=True)
