"""The gateway's newer OpenAI/vLLM endpoints against a running gateway, with the official
openai client: GET /v1/models/{model} and /version, the Responses API (whole, streamed, with
tools) beside the chat completion of the same messages, vLLM's continue_final_message, a
forced tool call, and the latency histograms in /metrics.
Run: specctl up --port 8123 (the default pair), then python examples/openai_endpoints.py [URL]"""

import sys
import time
import urllib.request

import openai

base = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8123"
c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
model = c.models.retrieve(c.models.list().data[0].id)
print("model", model.id, model.model_extra)
print("version", urllib.request.urlopen(base + "/version").read().decode())
t = time.time()
r = c.responses.create(model=model.id, instructions="Answer in one short sentence.", input="What is a Python list?",
                       max_output_tokens=40, temperature=0)
print("responses:", r.status, repr(r.output_text), r.usage.input_tokens, r.usage.output_tokens, f"{time.time()-t:.1f}s",
      r.model_extra["specctl"]["mean_accepted_length"])
chat = c.chat.completions.create(model=model.id, max_tokens=40, temperature=0, messages=[
    {"role": "system", "content": "Answer in one short sentence."}, {"role": "user", "content": "What is a Python list?"}])
print("same as chat:", chat.choices[0].message.content == r.output_text)
events = list(c.responses.create(model=model.id, input="Say hi.", max_output_tokens=10, temperature=0, stream=True))
print("stream kinds:", [e.type for e in events][:5], "...", events[-1].type, repr(events[-1].response.output_text))
cont = c.chat.completions.create(model=model.id, max_tokens=12, temperature=0, messages=[
    {"role": "user", "content": "Write a Python function that adds two numbers."},
    {"role": "assistant", "content": "```python\ndef add("}],
    extra_body={"add_generation_prompt": False, "continue_final_message": True})
print("continued:", repr(cont.choices[0].message.content))
tool = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
forced = c.chat.completions.create(model=model.id, max_tokens=30, temperature=0, tools=[tool],
    tool_choice={"type": "function", "function": {"name": "get_weather"}},
    messages=[{"role": "user", "content": "What's the weather in Paris?"}])
print("forced call:", forced.choices[0].message.tool_calls[0].function)
rtool = c.responses.create(model=model.id, input="What's the weather in Paris?", max_output_tokens=30, temperature=0,
    tools=[{"type": "function", **tool["function"]}], tool_choice="auto")
print("responses tools auto:", [(o.type, getattr(o, "name", None), getattr(o, "arguments", None)) for o in rtool.output],
      repr(rtool.output_text)[:120])
m = urllib.request.urlopen(base + "/metrics").read().decode()
print([l for l in m.splitlines() if l.startswith(("specctl:time_to_first_token_seconds_count", "specctl:e2e_request_latency_seconds_sum", "specctl:time_per_output_token_seconds_sum"))])
