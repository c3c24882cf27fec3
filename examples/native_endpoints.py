"""llama.cpp's and SGLang's own endpoints against a running gateway, with plain HTTP as their
clients send it: /completion whole, streamed and with n_probs; /infill as llama.vim sends it
(n_indent, t_max_predict_ms, response_fields; n_predict 0 to warm the extra context), /props,
/apply-template; SGLang's /generate (stop matched, batch, return_logprob, max_new_tokens 0) —
each beside /v1/completions of the same prompt, whose text it must equal at temperature 0.
Run: specctl up --port 8123 (the default pair), then python examples/native_endpoints.py [URL]"""

import json
import sys
import time
import urllib.request

base = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8123"


def post(path: str, body: dict) -> bytes:
    request = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return response.read()


def events(raw: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]


PROMPT = "def fib(n):\n"
openai = json.loads(post("/v1/completions", {"prompt": PROMPT, "max_tokens": 48, "temperature": 0, "stop": ["\n\n"]}))
reference = openai["choices"][0]["text"]
print("v1/completions:", repr(reference), openai["choices"][0]["finish_reason"], openai["choices"][0]["stop_reason"])

t = time.time()
whole = json.loads(post("/completion", {"prompt": PROMPT, "n_predict": 48, "temperature": 0, "stop": ["\n\n"]}))
print(f"/completion ({time.time() - t:.1f}s):", whole["content"] == reference, whole["stop_type"],
      repr(whole["stopping_word"]), whole["tokens_predicted"], whole["timings"]["predicted_per_second"])
streamed = events(post("/completion", {"prompt": PROMPT, "n_predict": 48, "temperature": 0, "stop": ["\n\n"],
                                      "stream": True}))
print("/completion streamed:", len(streamed), "events, joined == whole:",
      "".join(e["content"] for e in streamed) == whole["content"], "last stop:", streamed[-1]["stop"])
probs = json.loads(post("/completion", {"prompt": PROMPT, "n_predict": 4, "temperature": 0, "n_probs": 2}))
print("/completion n_probs:", [(p["token"], round(p["logprob"], 3), [t["token"] for t in p["top_logprobs"]])
                               for p in probs["completion_probabilities"]])

prefix, suffix = "def mean(xs):\n    total = 0\n", "\n\nprint(mean([1, 2, 3]))\n"
extra = [{"filename": "stats.py", "text": "def median(xs):\n    xs = sorted(xs)\n    return xs[len(xs) // 2]\n"}]
warm = post("/infill", {"input_prefix": "", "input_suffix": "", "input_extra": extra, "prompt": "", "n_predict": 0,
                        "temperature": 0.0, "samplers": [], "cache_prompt": True, "t_max_prompt_ms": 1,
                        "t_max_predict_ms": 1, "response_fields": [""]})
print("/infill ring warm-up (n_predict 0):", warm.decode())
fim = json.loads(post("/infill", {
    "input_prefix": prefix, "input_suffix": suffix, "input_extra": extra, "prompt": "    ", "n_predict": 64,
    "n_indent": 4, "temperature": 0, "top_k": 40, "top_p": 0.99, "samplers": ["top_k", "top_p", "infill"],
    "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1500,
    "response_fields": ["content", "timings/prompt_n", "timings/predicted_n", "timings/predicted_ms",
                        "tokens_cached", "truncated"]}))
print("/infill as llama.vim asks:", fim)

props = json.loads(urllib.request.urlopen(base + "/props").read())
print("/props:", props["default_generation_settings"]["n_ctx"], props["total_slots"], props["model_path"],
      len(props["chat_template"]), "chars of chat template")
messages = [{"role": "user", "content": "Name a prime number."}]
prompt = json.loads(post("/apply-template", {"messages": messages}))["prompt"]
completed = json.loads(post("/completion", {"prompt": prompt, "n_predict": 16, "temperature": 0}))["content"]
chat = json.loads(post("/v1/chat/completions", {"messages": messages, "max_tokens": 16, "temperature": 0}))
print("/apply-template + /completion == chat:", completed == chat["choices"][0]["message"]["content"], repr(completed))

out = json.loads(post("/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 48, "temperature": 0,
                                                                        "stop": "\n\n"}}))
print("/generate:", out["text"] == reference, out["meta_info"]["finish_reason"],
      {k: out["meta_info"][k] for k in ("completion_tokens", "spec_verify_ct", "spec_accept_length")})
batch = json.loads(post("/generate", {"text": [PROMPT, "def add(a, b):\n"],
                                      "sampling_params": {"max_new_tokens": 12, "temperature": 0}}))
print("/generate batch:", [repr(b["text"]) for b in batch])
scored = json.loads(post("/generate", {"text": "The capital of France is Paris.", "return_logprob": True,
                                       "logprob_start_len": 0, "return_text_in_logprobs": True,
                                       "sampling_params": {"max_new_tokens": 0}}))
print("/generate scoring (max_new_tokens 0):", [(t, round(lp, 3) if lp is not None else None)
                                                 for lp, _, t in scored["meta_info"]["input_token_logprobs"]])
