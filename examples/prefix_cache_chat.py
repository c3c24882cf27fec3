"""What the prefix cache does for a multi-turn chat: the default pair's embedded cluster (draft
server, one target instance, gateway), a conversation of several turns over a long system
prompt streamed through the OpenAI API, run with the prefix cache and without; time to first
token per turn, the prompt tokens the cache served (usage.prompt_tokens_details.cached_tokens),
and whether every reply is the same with and without it; then one request for 3 sampled
choices, whose 2nd and 3rd reuse the 1st's prompt. Writes the tables and a JSON file.

    python examples/prefix_cache_chat.py OUT.json [--dtype bf16] [--max-tokens 48] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import openai
from rich.console import Console

from specctl.cluster.embedded import ClusterConfig, ClusterThread
from specctl.config import build_config
from specctl.runtime.compute import ComputeThread
from specctl.runtime.loop import compute_in_main_thread

CODE = '''
import heapq
from dataclasses import dataclass, field


@dataclass(order=True)
class Job:
    priority: int
    name: str = field(compare=False)
    retries: int = field(default=0, compare=False)


class Scheduler:
    """Runs jobs by priority; a failed job is retried up to max_retries times."""

    def __init__(self, max_retries: int = 3) -> None:
        self.queue: list[Job] = []
        self.max_retries = max_retries
        self.done: list[str] = []
        self.failed: list[str] = []

    def submit(self, job: Job) -> None:
        heapq.heappush(self.queue, job)

    def run(self, work) -> None:
        while self.queue:
            job = heapq.heappop(self.queue)
            try:
                work(job)
            except Exception:
                if job.retries < self.max_retries:
                    job.retries += 1
                    heapq.heappush(self.queue, job)
                else:
                    self.failed.append(job.name)
            else:
                self.done.append(job.name)
'''
SYSTEM = ("You are a careful senior Python reviewer. Answer briefly and precisely, with code when it helps. "
          "The user is working on this module:\n```python" + CODE + "```")
TURNS = [
    "What does Scheduler.run do when a job keeps failing?",
    "Is there a bug in how retried jobs are ordered? Explain in two sentences.",
    "Write a test for the retry limit.",
    "How would you add a timeout per job?",
]


def converse(url: str, model: str, max_tokens: int, system: str = SYSTEM, questions: list[str] = TURNS) -> list[dict]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": system}]
    turns = []
    for question in questions:
        messages.append({"role": "user", "content": question})
        started, first, parts, usage = time.perf_counter(), None, [], None
        for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                    temperature=0, stream=True,
                                                    stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage:
                usage = chunk.usage
        done = time.perf_counter()
        reply = "".join(parts)
        messages.append({"role": "assistant", "content": reply})
        turns.append({"prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.prompt_tokens_details.cached_tokens,
                      "ttft_s": round((first or done) - started, 3), "total_s": round(done - started, 3),
                      "reply": reply})
    return turns


def spread(xs: list[float]) -> str:
    return f"{min(xs):.2f}/{statistics.median(xs):.2f}/{max(xs):.2f}"


def choices(url: str, model: str, max_tokens: int, n: int = 3) -> dict:
    """One request for n sampled choices over a system prompt nothing cached starts with: each
    choice is a session of its own, and with the cache the 2nd..nth reuse the first's prompt."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": "Review strictly." + SYSTEM}, {"role": "user", "content": TURNS[0]}]
    started, first, texts = time.perf_counter(), {}, {}
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, n=n,
                                                temperature=0.8, seed=5, stream=True):
        for choice in chunk.choices:
            if choice.delta.content:
                first.setdefault(choice.index, time.perf_counter() - started)
                texts[choice.index] = texts.get(choice.index, "") + choice.delta.content
    return {"ttft_s": [round(first.get(i, 0.0), 3) for i in range(n)], "total_s": round(time.perf_counter() - started, 3),
            "texts": [texts.get(i, "") for i in range(n)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    console = Console(width=120)
    runs: dict[str, list[list[dict]]] = {"off": [], "on": []}
    sampled: dict[str, list[dict]] = {"off": [], "on": []}  # one request for 3 sampled choices
    for repeat in range(args.repeats):
        for label, mb in (("off", 0), ("on", 512)):  # alternated: the machine's drift falls on both
            config = build_config(None, dtype=args.dtype, prefix_cache_mb=mb)
            # compute served from the main thread, as `specctl up` and `chat` serve it
            compute = ComputeThread("cpu-compute", max_batch=config.max_batch, spawn=False)
            cluster = ClusterThread(config, ClusterConfig(targets=1, gateway_port=0), Console(stderr=True),
                                    compute=compute)
            measured: dict = {}

            def talk() -> None:
                urls = cluster.start()
                try:
                    # warm-up on a text of its own (nothing the measured conversation could find in the cache)
                    converse(urls["gateway"], config.target, 4, "Be brief.", ["Say hi."])
                    measured["picked"] = choices(urls["gateway"], config.target, 16)
                    measured["turns"] = converse(urls["gateway"], config.target, args.max_tokens)
                finally:
                    cluster.stop()

            compute_in_main_thread(talk, compute)
            picked, cluster_turns = measured["picked"], measured["turns"]
            runs[label].append(cluster_turns)
            sampled[label].append(picked)
            console.print(f"repeat {repeat + 1} prefix cache {label}: TTFT "
                          + " ".join(f"{t['ttft_s']:.2f}s" for t in cluster_turns)
                          + "; 3 choices' first tokens " + " ".join(f"{t:.2f}s" for t in picked["ttft_s"]))
    rows = []
    for turn in range(len(TURNS)):
        off = [run[turn] for run in runs["off"]]
        on = [run[turn] for run in runs["on"]]
        rows.append({
            "turn": turn + 1, "prompt_tokens": on[0]["prompt_tokens"], "cached_tokens": on[0]["cached_tokens"],
            "ttft_off_s": [t["ttft_s"] for t in off], "ttft_on_s": [t["ttft_s"] for t in on],
            "same_replies": all(a["reply"] == b["reply"] for a, b in zip(off, on)),
        })
    console.print(f"\n{args.dtype}, the default pair, chain; TTFT min / median / max over {args.repeats} runs")
    console.print(f"{'turn':>4} {'prompt':>7} {'cached':>7}  {'TTFT without cache':>22}  {'TTFT with cache':>22}"
                  f"  {'speedup':>7}  same reply")
    for row in rows:
        off, on = row["ttft_off_s"], row["ttft_on_s"]
        console.print(f"{row['turn']:>4} {row['prompt_tokens']:>7} {row['cached_tokens']:>7}  {spread(off):>22}  "
                      f"{spread(on):>22}  {statistics.median(off) / statistics.median(on):>6.2f}x  "
                      f"{'yes' if row['same_replies'] else 'NO'}")
    console.print("\nn = 3 sampled choices (T 0.8, seed 5) of one request, each a session: first token of each, "
                  "min / median / max")
    for label in ("off", "on"):
        console.print(f"  cache {label:>3}: " + "  ".join(
            spread([run["ttft_s"][i] for run in sampled[label]]) for i in range(3))
            + f"  whole request {spread([run['total_s'] for run in sampled[label]])}")
    same = all(a["texts"] == b["texts"] for a, b in zip(sampled["off"], sampled["on"]))
    console.print(f"  same choices with and without: {'yes' if same else 'NO'}")
    with open(args.out, "w") as f:
        json.dump({"settings": vars(args), "rows": rows, "runs": runs, "choices": sampled}, f, indent=1)


if __name__ == "__main__":
    main()
