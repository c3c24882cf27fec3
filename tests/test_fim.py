"""Fill in the middle (engine.fim): the prompt in the model's FIM tokens, their end tokens as
stop tokens, a model without them refused; through `generate --suffix` and the gateway's
completions ``suffix``, whose output is the target's own continuation of that prompt."""

import json

import pytest

from specctl.engine.fim import FimTokens, encode_infill, fim_tokens, infill_stops
from specctl.engine.tiny import make_byte_tokenizer
from specctl.errors import BadRequest
from tests.test_cli import _assert_one_line_error, run
from tests.test_gateway import post

PREFIX, SUFFIX = "def add(a, b):\n    ", "\n    return total\n"


class _Vocab:
    def __init__(self, tokens):
        self.vocab = {token: i for i, token in enumerate(tokens)}

    def get_vocab(self):
        return self.vocab


def test_each_family_s_tokens_are_found_with_the_end_tokens_its_vocabulary_holds():
    deepseek = _Vocab(["a", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", "<｜end▁of▁sentence｜>", "<|EOT|>"])
    assert fim_tokens(deepseek) == FimTokens(1, 2, 3, (4, 5))
    starcoder = _Vocab(["<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"])
    assert fim_tokens(starcoder) == FimTokens(1, 3, 2, (0, 4))
    codellama = _Vocab(["<s>", "▁<PRE>", "▁<SUF>", "▁<MID>", "▁<EOT>"])
    assert fim_tokens(codellama) == FimTokens(1, 2, 3, (4,))
    assert fim_tokens(_Vocab(["<fim_prefix>", "<fim_suffix>"])) is None  # no middle token: no family
    # Codestral's (suffix first, no middle token), with or without the [MIDDLE] a Tekken vocabulary holds
    assert fim_tokens(_Vocab(["<s>", "</s>", "[PREFIX]", "[SUFFIX]"])) == FimTokens(2, 3, None, (1,))
    assert fim_tokens(_Vocab(["<s>", "</s>", "[SUFFIX]", "[MIDDLE]", "[PREFIX]"])) == FimTokens(4, 2, None, (1,))


class _CharTokenizer(_Vocab):
    """A Mistral-like tokenizer: BOS 0 first where special tokens are added, each character its own id."""

    def encode(self, text, add_special_tokens=True):
        return [0] * add_special_tokens + [100 + ord(char) for char in text]


def test_codestral_s_prompt_is_the_suffix_then_the_prefix_which_the_middle_continues():
    tokenizer = _CharTokenizer(["<s>", "</s>", "[PREFIX]", "[SUFFIX]"])
    ids = lambda text: [100 + ord(char) for char in text]  # noqa: E731
    # mistral-common's encode_fim: <s> [SUFFIX] suffix [PREFIX] prefix
    assert encode_infill(tokenizer, "ab", "cd") == [0, 3, *ids("cd"), 2, *ids("ab")]
    assert encode_infill(tokenizer, "ab", "cd", "x = ") == [0, 3, *ids("cd"), 2, *ids("ab"), *ids("x = ")]
    assert encode_infill(tokenizer, [7, 8], "", files=[("lib.py", "z")]) == [  # other files before it all
        0, *ids("\n\n--- snippet ---\n\n"), *ids("z"), 3, 2, 7, 8]
    assert infill_stops(tokenizer, (9,)) == (9, 1)


def test_the_prompt_is_prefix_suffix_middle_in_the_model_s_tokens():
    tokenizer = make_byte_tokenizer()
    vocab = tokenizer.get_vocab()
    fim = fim_tokens(tokenizer)
    assert (fim.prefix, fim.suffix, fim.middle) == (vocab["<|fim_prefix|>"], vocab["<|fim_suffix|>"],
                                                    vocab["<|fim_middle|>"])
    assert infill_stops(tokenizer) == (vocab["<|endoftext|>"], vocab["<|fim_pad|>"], vocab["<|file_sep|>"],
                                       vocab["<|repo_name|>"])
    ids = encode_infill(tokenizer, PREFIX, SUFFIX)
    assert ids == [fim.prefix, *tokenizer.encode(PREFIX), fim.suffix, *tokenizer.encode(SUFFIX), fim.middle]
    assert encode_infill(tokenizer, [5, 6], "") == [fim.prefix, 5, 6, fim.suffix, fim.middle]  # ids as given
    assert infill_stops(tokenizer, (7, vocab["<|fim_pad|>"])) == (7, vocab["<|fim_pad|>"], vocab["<|endoftext|>"],
                                                                  vocab["<|file_sep|>"], vocab["<|repo_name|>"])


def test_a_model_without_fim_tokens_is_refused_with_what_would_do():
    with pytest.raises(BadRequest, match=r"^suffix needs a model trained to fill in the middle, whose vocabulary has "
                                         r"FIM tokens \(Qwen2.5-Coder, .*\); this one has none: leave suffix out$"):
        encode_infill(_Vocab(["a", "b"]), "x", "y")


def _infill(tiny_dir, mode, *extra):
    proc = run("generate", "--target", str(tiny_dir["llama"]), "--draft", str(tiny_dir["llama-draft"]), "--mode", mode,
               "--dtype", "fp32", "-p", PREFIX, "--suffix", SUFFIX, "-n", "16", "--json", *extra)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_generate_suffix_is_the_target_s_continuation_of_the_infill_prompt_in_every_mode(tiny_dir):
    from specctl.engine.loader import load_model
    from specctl.spec.params import SamplingParams
    from specctl.spec.rounds import generate

    model = load_model("llama", tiny_dir["llama"], "fp32")
    ids = encode_infill(model.tokenizer, PREFIX, SUFFIX)
    params = SamplingParams(max_tokens=16, stop_token_ids=infill_stops(model.tokenizer))
    reference, _, _ = generate(model.decoder, ids, params, eos_token_ids=model.eos_token_ids)
    plain, _, _ = generate(model.decoder, model.tokenizer.encode(PREFIX), params, eos_token_ids=model.eos_token_ids)
    assert reference != plain  # the suffix counts
    assert _infill(tiny_dir, "chain")["token_ids"] == reference
    _assert_one_line_error(run("generate", "--target", str(tiny_dir["llama"]), "-p", "x", "--suffix", "y", "--chat"),
                           "--suffix cannot go with --chat")


def test_completions_with_a_suffix_equal_generate_suffix_and_end_at_fim_tokens(cluster, client, tiny_dir):
    reference = _infill(tiny_dir, "ar")
    model = str(tiny_dir["llama"])
    infill = client.completions.create(model=model, prompt=PREFIX, suffix=SUFFIX, max_tokens=16, temperature=0)
    assert infill.choices[0].text == reference["text"]
    tokenizer = make_byte_tokenizer()
    assert infill.usage.prompt_tokens == len(encode_infill(tokenizer, PREFIX, SUFFIX))
    # a FIM end token made the likeliest: the infill ends at once, as at EOS
    pad = tokenizer.get_vocab()["<|fim_pad|>"]
    ended = client.completions.create(model=model, prompt=PREFIX, suffix=SUFFIX, max_tokens=16, temperature=0,
                                      logit_bias={str(pad): 100})
    assert (ended.choices[0].text, ended.choices[0].finish_reason, ended.usage.completion_tokens) == ("", "stop", 0)
    assert ended.choices[0].model_extra["stop_reason"] == pad  # vLLM's stop_reason: the token that ended it
    plain = client.completions.create(model=model, prompt=PREFIX, max_tokens=16, temperature=0,
                                      logit_bias={str(pad): 100})
    assert plain.usage.completion_tokens == 16  # without a suffix the padding token is just a token
    remote = run("generate", "--remote", cluster[1]["targets"][0], "-p", PREFIX, "--suffix", SUFFIX, "-n", "16",
                 "--json")
    assert remote.returncode == 0, remote.stderr
    assert json.loads(remote.stdout)["token_ids"] == reference["token_ids"]


@pytest.mark.parametrize("extra, param, message", [
    ({"echo": True}, "echo", "echo cannot go with suffix"),
    ({"truncate_prompt_tokens": 4}, "truncate_prompt_tokens", "truncate_prompt_tokens cannot go with suffix"),
])
def test_completions_refuse_what_cannot_go_with_a_suffix(cluster, tiny_dir, extra, param, message):
    status, _, body = post(cluster[1]["gateway"] + "/v1/completions",
                           {"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 4, **extra})
    error = json.loads(body)["error"]
    assert status == 400 and error["param"] == param and error["message"].startswith(message)


def test_bench_prompts_with_a_suffix_are_infills_and_every_mode_stops_at_their_end_tokens(tiny_dir, tmp_path):
    from specctl.bench.local import prompt_ids
    from specctl.bench.prompts import BenchPrompt, load_prompts
    from specctl.engine.loader import load_model
    from specctl.errors import ConfigError

    shipped = load_prompts("infill")
    assert len(shipped) == 12 and all(p.suffix and not p.chat for p in shipped)
    target = load_model("llama", tiny_dir["llama"], "fp32")
    ids, ends = prompt_ids(target, [BenchPrompt(PREFIX, False, "code", SUFFIX)])
    assert ids == [encode_infill(target.tokenizer, PREFIX, SUFFIX)]
    assert ends == tuple(dict.fromkeys((*target.eos_token_ids, *fim_tokens(target.tokenizer).stops)))
    assert prompt_ids(target, [BenchPrompt(PREFIX, False)])[1] == target.eos_token_ids  # no infill: EOS alone
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x", "suffix": "y", "chat": True}) + "\n")
    with pytest.raises(ConfigError, match=r'bad.jsonl:1: "suffix" is the text after an infill \(a string\), not with '
                                          r'"chat"$'):
        load_prompts(str(bad))
    out = tmp_path / "infill.json"
    proc = run("bench", "local", "--target", str(tiny_dir["llama"]), "--draft", str(tiny_dir["llama-draft"]),
               "--max-tokens", "8", "--limit", "2", "--modes", "ar,chain,suffix,hf-assisted", "--dtype", "fp32",
               "--prompts", "infill", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert all(result["outputs_equal_to_ar"] == 1.0 for result in report["modes"].values())  # transformers' too


class _WithoutRepoTokens:
    """A tokenizer whose vocabulary lacks the repository-level tokens."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def get_vocab(self):
        return {k: v for k, v in self.tokenizer.get_vocab().items() if k not in ("<|repo_name|>", "<|file_sep|>")}

    def encode(self, *args, **kwargs):
        return self.tokenizer.encode(*args, **kwargs)


def test_other_files_go_before_the_infill_in_the_repository_layout_or_after_separator_lines():
    tokenizer = make_byte_tokenizer()
    vocab, fim = tokenizer.get_vocab(), fim_tokens(tokenizer)
    repo, sep = vocab["<|repo_name|>"], vocab["<|file_sep|>"]
    files = [("util.py", "def helper():\n    pass\n"), ("main.py", "import util\n")]
    ids = encode_infill(tokenizer, PREFIX, SUFFIX, "total = ", files)
    encode = tokenizer.encode
    assert ids == [repo, *encode("myproject\n"), sep, *encode("util.py\n"), *encode(files[0][1]),
                   sep, *encode("main.py\n"), *encode(files[1][1]), sep, *encode("filename\n"),
                   fim.prefix, *encode(PREFIX), fim.suffix, *encode(SUFFIX), fim.middle, *encode("total = ")]
    plain = encode_infill(_WithoutRepoTokens(tokenizer), PREFIX, SUFFIX, "", files[:1])
    assert plain == [*encode("\n\n--- snippet ---\n\n"), *encode(files[0][1]), fim.prefix, *encode(PREFIX),
                     fim.suffix, *encode(SUFFIX), fim.middle]


def test_an_infill_request_is_the_completion_it_amounts_to_with_llama_cpp_s_defaults():
    from specctl.gateway.api import ApiError
    from specctl.gateway.infill import parse_infill

    tokenizer = make_byte_tokenizer()

    def parsed(body, vocabulary=tokenizer):
        return parse_infill(json.dumps(body).encode(), vocabulary, 512, "m")

    req, reply = parsed({"input_prefix": PREFIX, "input_suffix": SUFFIX})
    ids = encode_infill(tokenizer, PREFIX, SUFFIX)
    assert (req.prompt, req.max_tokens, req.temperature, req.top_k, req.top_p, req.min_p, req.seed, req.stop) == (
        ids, 512 - len(ids), 0.8, 40, 0.95, 0.05, None, None)
    assert req.stop_token_ids == list(infill_stops(tokenizer)) and reply.prompts == [ids] and not reply.listed
    given, _ = parsed({"input_prefix": "a", "n_predict": 5, "seed": 3, "stop": ["\n\n"], "temperature": 0})
    assert (given.max_tokens, given.seed, given.stop, given.temperature) == (5, 3, ["\n\n"], 0)
    with pytest.raises(ApiError) as refused:
        parsed({"n_predict": -2})
    assert (refused.value.status, refused.value.param) == (400, "n_predict")
    with pytest.raises(ApiError, match="this one has none: this endpoint cannot serve it$"):
        parsed({}, _Vocab(["a"]))


def test_the_infill_endpoint_answers_as_llama_cpp_with_the_targets_infill(cluster, tiny_dir):
    reference = _infill(tiny_dir, "ar")
    url = cluster[1]["gateway"]
    status, _, body = post(url + "/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 16,
                                             "temperature": 0, "n_indent": 4, "samplers": ["top_k", "infill"]})
    answer = json.loads(body)
    assert status == 200 and answer["content"] == reference["text"], body
    tokenizer = make_byte_tokenizer()
    assert answer["tokens_evaluated"] == len(encode_infill(tokenizer, PREFIX, SUFFIX))
    assert answer["tokens_predicted"] == len(reference["token_ids"]) and answer["stop"] is True
    # other files and the line's start: the same text as a completion of the prompt they lay out
    files = [{"filename": "util.py", "text": "def helper():\n    pass\n"}]
    status, _, body = post(url + "/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX, "prompt": "total",
                                             "input_extra": files, "n_predict": 12, "temperature": 0})
    ids = encode_infill(tokenizer, PREFIX, SUFFIX, "total", [("util.py", files[0]["text"])])
    _, _, same = post(url + "/v1/completions", {"prompt": ids, "max_tokens": 12, "temperature": 0,
                                                "stop_token_ids": list(infill_stops(tokenizer))})
    assert status == 200 and json.loads(body)["content"] == json.loads(same)["choices"][0]["text"]
    # streamed as llama.cpp streams: the text as it comes, then the whole answer's fields with stop true
    status, headers, body = post(url + "/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 16,
                                                   "temperature": 0, "stream": True})
    events = [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: ")]
    assert status == 200 and headers["Content-Type"] == "text/event-stream"
    assert "".join(e["content"] for e in events) == reference["text"]
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert sum((e["tokens"] for e in events[:-1]), []) == reference["token_ids"]
    assert (events[-1]["tokens_predicted"], events[-1]["stop_type"]) == (len(reference["token_ids"]), "limit")
    # llama.vim's two requests as it sends them: the extra context warmed (n_predict 0, no fields), then a FIM
    ring = {"input_prefix": "", "input_suffix": "", "input_extra": files, "prompt": "", "n_predict": 0,
            "temperature": 0.0, "stream": False, "samplers": [], "cache_prompt": True, "t_max_prompt_ms": 1,
            "t_max_predict_ms": 1, "response_fields": [""]}
    status, _, body = post(url + "/infill", ring)
    assert (status, json.loads(body)) == (200, {})
    fim = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": files, "prompt": "", "n_predict": 16,
           "n_indent": 0, "top_k": 40, "top_p": 0.99, "stream": False, "samplers": ["top_k", "top_p", "infill"],
           "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1500,
           "response_fields": ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
                               "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
                               "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated",
                               "tokens_cached"]}
    status, _, body = post(url + "/infill", fim)
    assert status == 200 and set(json.loads(body)) == set(fim["response_fields"]), body
    status, _, body = post(url + "/infill", b"{not json")
    assert status == 400 and "not valid JSON" in json.loads(body)["error"]["message"]
