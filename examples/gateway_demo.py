"""The gateway's must-show, end to end with real processes: `specctl up` (draft server,
2 target instances, gateway) with the smollm2-135m fp32 pair, driven by the official
openai client; outputs compared with `specctl generate`; every error path; 16 concurrent
streams; /metrics before and after. Run: python examples/gateway_demo.py"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import aiohttp
import openai
from prometheus_client.parser import text_string_to_metric_families

from specctl.bench.processes import free_port

TARGET, DRAFT = "smollm2-135m", "smollm2-135m@25"
PROMPT, CHAT = "def fibonacci(n):", "Write a haiku about the sea."
PY = sys.executable


def generate(prompt: str, chat: bool, n: int) -> dict:
    out = subprocess.run([PY, "-m", "specctl", "generate", "--target", TARGET, "--mode", "ar", "--dtype", "fp32",
                          "-p", prompt, "-n", str(n), "--json", *(["--chat"] if chat else [])],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def post(url: str, body) -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def counters(base: str) -> dict:
    with urllib.request.urlopen(base + "/metrics") as r:
        families = text_string_to_metric_families(r.read().decode())
        return {s.name: s.value for f in families for s in f.samples if s.name.startswith("specctl:spec_decode")
                and s.name.endswith("_total") and not s.labels}


async def streams(base: str, count: int) -> list[tuple[int, str]]:
    async def one(session, i):
        body = {"prompt": f"# Python function number {i}\ndef", "max_tokens": 24, "temperature": 0, "stream": True}
        async with session.post(base + "/v1/completions", json=body) as r:
            lines = [line.decode().strip() async for line in r.content if line.strip()]
        return len(lines) - 1, lines[-1]

    async with aiohttp.ClientSession() as session:
        return await asyncio.gather(*(one(session, i) for i in range(count)))


def main() -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    up = subprocess.Popen([PY, "-m", "specctl", "up", "--draft", DRAFT, "--target", TARGET, "--mode", "chain",
                           "--dtype", "fp32", "--draft-quant", "none", "--targets", "2", "--port", str(port)],
                          stderr=subprocess.PIPE, text=True)
    try:
        while True:
            line = up.stderr.readline()
            if not line:
                raise SystemExit("specctl up exited")
            print("up |", line.rstrip())
            if "Ctrl-C to stop" in line:
                break
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        print("\n== openai client vs specctl generate (temperature 0, fp32) ==")
        ref = generate(PROMPT, False, 48)
        full = client.completions.create(model=TARGET, prompt=PROMPT, max_tokens=48, temperature=0)
        streamed = list(client.completions.create(model=TARGET, prompt=PROMPT, max_tokens=48, temperature=0, stream=True,
                                                  stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in streamed if c.choices)
        print(f"completions      identical={full.choices[0].text == ref['text']}  usage={full.usage.model_dump()}")
        print(f"completions SSE  identical={text == ref['text']}  usage={streamed[-1].usage.model_dump()}")
        ref = generate(CHAT, True, 40)
        messages = [{"role": "user", "content": CHAT}]
        full = client.chat.completions.create(model=TARGET, messages=messages, max_tokens=40, temperature=0)
        streamed = list(client.chat.completions.create(model=TARGET, messages=messages, max_tokens=40, temperature=0,
                                                       stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        print(f"chat             identical={full.choices[0].message.content == ref['text']}  usage={full.usage.model_dump()}")
        print(f"chat SSE         identical={text == ref['text']}  usage={streamed[-1].usage.model_dump()}")
        print(f"text: {ref['text']!r}")

        print("\n== error paths (each followed by a good request) ==")
        cases = [("bad JSON", b"{oops"), ("missing prompt", {"max_tokens": 4}),
                 ("temperature -1", {"prompt": "x", "temperature": -1}), ("top_p 1.5", {"prompt": "x", "top_p": 1.5}),
                 ("n=2", {"prompt": "x", "n": 2}), ("unknown model", {"prompt": "x", "model": "gpt-4"}),
                 ("prompt too long", {"prompt": "word " * 9000, "max_tokens": 8}),
                 ("body too large", {"prompt": "x" * (2 << 20)})]
        for name, body in cases:
            status, _, error = post(base + "/v1/completions", body)
            after, _, ok = post(base + "/v1/completions", {"prompt": "1, 2, 3,", "max_tokens": 4, "temperature": 0})
            print(f"{name:16s} -> {status} {json.dumps(error)[:150]}  | next request {after}")

        print("\n== 16 concurrent streaming clients ==")
        before = counters(base)
        t0 = time.perf_counter()
        results = asyncio.run(streams(base, 16))
        done = sum(last == "data: [DONE]" for _, last in results)
        print(f"{done}/16 streams ended with data: [DONE] in {time.perf_counter() - t0:.1f}s; "
              f"chunks per stream {[n for n, _ in results]}")
        after = counters(base)
        print("\n== /metrics (prometheus_client text parser) before -> after the 16 streams ==")
        for name in sorted(after):
            print(f"{name:52s} {before.get(name, 0):8.0f} -> {after[name]:8.0f}")
    finally:
        up.send_signal(signal.SIGINT)
        rest = up.communicate(timeout=60)[1]
        print("\nup |", rest.strip().splitlines()[-1] if rest.strip() else "", f"(exit code {up.returncode})")
        with socket.socket() as s:
            print("gateway port free again:", s.connect_ex(("127.0.0.1", port)) != 0)


if __name__ == "__main__":
    main()
