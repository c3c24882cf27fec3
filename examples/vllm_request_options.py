"""Session 46's vLLM request options against a running gateway with the real default pair:
prompt_logprobs (checked against the target checkpoint run by transformers, fp32, one forward
over the prompt), request ids (X-Request-Id, the body's request_id, the answer's header),
skip_special_tokens and return_tokens_as_token_ids.
Run: specctl up --port 8123 --enable-request-id-headers, then
python examples/vllm_request_options.py [URL]"""

import json
import sys
import urllib.request

import torch
from transformers import AutoModelForCausalLM

from specctl.store import resolve_model

base = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8123"


def post(path: str, body: dict, headers: dict | None = None) -> tuple[dict, dict]:
    request = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read()), dict(response.headers)


prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
answer, _ = post("/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0, "prompt_logprobs": 2})
scored = answer["choices"][0]["prompt_logprobs"]
ids = post("/tokenize", {"prompt": prompt})[0]["tokens"]
root = json.loads(urllib.request.urlopen(base + "/v1/models").read())["data"][0]["root"]
target = AutoModelForCausalLM.from_pretrained(resolve_model(root), dtype=torch.float32)
with torch.no_grad():
    rows = target(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
differences, ranks_equal, tops_equal = [], 0, 0
for i, token in enumerate(ids[1:]):
    entry = scored[i + 1]
    differences.append(abs(entry[str(token)]["logprob"] - float(rows[i, token])))
    ranks_equal += entry[str(token)]["rank"] == int((rows[i] >= rows[i, token]).sum())
    tops = {int(k) for k, v in entry.items() if v["rank"] <= 2}
    tops_equal += tops == set(rows[i].topk(2).indices.tolist())
print(f"prompt_logprobs: {len(scored)} entries for {len(ids)} prompt tokens, first {scored[0]}")
print(f"  vs transformers fp32 (the gateway's target: the profile's dtype): max |logprob diff| "
      f"{max(differences):.3f}, mean {sum(differences) / len(differences):.3f}; "
      f"rank equal {ranks_equal}/{len(ids) - 1}; top-2 ids equal {tops_equal}/{len(ids) - 1}")
print("  e.g.", {k: (round(v["logprob"], 3), v["rank"], v["decoded_token"]) for k, v in scored[5].items()})
answer, headers = post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4,
                                                "temperature": 0}, {"X-Request-Id": "trace-42"})
print("X-Request-Id trace-42 -> id", answer["id"], "| header", headers.get("X-Request-Id"))
answer, headers = post("/v1/completions", {"prompt": "1 + 1 =", "max_tokens": 2, "temperature": 0})
print("no id given -> id", answer["id"], "| header", headers.get("X-Request-Id"))
body = {"prompt": "x", "max_tokens": 2, "temperature": 0, "ignore_eos": True, "logit_bias": {"151644": 100}}
print("special tokens skipped:", repr(post("/v1/completions", body)[0]["choices"][0]["text"]),
      "| kept:", repr(post("/v1/completions", {**body, "skip_special_tokens": False})[0]["choices"][0]["text"]))
answer, _ = post("/v1/completions", {"prompt": "Hello in Chinese: ", "max_tokens": 4, "temperature": 0, "logprobs": 0,
                                     "return_tokens_as_token_ids": True})
print("tokens as ids:", answer["choices"][0]["logprobs"]["tokens"], "| text", repr(answer["choices"][0]["text"]))
