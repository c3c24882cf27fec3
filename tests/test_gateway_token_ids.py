"""vLLM's return_token_ids on the gateway: the prompt's ids and each choice's generated ids
beside the text — the target's own tokens (`specctl generate`'s), the EOS or stop token that
ended a choice included as vLLM includes it — whole or streamed chunk by chunk, for completions
and chat; nothing added when not asked."""

import json

from specctl.engine.text import encode_chat
from specctl.engine.tiny import make_byte_tokenizer
from tests.test_gateway import PROMPT, post, specctl_generate


def _chunks(body: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: {")]


def _ended(reference: dict, finish: str) -> list[int]:
    """The reference's tokens with the EOS that ended them, where one did."""
    return reference["token_ids"] + ([make_byte_tokenizer().eos_token_id] if finish == "stop" else [])


def test_completions_give_the_prompts_and_the_choices_token_ids_whole_and_streamed(cluster, tiny_dir):
    url = cluster[1]["gateway"] + "/v1/completions"
    reference = specctl_generate(tiny_dir, PROMPT, 20)
    prompt = make_byte_tokenizer().encode(PROMPT)
    body = {"prompt": PROMPT, "max_tokens": 20, "temperature": 0, "return_token_ids": True}
    [choice] = json.loads(post(url, body)[2])["choices"]
    assert choice["text"] == reference["text"]
    assert (choice["prompt_token_ids"], choice["token_ids"]) == (prompt, _ended(reference, choice["finish_reason"]))
    chunks = _chunks(post(url, {**body, "stream": True})[2])
    sent = [c["choices"][0] for c in chunks if c["choices"]]
    assert sent[0]["prompt_token_ids"] == prompt and all("prompt_token_ids" not in c for c in sent[1:])
    assert sum((c["token_ids"] for c in sent), []) == choice["token_ids"]
    # a batch: each choice its own prompt's ids; a stop string's last tokens stay in token_ids
    word = reference["text"][6:9]
    batch = json.loads(post(url, {**body, "prompt": [PROMPT, "ab"], "stop": word})[2])["choices"]
    assert [c["prompt_token_ids"] for c in batch] == [prompt, make_byte_tokenizer().encode("ab")]
    ids = batch[0]["token_ids"]
    assert batch[0]["text"] == reference["text"][:6] and ids == reference["token_ids"][: len(ids)]
    assert make_byte_tokenizer().decode(ids).startswith(reference["text"][:9])
    plain = json.loads(post(url, {"prompt": PROMPT, "max_tokens": 4, "temperature": 0})[2])["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain


def test_chat_gives_the_rendered_prompts_ids_beside_the_choices_whole_and_streamed(cluster, tiny_dir):
    url = cluster[1]["gateway"] + "/v1/chat/completions"
    reference = specctl_generate(tiny_dir, "Say hello", 16, chat=True)
    messages = [{"role": "user", "content": "Say hello"}]
    prompt = encode_chat(make_byte_tokenizer(), messages)
    body = {"messages": messages, "max_tokens": 16, "temperature": 0, "return_token_ids": True}
    answer = json.loads(post(url, body)[2])
    [choice] = answer["choices"]
    assert choice["message"]["content"] == reference["text"]
    assert (answer["prompt_token_ids"], choice["token_ids"]) == (prompt, _ended(reference, choice["finish_reason"]))
    chunks = _chunks(post(url, {**body, "stream": True})[2])
    assert chunks[0]["prompt_token_ids"] == prompt and all("prompt_token_ids" not in c for c in chunks[1:])
    assert sum((c["choices"][0]["token_ids"] for c in chunks if c["choices"]), []) == choice["token_ids"]
    assert "prompt_token_ids" not in json.loads(post(url, {**body, "return_token_ids": False})[2])
