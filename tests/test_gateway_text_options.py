"""vLLM's request options on how the output reads: skip_special_tokens (special tokens kept in
the text when false) and return_tokens_as_token_ids (logprobs name tokens by id)."""

import json
import urllib.request

import pytest

from tests.test_gateway import PROMPT, post, specctl_generate

IM_START = 257  # a special token of the tiny tokenizer ("<|im_start|>"; not a stop token)


def _stream(url: str, body: dict) -> list[dict]:
    request = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return [json.loads(line[6:]) for line in response if line.startswith(b"data: {")]


def test_special_tokens_stay_in_the_text_only_when_asked(cluster):
    base = cluster[1]["gateway"]
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "logit_bias": {str(IM_START): 100}}  # the output: the special token three times
    skipped = json.loads(post(base + "/v1/completions", body)[2])
    assert skipped["choices"][0]["text"] == "" and skipped["usage"]["completion_tokens"] == 3  # vLLM's default
    kept = json.loads(post(base + "/v1/completions", {**body, "skip_special_tokens": False})[2])
    assert kept["choices"][0]["text"] == "<|im_start|>" * 3
    chunks = _stream(base + "/v1/completions", {**body, "skip_special_tokens": False})
    assert "".join(c["choices"][0]["text"] for c in chunks) == "<|im_start|>" * 3
    chat = json.loads(post(base + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                           "skip_special_tokens": False, **body})[2])
    assert chat["choices"][0]["message"]["content"] == "<|im_start|>" * 3


def test_logprobs_name_tokens_by_id_when_asked_with_the_same_values_and_offsets(cluster, tiny_dir):
    base = cluster[1]["gateway"]
    reference = specctl_generate(tiny_dir, PROMPT, 8)
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 2}
    plain = json.loads(post(base + "/v1/completions", body)[2])["choices"][0]
    by_id = json.loads(post(base + "/v1/completions", {**body, "return_tokens_as_token_ids": True})[2])["choices"][0]
    assert by_id["text"] == plain["text"] == reference["text"]
    logprobs = by_id["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{token}" for token in reference["token_ids"]]
    # the same values up to the last bits (the second request reads the prompt from the prefix cache)
    assert logprobs["token_logprobs"] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-4)
    assert logprobs["text_offset"] == plain["logprobs"]["text_offset"]  # offsets into the text, not into the names
    for top, plain_top in zip(logprobs["top_logprobs"], plain["logprobs"]["top_logprobs"]):
        assert all(name.startswith("token_id:") for name in top)
        assert sorted(top.values()) == pytest.approx(sorted(plain_top.values()), abs=1e-4)
    chunks = _stream(base + "/v1/completions", {**body, "return_tokens_as_token_ids": True})
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert sum((s["text_offset"] for s in streamed), []) == logprobs["text_offset"]
    assert sum((s["tokens"] for s in streamed), []) == logprobs["tokens"]
    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6, "temperature": 0, "logprobs": True,
            "top_logprobs": 2}
    named = json.loads(post(base + "/v1/chat/completions", chat)[2])["choices"][0]["logprobs"]["content"]
    by_id = json.loads(post(base + "/v1/chat/completions", {**chat, "return_tokens_as_token_ids": True})[2])
    content = by_id["choices"][0]["logprobs"]["content"]
    assert [entry["bytes"] for entry in content] == [entry["bytes"] for entry in named]  # still the token's bytes
    assert [entry["logprob"] for entry in content] == pytest.approx([entry["logprob"] for entry in named], abs=1e-4)
    assert all(entry["token"].startswith("token_id:") and all(top["token"].startswith("token_id:")
                                                               for top in entry["top_logprobs"]) for entry in content)
    ids = [int(entry["token"].split(":")[1]) for entry in content]
    assert json.loads(post(base + "/detokenize", {"tokens": ids})[2])["prompt"] == \
        by_id["choices"][0]["message"]["content"]


def test_a_chat_template_given_at_start_renders_every_conversation(tiny_dir, tmp_path):
    """vLLM's --chat-template: a file or the template itself, in place of the tokenizer's, for
    chat, /tokenize and the tools check alike; one that does not compile is refused at start."""
    from specctl.cluster.embedded import ClusterConfig, ClusterThread
    from specctl.config import build_config
    from specctl.gateway.chat_template import load_chat_template
    from tests.conftest import run_here
    from tests.test_cli import _assert_one_line_error

    template = "{% for m in messages %}[{{ m.role }}: {{ m.content }}]{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    assert load_chat_template(str(tmp_path / "t.jinja")) == load_chat_template(template) == template
    config = build_config(None, target=str(tiny_dir["llama"]), draft=f"{tiny_dir['llama']}@2", mode="chain", depth=3,
                          dtype="fp32", draft_quant="none", max_sessions=4)
    thread = ClusterThread(config, ClusterConfig(targets=1, gateway_port=0, chat_template=str(tmp_path / "t.jinja")))
    base = thread.start()["gateway"]
    try:
        messages = [{"role": "user", "content": "hi"}]
        tokenized = json.loads(post(base + "/tokenize", {"messages": messages, "return_token_strs": True})[2])
        byte_text = "".join(tokenized["token_strs"])
        assert byte_text == "[user:Ġhi]"  # the byte-level tokens of "[user: hi]"
        chat = json.loads(post(base + "/v1/chat/completions", {"messages": messages, "max_tokens": 2})[2])
        assert chat["usage"]["prompt_tokens"] == tokenized["count"]
        # the gateway renders with its own copy: the loaded model's tokenizer keeps its template
        assert thread.cluster.gateway.tokenizer.chat_template == template
        assert thread.cluster.targets[0].model.tokenizer.chat_template != template
    finally:
        thread.stop()
    with pytest.raises(ValueError, match=r"^--chat-template 'no/such.jinja': no such file; give a template file or "
                                         r"the template itself$"):
        load_chat_template("no/such.jinja")
    _assert_one_line_error(run_here("gateway", "--target", "127.0.0.1:1", "--chat-template", "{% for m in messages %}"),
                           "--chat-template does not compile: Unexpected end of template.")


def test_max_model_len_caps_the_context_served(tiny_dir):
    """vLLM's --max-model-len: the gateway serves a context below the model's (its 400s and
    /v1/models say so); above the model's it is refused."""
    from specctl.cluster.embedded import ClusterConfig, ClusterThread
    from specctl.config import build_config
    from specctl.errors import ConfigError

    config = build_config(None, target=str(tiny_dir["llama"]), draft=f"{tiny_dir['llama']}@2", mode="chain", depth=3,
                          dtype="fp32", draft_quant="none", max_sessions=4)
    thread = ClusterThread(config, ClusterConfig(targets=1, gateway_port=0, max_model_len=40))
    base = thread.start()["gateway"]
    try:
        card = json.loads(urllib.request.urlopen(base + "/v1/models", timeout=10).read())["data"][0]
        assert card["max_model_len"] == 40
        code, _, raw = post(base + "/v1/completions", {"prompt": [1] * 30, "max_tokens": 11})
        assert code == 400 and json.loads(raw)["error"]["code"] == "context_length_exceeded"
        assert json.loads(raw)["error"]["message"].startswith("This model's maximum context length is 40 tokens.")
        code, _, _ = post(base + "/v1/completions", {"prompt": [1] * 30, "max_tokens": 10})
        assert code == 200
    finally:
        thread.stop()
    with pytest.raises(ConfigError, match=r"^--max-model-len must be between 2 and the model's context of 512 tokens, "
                                          r"got 513$"):
        ClusterThread(config, ClusterConfig(targets=1, gateway_port=0, max_model_len=513)).start()
