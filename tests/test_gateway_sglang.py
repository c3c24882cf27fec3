"""SGLang's native API on the gateway (gateway.sglang): POST /generate served as the OpenAI
completion it amounts to — the same text as /v1/completions and `specctl generate` — in
SGLang's shape (text, output_ids, meta_info with finish_reason's type and matched), one, a
batch, n choices, or streamed (the text so far, then [DONE]); its mapping and refusals exactly."""

import json

import pytest
import regex

from specctl.engine.tiny import make_byte_tokenizer
from specctl.gateway.api import ApiError
from specctl.gateway.sglang import parse_generate
from tests.conftest import logprobs_close
from tests.test_gateway import PROMPT, post, specctl_generate


def _parsed(body: dict, context: int = 64):
    return parse_generate(json.dumps(body).encode(), make_byte_tokenizer(), context, "m")


def test_a_generate_request_is_the_completion_it_amounts_to_with_sglang_s_defaults():
    tokenizer = make_byte_tokenizer()
    req, reply = _parsed({"text": "ab"})
    assert (req.prompt, req.max_tokens, req.temperature, req.top_p, req.top_k, req.min_p, req.n, req.stream) == (
        tokenizer.encode("ab"), 128, 1.0, 1.0, -1, 0.0, 1, False)
    assert (reply.prompt_tokens, reply.n, reply.listed) == ([2], 1, False)
    req, reply = _parsed({"input_ids": [[5, 6, 7], [8]], "stream": True, "rid": "r1", "sampling_params": {
        "max_new_tokens": None, "temperature": 0, "stop": "\n", "stop_token_ids": [9], "n": 2, "min_new_tokens": 3,
        "regex": "[ab]+", "no_stop_trim": True, "sampling_seed": 4, "repetition_penalty": 1.1}})
    assert (req.prompt, req.max_tokens, req.temperature, req.stop, req.stop_token_ids, req.n, req.min_tokens,
            req.guided_regex, req.include_stop_str_in_output, req.seed, req.repetition_penalty, req.stream,
            req.request_id) == ([[5, 6, 7], [8]], 61, 0, "\n", [9], 2, 3, "[ab]+", True, 4, 1.1, True, "r1")
    assert (reply.prompt_tokens, reply.n, reply.listed) == ([3, 1], 2, True)
    assert _parsed({"text": "x", "sampling_params": {"json_schema": '{"type": "object"}'}})[0].guided_json == {
        "type": "object"}
    for body, message, param in (
            ({}, "give text or input_ids (one of them)", "text"),
            ({"text": "x", "input_ids": [1]}, "give text or input_ids (one of them)", "text"),
            ({"text": "x", "return_logprob": True, "logprob_start_len": 0, "stream": True},
             "the input's logprobs (logprob_start_len >= 0) are answered whole here: send stream false, or "
             "logprob_start_len -1 for the output's alone", "logprob_start_len"),
            ({"text": ""}, "the prompt is empty", "text"),
            ({"input_ids": [1, [2]]}, "input_ids is one prompt's token ids or a list of them", "input_ids"),
            ({"text": "x", "sampling_params": {"json_schema": "{"}},
             "sampling_params.json_schema is not JSON: Expecting property name enclosed in double quotes: line 1 "
             "column 2 (char 1)", "sampling_params")):
        with pytest.raises(ApiError) as refused:
            _parsed(body)
        assert (refused.value.status, str(refused.value), refused.value.param) == (400, message, param)


def test_generate_is_the_targets_text_in_sglang_s_shape_one_batched_and_streamed(cluster, tiny_dir):
    url = cluster[1]["gateway"]
    reference = specctl_generate(tiny_dir, PROMPT, 20)
    status, _, body = post(url + "/generate", {"text": PROMPT, "rid": "req-7",
                                               "sampling_params": {"max_new_tokens": 20, "temperature": 0}})
    out = json.loads(body)
    assert status == 200 and (out["text"], out["output_ids"]) == (reference["text"], reference["token_ids"])
    meta = out["meta_info"]
    n = len(reference["token_ids"])
    assert (meta["id"], meta["prompt_tokens"], meta["completion_tokens"]) == (
        "req-7", len(make_byte_tokenizer().encode(PROMPT)), n)
    assert meta["finish_reason"] == ({"type": "length", "length": 20} if n == 20 else
                                     {"type": "stop", "matched": make_byte_tokenizer().eos_token_id})
    assert meta["spec_verify_ct"] >= 1 and meta["spec_accept_length"] >= 1.0
    # a stop string is matched by name; a stop token id by its id
    word = reference["text"][8:11]
    status, _, body = post(url + "/generate", {"text": PROMPT, "sampling_params": {
        "max_new_tokens": 20, "temperature": 0, "stop": word}})
    cut = json.loads(body)
    assert (cut["text"], cut["meta_info"]["finish_reason"]) == (
        reference["text"][: reference["text"].index(word)], {"type": "stop", "matched": word})
    token = reference["token_ids"][3]
    k = reference["token_ids"].index(token)
    status, _, body = post(url + "/generate", {"text": PROMPT, "sampling_params": {
        "max_new_tokens": 20, "temperature": 0, "stop_token_ids": [token]}})
    ended = json.loads(body)
    assert (ended["output_ids"], ended["meta_info"]["finish_reason"]) == (
        reference["token_ids"][:k], {"type": "stop", "matched": token})
    # streamed: each event the text so far, the last with the finish, then [DONE]
    status, headers, body = post(url + "/generate", {"text": PROMPT, "stream": True,
                                                     "sampling_params": {"max_new_tokens": 20, "temperature": 0}})
    lines = [line for line in body.decode().splitlines() if line.startswith("data: ")]
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert status == 200 and headers["Content-Type"] == "text/event-stream" and lines[-1] == "data: [DONE]"
    assert all(b["text"].startswith(a["text"]) for a, b in zip(events, events[1:]))
    assert (events[-1]["text"], events[-1]["output_ids"]) == (reference["text"], reference["token_ids"])
    assert [e["meta_info"]["finish_reason"] is None for e in events] == [True] * (len(events) - 1) + [False]
    # a batch (text, or token ids) and n choices: a list, each as /v1/completions answers it
    status, _, body = post(url + "/generate", {"input_ids": [[3, 17, 42], [7, 8, 9, 10]],
                                               "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    batch = json.loads(body)
    alone = [json.loads(post(url + "/v1/completions", {"prompt": p, "max_tokens": 8, "temperature": 0})[2])
             for p in ([3, 17, 42], [7, 8, 9, 10])]
    assert [b["text"] for b in batch] == [a["choices"][0]["text"] for a in alone]
    assert [b["meta_info"]["prompt_tokens"] for b in batch] == [3, 4]
    status, _, body = post(url + "/generate", {"text": PROMPT, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "n": 2}})
    assert status == 200 and [o["text"] for o in json.loads(body)] == [reference["text"][:len(o["text"])]
                                                                       for o in json.loads(body)]


def test_return_logprob_gives_the_targets_logprobs_as_completions_do(cluster):
    url = cluster[1]["gateway"]
    # the prompt's KV stored first: every request below restores it (an fp32 target's restored prefix differs
    # from a fresh prefill by ~1e-7); their logprobs still agree only to ~1e-6, rounded by verification widths
    post(url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "temperature": 0})
    body = {"text": PROMPT, "return_logprob": True, "top_logprobs_num": 3, "logprob_start_len": 0,
            "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    meta = json.loads(post(url + "/generate", body)[2])["meta_info"]
    openai = json.loads(post(url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                                       "logprobs": 3, "prompt_logprobs": 3})[2])["choices"][0]
    output = meta["output_token_logprobs"]
    assert [lp for lp, _, _ in output] == logprobs_close(openai["logprobs"]["token_logprobs"])
    assert [text for _, _, text in output] == openai["logprobs"]["tokens"]
    assert [sorted(lp for lp, _, _ in top) for top in meta["output_top_logprobs"]] == logprobs_close([
        sorted(top.values()) for top in openai["logprobs"]["top_logprobs"]])
    prompt = meta["input_token_logprobs"]
    assert len(prompt) == meta["prompt_tokens"] and prompt[0][0] is None and meta["input_top_logprobs"][0] is None
    assert [lp for lp, _, _ in prompt[1:]] == logprobs_close([  # vLLM's prompt_logprobs: {token id: {logprob, ...}}
        scored[str(token)]["logprob"] for scored, (_, token, _) in zip(openai["prompt_logprobs"][1:], prompt[1:])])
    # max_new_tokens 0: the prompt read only (scoring a text, as RL and eval code ask SGLang for)
    scored = json.loads(post(url + "/generate", {**body, "sampling_params": {"max_new_tokens": 0}})[2])
    assert (scored["text"], scored["output_ids"], scored["meta_info"]["completion_tokens"]) == ("", [], 0)
    assert scored["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert scored["meta_info"]["input_token_logprobs"] == logprobs_close(prompt)
    assert scored["meta_info"]["output_token_logprobs"] == []
    status, _, refused = post(url + "/generate", {**body, "sampling_params": {"max_new_tokens": -1}})
    assert status == 400 and json.loads(refused)["error"]["message"] == "max_new_tokens must be at least 0, got -1"
    # from a later position only; without the input's, streamed, each event carries the output's so far
    later = json.loads(post(url + "/generate", {**body, "logprob_start_len": 2})[2])["meta_info"]
    assert later["input_token_logprobs"] == logprobs_close(prompt[2:])
    events = [json.loads(line[6:]) for line in post(url + "/generate", {**body, "logprob_start_len": -1,
                                                                        "stream": True})[2].decode().splitlines()
              if line.startswith("data: {")]
    assert events[-1]["meta_info"]["output_token_logprobs"] == logprobs_close(output)
    assert "input_token_logprobs" not in events[-1]["meta_info"]


def test_bad_generate_requests_are_400s_and_model_info_names_the_model(cluster):
    url = cluster[1]["gateway"]
    for sent, message in ((b"{not json", "not valid JSON"), ({"sampling_params": {}}, "give text or input_ids"),
                          ({"text": "x", "sampling_params": {"temperature": -1}}, "temperature must be"),
                          ({"text": "x", "sampling_params": {"ebnf": "root ::= ("}},
                           "structured output (grammar) is invalid"),
                          ({"input_ids": [10 ** 7]}, "target instance: prompt token ids must be in [0, ")):
        status, _, body = post(url + "/generate", sent)
        assert status == 400 and message in json.loads(body)["error"]["message"], body
    import urllib.request

    with urllib.request.urlopen(url + "/get_model_info", timeout=30) as response:
        info = json.loads(response.read())
    assert info["is_generation"] is True and info["model_path"] and info["max_model_len"] > 0


@pytest.mark.parametrize("body, message, param", [
    ({"text": "x", "image_data": "https://example.com/a.png"}, "image_data is not served here: specctl serves text "
     "prompts: leave it out", "image_data"),
    ({"input_embeds": [[0.1, 0.2]]}, "input_embeds is not served here: give text or input_ids", "input_embeds"),
    ({"text": "x", "lora_path": "adapter"}, "lora_path is not served here: specctl serves the target's own weights, "
     "no LoRA adapter", "lora_path"),
    ({"text": "x", "custom_logit_processor": "{}"}, "custom_logit_processor is not served here: it would run code "
     "sent with the request; leave it out", "custom_logit_processor"),
    ({"text": "x", "sampling_params": {"structural_tag": "{}"}}, "sampling_params.structural_tag is not served here: "
     "give json_schema, regex or ebnf", "sampling_params"),
])
def test_what_specctl_does_not_serve_is_refused_never_answered_without_it(body, message, param):
    with pytest.raises(ApiError) as refused:
        _parsed(body)
    assert (refused.value.status, str(refused.value), refused.value.param) == (400, message, param)


def test_stop_regex_ends_the_text_with_its_first_match_on_generate_and_the_openai_routes(cluster, tiny_dir):
    """SGLang's stop_regex: the target's text up to the end of the pattern's first match (the
    match kept), matched naming the pattern — streamed or whole, /generate or /v1/completions
    (vLLM's stop_reason); a bad pattern is a 400 naming it."""
    from tests.test_stop_regex import reference

    url = cluster[1]["gateway"]
    text = specctl_generate(tiny_dir, PROMPT, 24)["text"]
    piece = next(text[i : i + 2] for i in range(4, len(text) - 1) if "\ufffd" not in text[i : i + 2])
    patterns = [regex.escape(piece), r"\d{3}"]
    want, matched = reference(text, patterns)
    assert matched is not None and len(want) < len(text)
    out = json.loads(post(url + "/generate", {"text": PROMPT, "sampling_params": {
        "max_new_tokens": 24, "temperature": 0, "stop_regex": patterns}})[2])
    assert (out["text"], out["meta_info"]["finish_reason"]) == (want, {"type": "stop", "matched": matched})
    _, _, body = post(url + "/generate", {"text": PROMPT, "stream": True, "sampling_params": {
        "max_new_tokens": 24, "temperature": 0, "stop_regex": patterns}})
    events = [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: {")]
    assert all(e["text"] == want[: len(e["text"])] for e in events) and events[-1]["text"] == want
    choice = json.loads(post(url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                                                       "stop_regex": patterns})[2])["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (want, "stop", matched)
    for route, body in (("/generate", {"text": PROMPT, "sampling_params": {"stop_regex": "a("}}),
                        ("/v1/completions", {"prompt": PROMPT, "stop_regex": ["a("]})):
        status, _, refused = post(url + route, body)
        error = json.loads(refused)["error"]
        assert (status, error["message"], error["param"]) == (
            400, "stop_regex 'a(' is not a valid regular expression: missing ) at position 2", "stop_regex")


def test_recent_rate_is_the_tokens_a_second_over_the_last_polls():
    from specctl.gateway.role_stats import recent_rate

    samples = [(0.0, 0), (5.0, 100), (10.0, 300), (12.0, 340)]
    assert recent_rate(samples, now=12.0) == (340 - 100) / (12.0 - 5.0)  # the poll at 0 s is out of the 10 s
    assert recent_rate(samples, now=30.0) == 0.0  # nothing in the last 10 s
    assert recent_rate([(1.0, 5)], now=1.0) == 0.0  # one poll: no rate yet
    assert recent_rate([(1.0, 50), (2.0, 3)], now=2.0) == 0.0  # a restarted instance counts from 0 again


def test_server_info_gives_each_target_s_accept_length_as_sglang_s_bench_serving_reads_it(cluster):
    """SGLang's GET /get_server_info (and /server_info): per target instance, internal_states with
    the mean accepted length its stats report and its generation throughput over the last 10 s."""
    import urllib.request

    from tests.conftest import poll_until

    url = cluster[1]["gateway"]
    status, _, body = post(url + "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 24,
                                                                                  "temperature": 0}})
    assert status == 200, body

    def fetch(path: str) -> dict:
        with urllib.request.urlopen(url + path, timeout=30) as response:
            return json.loads(response.read())

    info = poll_until(lambda: fetch("/get_server_info"),
                      lambda got: any(state["last_gen_throughput"] > 0 for state in got["internal_states"]))
    feed = {target["address"]: target for target in fetch("/v1/stats")["targets"]}
    assert [state["address"] for state in info["internal_states"]] == list(feed)  # every instance, in order
    served = [state for state in info["internal_states"] if state["last_gen_throughput"] > 0]
    assert served and all(state["up"] for state in served)
    for state in served:
        assert state["avg_spec_accept_length"] == feed[state["address"]]["stats"]["mean_accepted_length"] >= 1.0
    assert info["model_path"] == fetch("/get_model_info")["model_path"] and info["context_length"] > 0
    assert [s["address"] for s in fetch("/server_info")["internal_states"]] == list(feed)
