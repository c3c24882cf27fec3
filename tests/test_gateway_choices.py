"""A request's choices through the gateway (gateway.choices): n per prompt, batched prompts,
echo with the prompt's log-probabilities — each choice what a request of its own gets,
streamed with its index, and a request whose choice fails frees every sibling."""

import json
import time
import urllib.request

import pytest

from specctl.gateway.choices import nth_seed
from tests.conftest import logprobs_close, poll_until
from tests.test_gateway import PROMPT, _target_logprobs, post, specctl_generate


def _wait_idle(thread, timeout=20.0):
    deadline = time.time() + timeout
    while time.time() < deadline and (sum(t.active for t in thread.cluster.targets)
                                      or thread.cluster.draft_server.table.snapshot()["sessions"]):
        time.sleep(0.05)
    return sum(t.active for t in thread.cluster.targets), thread.cluster.draft_server.table.snapshot()["sessions"]


def test_n_choices_are_n_generations_each_as_a_request_of_its_own(cluster, client, tiny_dir):
    model = str(tiny_dir["llama"])
    reference = specctl_generate(tiny_dir, PROMPT, 10)
    greedy = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0, n=3)
    assert [(c.index, c.text) for c in greedy.choices] == [(i, reference["text"]) for i in range(3)]
    assert greedy.usage.prompt_tokens == reference["stats"]["prompt_tokens"]  # the prompt counted once
    assert greedy.usage.completion_tokens == 3 * len(reference["token_ids"])
    assert greedy.model_extra["specctl"]["rounds"] >= 3
    # Sampled with a seed: choice j is what one choice with seed + j samples (as vLLM seeds them).
    sampled = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=77, n=3,
                                        extra_body={"ignore_eos": True})
    alone = [client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=77 + j,
                                       extra_body={"ignore_eos": True}).choices[0].text for j in range(3)]
    assert [c.text for c in sampled.choices] == alone
    assert len(set(alone)) > 1
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello"}],
                                          max_tokens=8, temperature=0, n=2)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content == \
        specctl_generate(tiny_dir, "Say hello", 8, chat=True)["text"]
    assert _wait_idle(cluster[0]) == (0, 0)


def test_a_seed_is_any_64_bit_integer_and_the_choices_seeds_wrap_around(cluster, client, tiny_dir):
    """As vLLM takes a seed (negative ones too); choice j of the last seed samples with the first."""
    assert (nth_seed(5, 2), nth_seed(2**63 - 1, 1), nth_seed(-2**63, 3)) == (7, -2**63, -2**63 + 3)
    model = str(tiny_dir["llama"])

    def sampled(seed: int, n: int = 1) -> list[str]:
        answer = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=seed, n=n,
                                           extra_body={"ignore_eos": True})
        return [choice.text for choice in answer.choices]

    assert sampled(-5) == sampled(-5) != sampled(5)
    assert sampled(2**63 - 1, n=2) == sampled(2**63 - 1) + sampled(-2**63)


def test_batched_prompts_give_n_choices_each_in_prompt_order(cluster, client, tiny_dir):
    model, prompts = str(tiny_dir["llama"]), ["Once upon a time", "The capital of"]
    alone = [client.completions.create(model=model, prompt=p, max_tokens=6, temperature=0) for p in prompts]
    batch = client.completions.create(model=model, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [(c.index, c.text) for c in batch.choices] == [(i * 2 + j, alone[i].choices[0].text)
                                                          for i in range(2) for j in range(2)]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    ids = [json.loads(post(cluster[1]["gateway"] + "/tokenize", {"prompt": p})[2])["tokens"] for p in prompts]
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=6, temperature=0)
    assert [c.text for c in by_ids.choices] == [a.choices[0].text for a in alone]


def test_a_batch_larger_than_the_instances_hold_runs_in_turns_each_as_alone(cluster, client, tiny_dir):
    """lm-eval sends its batch_size prompts in one request: past the 32 sessions of the two
    instances, choices wait for a free one (vLLM queues them too)."""
    model = str(tiny_dir["llama"])
    prompts = [f"{PROMPT} {i}" for i in range(36)]
    answers = [client.completions.create(model=model, prompt=p, max_tokens=5, temperature=0) for p in prompts]
    alone = [a.choices[0].text for a in answers]
    assert len(prompts) * 2 > sum(t.config.max_sessions for t in cluster[0].cluster.targets)
    batch = client.completions.create(model=model, prompt=prompts, max_tokens=5, temperature=0, n=2)
    assert [(c.index, c.text) for c in batch.choices] == [(2 * i + j, alone[i]) for i in range(36) for j in range(2)]
    assert batch.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in answers)
    stream = client.completions.create(model=model, prompt=prompts, max_tokens=5, temperature=0, stream=True)
    texts = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert [texts[i] for i in range(36)] == alone
    assert _wait_idle(cluster[0]) == (0, 0)


def test_streamed_choices_carry_their_index_and_rebuild_each_text(cluster, client, tiny_dir):
    model = str(tiny_dir["llama"])
    full = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count"}], max_tokens=12,
                                          temperature=1.0, seed=5, n=3, logprobs=True)
    chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count"}],
                                                 max_tokens=12, temperature=1.0, seed=5, n=3, logprobs=True,
                                                 stream=True, stream_options={"include_usage": True}))
    for choice in full.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert mine[0].delta.role == "assistant"  # each choice opens with its role
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
        assert [e.token for c in mine if c.logprobs for e in c.logprobs.content] == \
            [e.token for e in choice.logprobs.content]
        assert [c.finish_reason for c in mine if c.finish_reason] == [choice.finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_a_choice_that_cannot_start_fails_the_request_and_frees_its_siblings(cluster, tiny_dir):
    thread, urls = cluster
    from specctl.engine.tiny import TINY_VOCAB as vocab  # an id past it is refused by the target instance
    for stream in (False, True):
        code, _, raw = post(urls["gateway"] + "/v1/completions",
                            {"prompt": [[1, 2, 3], [1, vocab + 5]], "max_tokens": 200, "temperature": 0,
                             "ignore_eos": True, "stream": stream, "n": 2})
        assert code == 400, raw
        assert "target instance" in json.loads(raw)["error"]["message"]
        assert _wait_idle(thread) == (0, 0)
        poll_until(lambda: thread.cluster.gateway.running, lambda running: running == 0, timeout=10)


def test_client_disconnect_cancels_every_choice(cluster):
    thread, urls = cluster
    request = urllib.request.Request(urls["gateway"] + "/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"prompt": PROMPT, "max_tokens": 400, "temperature": 0, "n": 3,
                                                      "stream": True, "ignore_eos": True}).encode())
    response = urllib.request.urlopen(request, timeout=60)
    assert response.readline().startswith(b"data: ")
    assert sum(t.active for t in thread.cluster.targets) == 3
    response.close()
    assert _wait_idle(thread) == (0, 0)
    poll_until(lambda: thread.cluster.gateway.running, lambda running: running == 0, timeout=10)


def test_echo_puts_the_prompt_first_with_its_logprobs_as_lm_eval_asks(cluster, tiny_dir):
    base = cluster[1]["gateway"]
    plain = json.loads(post(base + "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0})[2])
    echoed = json.loads(post(base + "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                                        "echo": True})[2])
    assert echoed["choices"][0]["text"] == PROMPT + plain["choices"][0]["text"]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # not cached_tokens: the second hits the cache
    assert [echoed["usage"][k] for k in counts] == [plain["usage"][k] for k in counts]
    # lm-eval's loglikelihood request: batched token ids, echo, logprobs 1, one token
    prompts = [json.loads(post(base + "/tokenize", {"prompt": p})[2])["tokens"] for p in (PROMPT, "Hello there")]
    code, _, raw = post(base + "/v1/completions", {"prompt": prompts, "max_tokens": 1, "temperature": 0, "echo": True,
                                                   "logprobs": 1})
    assert code == 200, raw
    for ids, choice in zip(prompts, json.loads(raw)["choices"]):
        logprobs, generated = choice["logprobs"], _target_logprobs(tiny_dir, ids, [0])
        assert len(logprobs["tokens"]) == len(ids) + 1
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        whole = _target_logprobs(tiny_dir, ids[:1], ids[1:] + [0])  # row i: prompt token i + 1's distribution
        for i, token in enumerate(ids[1:]):
            assert logprobs["token_logprobs"][i + 1] == pytest.approx(float(whole[i, token]), abs=1e-4)
            assert len(logprobs["top_logprobs"][i + 1]) in (1, 2)  # the token and the likeliest (maybe the same)
        assert logprobs["token_logprobs"][-1] == pytest.approx(float(generated[0].max()), abs=1e-4)  # greedy
        widths = [len(t) for t in logprobs["tokens"]]
        assert logprobs["text_offset"] == [sum(widths[:i]) for i in range(len(widths))]
        assert "".join(logprobs["tokens"][:len(ids)]) == "".join(
            json.loads(post(base + "/detokenize", {"tokens": [t]})[2])["prompt"] for t in ids)
    # streamed: the prompt comes first, with its logprobs; the chunks rebuild the same text and lists
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "echo": True, "logprobs": 0}
    whole = json.loads(post(base + "/v1/completions", body)[2])["choices"][0]
    request = urllib.request.Request(base + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        chunks = [json.loads(line[6:])["choices"][0] for line in response if line.startswith(b"data: {")]
    assert chunks[0]["text"] == PROMPT and chunks[0]["logprobs"]["token_logprobs"][0] is None
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert sum((c["logprobs"]["token_logprobs"] for c in chunks if c["logprobs"]), []) == \
        logprobs_close(whole["logprobs"]["token_logprobs"])
    assert sum((c["logprobs"]["text_offset"] for c in chunks if c["logprobs"]), []) == whole["logprobs"]["text_offset"]


def test_echo_with_max_tokens_0_is_the_prompt_alone_scored_as_vllm_answers_it(cluster, tiny_dir):
    base = cluster[1]["gateway"]
    prompts = [json.loads(post(base + "/tokenize", {"prompt": p})[2])["tokens"] for p in (PROMPT, "Hello there")]
    scored = json.loads(post(base + "/v1/completions", {"prompt": prompts, "max_tokens": 1, "temperature": 0,
                                                        "echo": True, "logprobs": 2})[2])
    code, _, raw = post(base + "/v1/completions", {"prompt": prompts, "max_tokens": 0, "temperature": 0,
                                                   "echo": True, "logprobs": 2})
    assert code == 200, raw
    answer = json.loads(raw)
    for ids, one, alone in zip(prompts, scored["choices"], answer["choices"]):
        # the prompt's own entries, the token the target generated left out
        assert alone["finish_reason"] == "length"
        assert alone["text"] == json.loads(post(base + "/detokenize", {"tokens": ids})[2])["prompt"]
        assert {k: v[:len(ids)] for k, v in one["logprobs"].items()} == alone["logprobs"]
        assert len(alone["logprobs"]["tokens"]) == len(ids)
    assert answer["usage"]["completion_tokens"] == 0
    assert answer["usage"]["prompt_tokens"] == sum(map(len, prompts))
    # streamed: the prompt, then the finish with nothing more; without logprobs the text alone
    request = urllib.request.Request(base + "/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"prompt": PROMPT, "max_tokens": 0, "echo": True,
                                                      "stream": True}).encode())
    with urllib.request.urlopen(request, timeout=60) as response:
        chunks = [json.loads(line[6:])["choices"][0] for line in response if line.startswith(b"data: {")]
    assert [(c["text"], c["finish_reason"]) for c in chunks] == [(PROMPT, None), ("", "length")]
    # max_tokens 0 without echo asks for nothing at all: refused, as vLLM does
    code, _, raw = post(base + "/v1/completions", {"prompt": PROMPT, "max_tokens": 0})
    assert (code, json.loads(raw)["error"]["message"]) == (400, "max_tokens must be at least 1, got 0")
    assert _wait_idle(cluster[0]) == (0, 0)


def _vllm_prompt_entry(row, token: int, alternatives: int) -> dict[int, int]:
    """vLLM's prompt_logprobs entry as {token id: rank}: the token at its rank in the row, and the likeliest."""
    order = row.argsort(descending=True).tolist()
    return {token: order.index(token) + 1, **{order[j]: j + 1 for j in range(alternatives)}}


def test_prompt_logprobs_list_each_prompt_token_with_its_rank_as_vllm_does(cluster, tiny_dir):
    base = cluster[1]["gateway"]
    prompts = [PROMPT, "Hello there"]
    plain = json.loads(post(base + "/v1/completions", {"prompt": prompts, "max_tokens": 6, "temperature": 0})[2])
    code, _, raw = post(base + "/v1/completions", {"prompt": prompts, "max_tokens": 6, "temperature": 0,
                                                   "prompt_logprobs": 3})
    assert code == 200, raw
    answer = json.loads(raw)
    assert [c["text"] for c in answer["choices"]] == [c["text"] for c in plain["choices"]]  # the output untouched
    ranks = []
    for prompt, choice in zip(prompts, answer["choices"]):
        ids = json.loads(post(base + "/tokenize", {"prompt": prompt})[2])["tokens"]
        scored = choice["prompt_logprobs"]
        assert len(scored) == len(ids) and scored[0] is None  # nothing precedes the first token
        whole = _target_logprobs(tiny_dir, ids[:1], ids[1:] + [0])  # row i: prompt token i + 1's distribution
        for i, token in enumerate(ids[1:]):
            entry = scored[i + 1]
            assert next(iter(entry)) == str(token)  # the token first, as vLLM lists it
            assert {int(k): v["rank"] for k, v in entry.items()} == _vllm_prompt_entry(whole[i], token, 3)
            for key, item in entry.items():
                assert item["logprob"] == pytest.approx(float(whole[i, int(key)]), abs=1e-4)
                assert item["decoded_token"] == json.loads(post(base + "/detokenize", {"tokens": [int(key)]})[2])["prompt"]
            ranks.append(entry[str(token)]["rank"])
    assert max(ranks) > 3  # the tiny random model: some prompt tokens are not among the likeliest
    # Chat: once beside the choices, for the prompt the template made; with echo's logprobs (completions) each
    # listing keeps its own number of alternatives.
    messages = [{"role": "user", "content": "Say hello"}]
    chat_ids = json.loads(post(base + "/tokenize", {"messages": messages})[2])["tokens"]
    code, _, raw = post(base + "/v1/chat/completions", {"messages": messages, "max_tokens": 4, "temperature": 0,
                                                        "n": 2, "prompt_logprobs": 0})
    assert code == 200, raw
    chat = json.loads(raw)
    assert len(chat["choices"]) == 2 and "prompt_logprobs" not in chat["choices"][0]
    by_ids = json.loads(post(base + "/v1/completions", {"prompt": chat_ids, "max_tokens": 1, "temperature": 0,
                                                        "echo": True, "logprobs": 1, "prompt_logprobs": 0})[2])
    assert chat["prompt_logprobs"] == logprobs_close(by_ids["choices"][0]["prompt_logprobs"])
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])  # 0 alternatives: the token alone
    echo_tops = by_ids["choices"][0]["logprobs"]["top_logprobs"][1:len(chat_ids)]
    assert all(len(top) in (1, 2) for top in echo_tops)  # echo's logprobs 1: the token and the likeliest
    assert [e for e in by_ids["choices"][0]["logprobs"]["token_logprobs"][1:len(chat_ids)]] == \
        logprobs_close([next(iter(entry.values()))["logprob"] for entry in chat["prompt_logprobs"][1:]])
    # asked for nothing: no field
    assert "prompt_logprobs" not in plain["choices"][0] and "prompt_logprobs" not in plain
    for body, message in (({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs are not available when stream "
                                                                    "is true"),
                          ({"prompt_logprobs": 21}, "prompt_logprobs must be between 0 and 20, got 21"),
                          ({"prompt_logprobs": -1}, "prompt_logprobs must be between 0 and 20, got -1")):
        code, _, raw = post(base + "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, **body})
        error = json.loads(raw)["error"]
        assert code == 400 and error["message"].startswith(message) and error["param"] == "prompt_logprobs", raw
