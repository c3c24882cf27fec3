"""Session 45's serving features against a running gateway, with the official openai client:
--served-model-name, stored responses continued by previous_response_id (against the chat
completion of the whole conversation) and their input_items, logprobs on a response against
chat's, vLLM's continuous_usage_stats, and the waiting line: more requests at once than the
target instance holds, each answered with the text it gets alone.
Run: specctl up --port 8123 --max-sessions 1 --served-model-name coder, then
python examples/serving_queue_and_store.py [URL]"""

import json
import sys
import threading
import time
import urllib.request

import openai

base = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8123"
c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
cards = c.models.list().data
print("models:", [(m.id, m.model_extra["root"]) for m in cards])
model = cards[0].id
first = c.responses.create(model=model, instructions="Answer in one short sentence.",
                           input="My favourite language is Rust.", max_output_tokens=24, temperature=0)
second = c.responses.create(model=model, previous_response_id=first.id, input="Which language did I name?",
                            max_output_tokens=24, temperature=0)
chat = c.chat.completions.create(model=model, max_tokens=24, temperature=0, messages=[
    {"role": "user", "content": "My favourite language is Rust."}, {"role": "assistant", "content": first.output_text},
    {"role": "user", "content": "Which language did I name?"}])
print("first:", repr(first.output_text), "| model in the answer:", first.model)
print("second (previous_response_id):", repr(second.output_text))
print("same as chat over the whole conversation:", second.output_text == chat.choices[0].message.content,
      second.usage.input_tokens == chat.usage.prompt_tokens)
print("input_items of second:", [(i.role, i.content[0].text) for i in c.responses.input_items.list(second.id).data])
print("retrieved == created:", c.responses.retrieve(second.id).output_text == second.output_text)
lp = c.responses.create(model=model, input="Say hi.", max_output_tokens=6, temperature=0, top_logprobs=2,
                        include=["message.output_text.logprobs"])
lc = c.chat.completions.create(model=model, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
                               messages=[{"role": "user", "content": "Say hi."}])
tokens = [(x.token, round(x.logprob, 3)) for x in lp.output[0].content[0].logprobs]
print("response logprobs:", tokens, "| same as chat's:",
      [x.model_dump() for x in lp.output[0].content[0].logprobs] == [x.model_dump() for x in lc.choices[0].logprobs.content])
counts = [ch.usage.completion_tokens for ch in c.completions.create(
    model=model, prompt="def fib(n):", max_tokens=12, temperature=0, stream=True,
    stream_options={"include_usage": True, "continuous_usage_stats": True})]
print("continuous usage (completion tokens per chunk):", counts)

question = [{"role": "user", "content": "Name three sorting algorithms."}]
alone = c.chat.completions.create(model=model, max_tokens=32, temperature=0, messages=question).choices[0].message.content
results, seen = [None] * 3, []


def ask(i):
    results[i] = c.chat.completions.create(model=model, max_tokens=32, temperature=0, messages=question)


def watch():
    until = time.time() + 120
    while time.time() < until and any(r is None for r in results):
        seen.append(json.loads(urllib.request.urlopen(base + "/v1/stats").read())["gateway"]["requests_waiting"])
        time.sleep(0.05)


threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)] + [threading.Thread(target=watch)]
t = time.time()
for th in threads:
    th.start()
for th in threads:
    th.join()
print(f"3 requests at once on 1 session: {time.time() - t:.1f}s, most waiting at once {max(seen)},",
      "all the text alone:", all(r.choices[0].message.content == alone for r in results))
stats = json.loads(urllib.request.urlopen(base + "/v1/stats").read())["gateway"]
print("gateway feed:", {k: stats[k] for k in ("requests_running", "requests_waiting", "generations", "ttft_ms_p50",
                                              "e2e_ms_p90")})
