"""Storm a running gateway with mixed requests — whole and streamed, sampled and greedy, n
choices, logprobs with echo, forced tool calls, Anthropic's Messages and the Responses API,
clients that leave mid-stream and malformed bodies (each must be a 400 with an error) — then
check that every session was freed (the gateway's and the roles' session gauges back at 0) and
that greedy answers are what they were before. Kill or restart a draft server or a target while
it runs to see what clients meet.

    specctl up --port 8000 &
    python examples/gateway_storm.py http://127.0.0.1:8000 --rounds 3 --concurrency 24

Exits 1 when a request met something else than expected, a session stayed open or a greedy
answer changed."""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time

import aiohttp

PROMPTS = ["def fib(n):", "Write a haiku about rust.", "List three colors as JSON:", "The capital of France is",
           "import numpy as np\n", "Explain TCP in one sentence."]
BAD_BODIES = [b"{", b'{"prompt": 5}', b'{"prompt": "x", "max_tokens": -1}', b'{"prompt": "x", "temperature": -2}',
              b'{"messages": []}', b"\xff\xfe"]
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
KINDS = ("plain", "stream", "leave", "chat", "bad", "n2", "sampled", "logprobs", "tools", "messages", "responses")


async def post(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    async with session.post(url, json=body) as reply:
        answer = await reply.json()
        if reply.status != 200:
            raise AssertionError(f"{reply.status}: {answer}")
        return answer


async def greedy(session: aiohttp.ClientSession, url: str, prompt: str) -> str:
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0}
    return (await post(session, url + "/v1/completions", body))["choices"][0]["text"]


async def streamed(session: aiohttp.ClientSession, url: str, prompt: str, leave_after: int | None) -> None:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 30, "stream": True}
    async with session.post(url + "/v1/chat/completions", json=body) as reply:
        if reply.status != 200:
            raise AssertionError(f"{reply.status}: {await reply.text()}")
        lines = 0
        async for _ in reply.content:
            lines += 1
            if leave_after is not None and lines > leave_after:
                reply.close()  # the client goes: its session must be freed
                return


async def served_model(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/v1/models") as reply:
        return (await reply.json())["data"][0]["id"]  # Anthropic's API names the model it asks for


async def one(session: aiohttp.ClientSession, url: str, number: int, model: str) -> tuple[str, str]:
    draw = random.Random(number)
    kind, prompt = draw.choice(KINDS), draw.choice(PROMPTS)
    chat = [{"role": "user", "content": prompt}]
    try:
        if kind == "plain":
            await post(session, url + "/v1/completions", {"prompt": prompt, "max_tokens": draw.randint(1, 20)})
        elif kind in ("stream", "leave"):
            await streamed(session, url, prompt, draw.randint(1, 6) if kind == "leave" else None)
        elif kind == "chat":
            await post(session, url + "/v1/chat/completions", {"messages": chat, "max_tokens": 16,
                                                                "temperature": 0.7, "seed": number})
        elif kind == "bad":
            path = draw.choice(["/v1/completions", "/v1/chat/completions"])
            async with session.post(url + path, data=draw.choice(BAD_BODIES),
                                    headers={"content-type": "application/json"}) as reply:
                answer = await reply.json()
                assert reply.status == 400 and answer["error"]["message"], (reply.status, answer)
        elif kind == "n2":
            answer = await post(session, url + "/v1/completions", {"prompt": prompt, "max_tokens": 8, "n": 2,
                                                                    "temperature": 1.0})
            assert len(answer["choices"]) == 2, answer
        elif kind == "sampled":
            await post(session, url + "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0.9,
                                                           "top_p": 0.9, "top_k": 40})
        elif kind == "logprobs":
            answer = await post(session, url + "/v1/completions", {"prompt": prompt, "max_tokens": 6,
                                                                    "logprobs": 3, "echo": True})
            assert answer["choices"][0]["logprobs"]["tokens"], answer
        elif kind == "tools":
            answer = await post(session, url + "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": WEATHER,
                "tool_choice": "required", "max_tokens": 40})
            json.loads(answer["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])
        elif kind == "messages":
            body = {"model": model, "max_tokens": 12, "messages": chat, "stream": draw.random() < 0.5}
            async with session.post(url + "/v1/messages", json=body) as reply:
                text = await reply.text()
                assert reply.status == 200, (reply.status, text)
                assert ("message_stop" in text) if body["stream"] else json.loads(text)["content"], text
        elif kind == "responses":
            answer = await post(session, url + "/v1/responses", {"input": prompt, "max_output_tokens": 12})
            assert answer["status"] in ("completed", "incomplete") and answer["output"], answer
        return kind, "ok"
    except Exception as exc:  # a report, not a crash: every request's outcome is listed
        return kind, f"FAIL {exc!r}"


async def open_sessions(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as reply:
        text = await reply.text()
    return {found[1]: float(found[2]) for found in
            re.finditer(r"^specctl:(sessions\{[^}]*\}|requests_running) (\S+)", text, re.M)}


async def storm(url: str, rounds: int, concurrency: int) -> bool:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        before = {prompt: await greedy(session, url, prompt) for prompt in PROMPTS[:3]}
        model = await served_model(session, url)
        failed = 0
        for number in range(rounds):
            start = time.perf_counter()
            requests = (one(session, url, number * 1000 + i, model) for i in range(concurrency))
            results = await asyncio.gather(*requests)
            bad = [result for result in results if result[1] != "ok"]
            failed += len(bad)
            print(f"round {number}: {len(results)} requests in {time.perf_counter() - start:.1f} s, "
                  f"{', '.join(map(str, bad)) or 'each as expected'}", flush=True)
        for _ in range(60):  # a freed session's gauge falls at the roles' next poll
            gauges = await open_sessions(session, url)
            if not any(gauges.values()):
                break
            await asyncio.sleep(1)
        after = {prompt: await greedy(session, url, prompt) for prompt in PROMPTS[:3]}
    print(f"open after the storm: {gauges}", flush=True)
    print(f"greedy answers the same as before: {after == before}", flush=True)
    return failed == 0 and bool(gauges) and not any(gauges.values()) and after == before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="the gateway, e.g. http://127.0.0.1:8000")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=24, help="requests sent together each round")
    args = parser.parse_args()
    try:
        ok = asyncio.run(storm(args.url.rstrip("/"), args.rounds, args.concurrency))
    except (aiohttp.ClientError, AssertionError) as exc:  # outside the rounds: greedy answers, /v1/models, /metrics
        sys.exit(f"storm: {args.url} did not answer as expected outside the rounds: {exc}")
    print("storm:", "ok" if ok else "PROBLEM")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
