"""llama.cpp's own completion API on the gateway (gateway.llama): POST /completion served as
the OpenAI completion it amounts to — the same text as /v1/completions and `specctl
generate` — in llama.cpp's answer shape, whole, as a list, or streamed; its prompt shapes,
option mapping and refusals exactly."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specctl.engine.tiny import make_byte_tokenizer
from specctl.gateway.api import ApiError
from specctl.gateway.llama import (
    LlamaCompletionRequest,
    completion_request,
    llama_prompts,
    openai_bias,
)
from specctl.gateway.llama_reply import indent_cut, selected
from tests.conftest import logprobs_close
from tests.test_gateway import PROMPT, post, specctl_generate, target_text


def _events(body: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: ")]


def test_prompts_come_as_text_ids_mixed_or_a_list_of_them():
    tokenizer = make_byte_tokenizer()
    text = tokenizer.encode("ab")
    assert llama_prompts("ab", tokenizer, 64) == ([text], False)
    assert llama_prompts([5, 6], tokenizer, 64) == ([[5, 6]], False)
    assert llama_prompts([5, "ab", 6], tokenizer, 64) == ([[5, *text, 6]], False)
    assert llama_prompts(["ab", "ab"], tokenizer, 64) == ([text, text], True)
    assert llama_prompts([[5, "ab"], "ab"], tokenizer, 64) == ([[5, *text], text], True)
    for prompt, message in (([5, [6]], "a list of prompts holds strings or lists, not bare token ids"),
                            ([], "the prompt is empty"), ("", "the prompt is empty"),
                            (["x"] * 129, "at most 128 prompts a request, got 129")):
        with pytest.raises(ApiError) as refused:
            llama_prompts(prompt, tokenizer, 64)
        assert (refused.value.status, str(refused.value), refused.value.param) == (400, message, "prompt")


def test_options_map_to_the_completion_with_llama_cpp_s_defaults_and_refusals():
    req = completion_request(LlamaCompletionRequest(prompt="x"), [[1, 2, 3], [1]], 64)
    assert (req.prompt, req.max_tokens, req.temperature, req.top_k, req.top_p, req.min_p, req.seed, req.stop,
            req.repetition_penalty, req.stream) == ([[1, 2, 3], [1]], 61, 0.8, 40, 0.95, 0.05, None, None, 1.0, False)
    asked = LlamaCompletionRequest(prompt="x", n_predict=7, seed=5, stop=["\n"], repeat_penalty=1.2, stream=True,
                                   grammar='root ::= "a"', ignore_eos=True, model="m")
    req = completion_request(asked, [[1]], 64)
    assert (req.prompt, req.max_tokens, req.seed, req.stop, req.repetition_penalty, req.stream, req.guided_grammar,
            req.ignore_eos, req.model) == ([1], 7, 5, ["\n"], 1.2, True, 'root ::= "a"', True, "m")
    assert completion_request(LlamaCompletionRequest(prompt="x", json_schema={"type": "object"}), [[1]], 64
                              ).guided_json == {"type": "object"}
    # the samplers not served, sent at their "off" values as llama.cpp's clients send them: served
    completion_request(LlamaCompletionRequest(prompt="x", typical_p=1.0, mirostat=0, dry_multiplier=0.0,
                                              xtc_probability=0.0, dynatemp_range=0.0, top_n_sigma=-1.0), [[1]], 64)
    for fields, message, param in (
            ({"n_predict": -2}, "n_predict must be -1 (to the end of the context), 0 (evaluate the prompt only) or "
                                "more, got -2", "n_predict"),
            ({"n_probs": 21}, "n_probs must be between 0 and 20, got 21", "n_probs"),
            ({"grammar": "root ::= \"a\"", "json_schema": {}}, "give grammar or json_schema, not both", "grammar"),
            ({"mirostat": 2}, "mirostat 2 asks for Mirostat, which specctl does not serve: leave it out (or 0); "
                              "temperature, top_k, top_p, min_p, the penalties, logit_bias and grammars are served",
             "mirostat"),
            ({"typical_p": 0.9}, "typical_p 0.9 asks for locally typical sampling, which specctl does not serve: "
                                 "leave it out (or 1.0); temperature, top_k, top_p, min_p, the penalties, logit_bias "
                                 "and grammars are served", "typical_p"),
            *((({name: value}, f"{name} {value} asks for {sampler}, which specctl does not serve: leave it out (or "
                                 f"{off}); temperature, top_k, top_p, min_p, the penalties, logit_bias and grammars "
                                 "are served", name))
              for name, value, sampler, off in (("dry_multiplier", 0.8, "DRY", 0.0), ("xtc_probability", 0.5, "XTC", 0.0),
                                                ("dynatemp_range", 0.3, "dynamic temperature", 0.0),
                                                ("top_n_sigma", 1.5, "top-n-sigma", -1.0)))):
        with pytest.raises(ApiError) as refused:
            completion_request(LlamaCompletionRequest(prompt="x", **fields), [[1]], 64)
        assert (refused.value.status, str(refused.value), refused.value.param) == (400, message, param)


def test_penalties_count_the_last_repeat_last_n_tokens_as_llama_cpp_s_do(cluster, tiny_dir):
    """repeat_penalty, presence_penalty and frequency_penalty over the text's last repeat_last_n
    tokens (64 unless given), the prompt's included: the target's own text with that window,
    through the star (the draft follows the same window); 0 turns the penalties off, -1 counts
    the whole text."""
    from specctl.engine.loader import load_decoder
    from specctl.spec.params import SamplingParams
    from specctl.spec.rounds import generate

    url = cluster[1]["gateway"]
    ids = json.loads(post(url + "/tokenize", {"prompt": PROMPT})[2])["tokens"]
    penalties = {"presence_penalty": 0.5, "frequency_penalty": 0.4, "repeat_penalty": 1.6}
    target = load_decoder(tiny_dir["llama"])

    def served(**options) -> dict:
        status, _, body = post(url + "/completion", {"prompt": ids, "n_predict": 16, "temperature": 0,
                                                     "ignore_eos": True, **penalties, **options})
        assert status == 200, body
        return json.loads(body)

    def alone(window: int, on: bool = True) -> str:
        params = SamplingParams(max_tokens=16, ignore_eos=True, penalty_last_n=window,
                                **({"presence_penalty": 0.5, "frequency_penalty": 0.4, "repetition_penalty": 1.6}
                                   if on else {}))
        return target_text(tiny_dir, generate(target, ids, params)[0])

    answer = served(repeat_last_n=4)
    assert answer["content"] == alone(4) != alone(0)  # the window bites
    assert answer["generation_settings"]["repeat_last_n"] == 4
    assert served()["content"] == alone(64) and served()["generation_settings"]["repeat_last_n"] == 64
    assert served(repeat_last_n=0)["content"] == alone(0, on=False)
    assert served(repeat_last_n=-1)["content"] == alone(4096 * 64)  # past the context: the whole text
    status, _, body = post(url + "/completion", {"prompt": ids, "repeat_last_n": -2})
    assert status == 400 and json.loads(body)["error"]["message"] == (
        "repeat_last_n must be -1 (the whole text), 0 (no penalties) or more, got -2")


def test_logit_bias_comes_as_pairs_or_a_map_and_false_bans():
    assert openai_bias([[5, 1.5], [7, False]]) == {"5": 1.5, "7": -100.0}
    assert openai_bias({"9": 2, "3": False}) == {"9": 2.0, "3": -100.0}
    assert openai_bias(None) is None and openai_bias([]) is None
    for bias, message in (([["Hello", 1.0]], "logit_bias by text ('Hello') is not served here: give token ids "
                                             "(POST /tokenize turns text into them)"),
                          ([[5]], "logit_bias entries are [token id, bias or false]"),
                          ([[5, None]], "a logit_bias is a number or false, got null"),
                          ([[None, False]], "a logit_bias token is a token id, got null"),
                          ([[True, 1]], "a logit_bias token is a token id, got true"),
                          ({"5": True}, "a logit_bias is a number or false, got true")):
        with pytest.raises(ApiError) as refused:
            openai_bias(bias)
        assert (refused.value.status, str(refused.value)) == (400, message)


def test_completion_is_the_targets_text_in_llama_cpp_s_shape_whole_listed_and_streamed(cluster, tiny_dir):
    url = cluster[1]["gateway"]
    reference = specctl_generate(tiny_dir, PROMPT, 20)
    status, _, body = post(url + "/completion", {"prompt": PROMPT, "n_predict": 20, "temperature": 0,
                                                 "return_tokens": True, "cache_prompt": True})
    answer = json.loads(body)
    assert status == 200 and (answer["content"], answer["tokens"]) == (reference["text"], reference["token_ids"])
    assert (answer["stop"], answer["stop_type"], answer["stopping_word"], answer["tokens_predicted"],
            answer["tokens_evaluated"]) == (True, "limit" if len(reference["token_ids"]) == 20 else "eos", "",
                                            len(reference["token_ids"]), len(make_byte_tokenizer().encode(PROMPT)))
    assert answer["generation_settings"]["n_predict"] == 20 and answer["timings"]["predicted_n"] == 20
    # a stop word cuts the text and is named; /completions is the same endpoint
    word = reference["text"][8:11]
    status, _, body = post(url + "/completions", {"prompt": PROMPT, "n_predict": 20, "temperature": 0,
                                                  "stop": [word]})
    cut = json.loads(body)
    assert (cut["content"], cut["stop_type"], cut["stopping_word"]) == (
        reference["text"][: reference["text"].index(word)], "word", word)
    # streamed: the text as it comes, the whole answer last, no [DONE]
    status, headers, body = post(url + "/completion", {"prompt": PROMPT, "n_predict": 20, "temperature": 0,
                                                       "stream": True})
    events = _events(body)
    assert status == 200 and headers["Content-Type"] == "text/event-stream" and b"[DONE]" not in body
    assert "".join(e["content"] for e in events) == reference["text"]
    assert sum((e["tokens"] for e in events[:-1]), []) == reference["token_ids"]
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert events[-1]["tokens_predicted"] == len(reference["token_ids"])
    assert events[-1]["has_new_line"] == answer["has_new_line"] == ("\n" in reference["text"])
    # a list of prompts (text and token ids) is answered as a list, each as /v1/completions answers it alone
    ids = [3, 17, 42, 99]
    status, _, body = post(url + "/completion", {"prompt": [PROMPT, ids], "n_predict": 12, "temperature": 0})
    listed = json.loads(body)
    alone = [json.loads(post(url + "/v1/completions", {"prompt": p, "max_tokens": 12, "temperature": 0})[2])
             for p in (PROMPT, ids)]
    assert status == 200 and [a["index"] for a in listed] == [0, 1]
    assert [a["content"] for a in listed] == [a["choices"][0]["text"] for a in alone]


def test_a_gbnf_grammar_holds_the_output_and_bad_requests_are_400s(cluster):
    url = cluster[1]["gateway"]
    status, _, body = post(url + "/completion", {"prompt": PROMPT, "n_predict": 16, "temperature": 0,
                                                 "grammar": 'root ::= "yes" | "no"'})
    answer = json.loads(body)
    assert status == 200 and answer["content"] in ("yes", "no") and answer["stop_type"] == "eos", body
    for sent, message in ((b"{not json", "not valid JSON"), ({"n_predict": 4}, "missing required field `prompt`"),
                          ({"prompt": "x", "n_probs": -1}, "n_probs must be between 0 and 20, got -1"),
                          ({"prompt": "x", "grammar": "root ::= ("}, "structured output (grammar) is invalid"),
                          ({"prompt": "x", "temperature": -1}, "temperature must be")):
        status, _, body = post(url + "/completion", sent)
        assert status == 400 and message in json.loads(body)["error"]["message"], body
    status, _, body = post(url + "/completion", {"prompt": "x", "model": "nope"})
    assert status == 404 and json.loads(body)["error"]["param"] == "model"


def test_indent_cut_ends_at_the_first_later_line_indented_less_and_fields_are_selected_by_path():
    assert indent_cut("x = 1\n    y = 2\n  z\n", 4) == 18  # "  z": cut where its content starts
    assert indent_cut("x = 1\n    y = 2\n", 4) is None  # every later line indented enough
    assert indent_cut("x\n\n    y", 4) == 2  # an empty line ends it too, as in llama.cpp
    assert indent_cut("first line only, however indented", 8) is None
    assert indent_cut("a\n\tb", 1) is None  # a tab counts one
    body = {"content": "c", "timings": {"prompt_n": 3, "predicted_n": 4}, "stop": True}
    assert selected(body, ["content", "timings/prompt_n", "timings/nope", "", "stop"]) == {
        "content": "c", "timings/prompt_n": 3, "stop": True}
    assert selected(body, None) is body and selected(body, [""]) == {}


def test_editor_plugin_rules_n_indent_t_max_predict_ms_n_predict_0_and_response_fields(cluster):
    from tests.conftest import poll_until

    url = cluster[1]["gateway"]
    newline = str(make_byte_tokenizer().encode("\n")[0])
    base = {"prompt": PROMPT, "n_predict": 32, "temperature": 0, "ignore_eos": True, "logit_bias": {newline: 4.0}}
    reference = json.loads(post(url + "/completion", base)[2])["content"]
    cut = indent_cut(reference, 4)
    assert cut is not None, repr(reference)  # the newline bias makes later lines
    indented = json.loads(post(url + "/completion", {**base, "n_indent": 4})[2])
    assert (indented["content"], indented["stop_type"]) == (reference[:cut], "limit")
    long = json.loads(post(url + "/completion", {**base, "n_predict": 400, "n_indent": 4})[2])
    assert long["content"] == reference[:cut]  # ended by the rule, not run to 400 tokens: nothing left running
    poll_until(lambda: sum(t.active for t in cluster[0].cluster.targets), lambda active: active == 0, timeout=10)
    timed = json.loads(post(url + "/completion", {**base, "t_max_predict_ms": 0.001})[2])
    assert reference.startswith(timed["content"]) and "\n" in timed["content"] and timed["stop_type"] == "limit"
    assert len(timed["content"]) < len(reference)
    # streamed, the rules cut the same text
    events = _events(post(url + "/completion", {**base, "n_indent": 4, "stream": True})[2])
    assert "".join(e["content"] for e in events) == reference[:cut] and events[-1]["stop_type"] == "limit"
    # n_predict 0: the prompt evaluated (into the prefix cache), nothing handed out
    prompt = PROMPT + " jumps over the lazy dog, again and again"
    warmed = json.loads(post(url + "/completion", {"prompt": prompt, "n_predict": 0})[2])
    assert (warmed["content"], warmed["tokens_predicted"], warmed["stop_type"]) == ("", 0, "limit")
    again = json.loads(post(url + "/completion", {"prompt": prompt, "n_predict": 2, "temperature": 0})[2])
    assert again["tokens_cached"] > 0
    # response_fields: only those, "timings/..." under its path (llama.vim reads them so)
    fields = ["content", "timings/prompt_n", "timings/predicted_n", "tokens_cached", ""]
    trimmed = json.loads(post(url + "/completion", {**base, "n_predict": 4, "response_fields": fields})[2])
    assert set(trimmed) == {"content", "timings/prompt_n", "timings/predicted_n", "tokens_cached"}
    assert trimmed["timings/predicted_n"] == 4


def test_llama_cpp_s_tokenize_detokenize_apply_template_and_props(cluster, tiny_dir):
    import urllib.request

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_dir["llama"]))
    url = cluster[1]["gateway"]
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    assert json.loads(post(url + "/tokenize", {"content": PROMPT})[2]) == {"tokens": ids}
    pieces = json.loads(post(url + "/tokenize", {"content": PROMPT, "with_pieces": True})[2])["tokens"]
    assert pieces == [{"id": i, "piece": tokenizer.decode([i])} for i in ids]
    assert json.loads(post(url + "/detokenize", {"tokens": ids})[2])["content"] == tokenizer.decode(ids)
    # apply-template renders what chat completions encode: completing that text is the chat's answer
    messages = [{"role": "user", "content": PROMPT}]
    status, _, body = post(url + "/apply-template", {"messages": messages})
    prompt = json.loads(body)["prompt"]
    assert status == 200 and prompt == tokenizer.apply_chat_template(messages, tokenize=False,
                                                                     add_generation_prompt=True)
    completed = json.loads(post(url + "/completion", {"prompt": prompt, "n_predict": 8, "temperature": 0})[2])
    chat = json.loads(post(url + "/v1/chat/completions", {"messages": messages, "max_tokens": 8,
                                                          "temperature": 0})[2])
    assert completed["content"] == chat["choices"][0]["message"]["content"]
    status, _, body = post(url + "/apply-template", {"messages": []})
    assert status == 400 and json.loads(body)["error"]["message"] == "messages must not be empty"
    with urllib.request.urlopen(url + "/props", timeout=30) as response:
        props = json.loads(response.read())
    assert props["default_generation_settings"]["n_ctx"] == 512 and props["total_slots"] == 32
    assert props["default_generation_settings"]["params"]["temperature"] == 0.8
    assert props["chat_template"] == tokenizer.chat_template


def test_n_probs_lists_the_targets_alternatives_as_completions_logprobs_do(cluster):
    import math

    url = cluster[1]["gateway"]
    # the prompt's KV stored first: every request below restores it (an fp32 target's restored prefix differs
    # from a fresh prefill by ~1e-7); their logprobs still agree only to ~1e-6, rounded by verification widths
    post(url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "temperature": 0})
    body = {"prompt": PROMPT, "n_predict": 8, "temperature": 0, "n_probs": 3}
    answer = json.loads(post(url + "/completion", body)[2])
    openai = json.loads(post(url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                                       "logprobs": 3})[2])["choices"][0]["logprobs"]
    probabilities = answer["completion_probabilities"]
    assert [p["logprob"] for p in probabilities] == logprobs_close(openai["token_logprobs"])
    assert [p["token"] for p in probabilities] == openai["tokens"]
    assert [{t["token"]: t["logprob"] for t in p["top_logprobs"]} for p in probabilities] == \
        logprobs_close(openai["top_logprobs"])
    assert all(p["bytes"] == list(p["token"].encode()) for p in probabilities)
    as_probs = json.loads(post(url + "/completion", {**body, "post_sampling_probs": True})[2])
    assert [p["prob"] for p in as_probs["completion_probabilities"]] == [math.exp(lp) for lp in
                                                                         openai["token_logprobs"]]
    events = _events(post(url + "/completion", {**body, "stream": True})[2])
    assert sum((e.get("completion_probabilities", []) for e in events), []) == probabilities


@pytest.mark.parametrize("path, body", [
    ("/completion", {"prompt": [[]]}), ("/completion", {"prompt": [[1, []]]}), ("/completion", {"prompt": [None]}),
    ("/completion", {"prompt": "x", "logit_bias": [[1, None]]}), ("/completion", {"prompt": "x", "logit_bias": [[]]}),
    ("/completion", {"prompt": "x", "logit_bias": {"a": 1}}), ("/completion", {"prompt": "x", "stop": "\n"}),
    ("/completion", {"prompt": [-5]}), ("/completion", {"prompt": "x", "n_indent": -1}),
    ("/completion", {"prompt": "x", "response_fields": "content"}), ("/completion", {"prompt": "x", "top_k": -7}),
    ("/infill", {"input_extra": [{"text": 5}]}), ("/infill", {"input_prefix": None}),
    ("/generate", {"text": []}), ("/generate", {"input_ids": []}), ("/generate", {"input_ids": [[]]}),
    ("/generate", {"text": ["a", 1]}), ("/generate", {"text": "x", "sampling_params": {"n": 0}}),
    ("/generate", {"text": "x", "sampling_params": {"stop_token_ids": [-1]}}),
    ("/generate", {"text": "x", "sampling_params": 3}),
    ("/generate", {"text": "x", "return_logprob": True, "top_logprobs_num": 99}),
    ("/tokenize", {"content": 5}), ("/apply-template", {"messages": [{"role": "robot", "content": "x"}]}),
])
def test_malformed_native_requests_are_400s_naming_what_is_wrong(cluster, path, body):
    status, _, raw = post(cluster[1]["gateway"] + path, body)
    assert status == 400 and json.loads(raw)["error"]["message"], (status, raw)


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 300) | st.floats(allow_nan=False) | st.text(max_size=4),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
                     max_leaves=8)
_FIELDS = ["prompt", "n_predict", "logit_bias", "stop", "n_probs", "grammar", "json_schema", "n_indent",
           "t_max_predict_ms", "response_fields", "temperature", "input_prefix", "input_suffix", "input_extra", "text",
           "input_ids", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num", "seed"]


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(_FIELDS), _JSON, max_size=6))
def test_any_native_body_is_read_or_refused_with_a_400_never_an_exception(body):
    """What a client sends is arbitrary: each native endpoint's reader answers a request or a
    400 (ApiError), never another exception (a 500)."""
    from specctl.gateway.infill import parse_infill
    from specctl.gateway.llama import parse_completion
    from specctl.gateway.sglang import parse_generate

    tokenizer = make_byte_tokenizer()
    for parse, valid in ((parse_completion, {"prompt": "x"}), (parse_infill, {"input_prefix": "x"}),
                         (parse_generate, {"text": "x"})):
        try:
            parse(json.dumps({**valid, **body}).encode(), tokenizer, 64, "m")
        except ApiError as exc:
            assert exc.status == 400 and str(exc)
