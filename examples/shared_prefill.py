"""What the prefill gate (specctl/engine/prefill_gate.py) does for a request's n choices over a
long prompt: the default pair's embedded cluster (draft server, one target instance, gateway)
in fp32, where both keep a prefix cache; one streamed request for n sampled choices over a
prompt longer than a prefill chunk, sent with the gates and without them (the servers'
``prefill_gate`` set to None: each choice then prefills the prompt, their chunks interleaved),
on cold caches, alternated. Prints each choice's first token, the whole request, the sessions
that shared a prefill, and whether the choices' texts are the same; writes a JSON file.

    python examples/shared_prefill.py OUT.json [--n 3] [--repeats 2] [--parts 4]
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
from specctl.engine.prefill_gate import PrefillGate

from prefix_cache_chat import CODE  # noqa: E402  (run from examples/ or with it on the path)


def long_prompt(run: int, parts: int) -> str:
    """A review request over ``parts`` copies of the module, under a first line of its own per run
    (so nothing an earlier run cached starts the same way)."""
    body = "\n".join(f"# part {i + 1} of the code base, revision {run}{CODE}" for i in range(parts))
    return f"Run {run}. Review this code base strictly; list the three worst problems.\n```python{body}```"


def request(url: str, model: str, prompt: str, n: int) -> dict:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    started, first, texts, usage, fallbacks = time.perf_counter(), {}, {}, None, {}
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=16, n=n, temperature=0.8, seed=5, stream=True,
                                                stream_options={"include_usage": True}):
        for choice in chunk.choices:
            if choice.delta.content:
                first.setdefault(choice.index, time.perf_counter() - started)
                texts[choice.index] = texts.get(choice.index, "") + choice.delta.content
        usage = chunk.usage or usage
        summary = (chunk.model_extra or {}).get("specctl")
        if summary and chunk.choices:  # a choice's last chunk: its rounds without a proposal
            fallbacks[chunk.choices[0].index] = summary.get("fallback_rounds", 0)
    return {"ttft_s": [round(first.get(i, 0.0), 3) for i in range(n)], "total_s": round(time.perf_counter() - started, 3),
            "texts": [texts.get(i, "") for i in range(n)], "prompt_tokens": usage.prompt_tokens,
            "fallback_rounds": [fallbacks.get(i) for i in range(n)]}


def spread(xs: list[float]) -> str:
    return f"{min(xs):.2f}/{statistics.median(xs):.2f}/{max(xs):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--n", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--parts", type=int, default=4, help="copies of the module in the prompt (~290 tokens each)")
    args = parser.parse_args()
    console = Console(width=120)
    config = build_config(None, dtype="fp32")  # fp32: a prefix cache on both sides by default
    cluster = ClusterThread(config, ClusterConfig(targets=1, gateway_port=0), Console(stderr=True))
    urls = cluster.start()
    servers = [cluster.cluster.draft_server, *cluster.cluster.targets]
    runs: dict[str, list[dict]] = {"without": [], "with": []}
    try:
        request(urls["gateway"], config.target, "Say hi.", 1)  # warm-up
        for repeat in range(args.repeats):
            prompt = long_prompt(repeat, args.parts)
            order = ("without", "with") if repeat % 2 == 0 else ("with", "without")  # the machine's drift on both
            for label in order:
                time.sleep(1.0)  # the last sessions' closes (which store their texts) have run
                for server in servers:
                    prefixes = server.model.decoder.prefix_cache
                    prefixes.clear()  # cold: the other setting's run stored this prompt
                    server.prefill_gate = PrefillGate(prefixes) if label == "with" else None
                run = request(urls["gateway"], config.target, prompt, args.n)
                run["shared_prefills"] = [s.prefill_gate.waits if s.prefill_gate is not None else 0 for s in servers]
                runs[label].append(run)
                console.print(f"repeat {repeat + 1} {label:>7} the gates: {run['prompt_tokens']} prompt tokens, "
                              f"first tokens " + " ".join(f"{t:.2f}s" for t in run["ttft_s"])
                              + f", whole {run['total_s']:.2f}s, shared prefills (draft, target) "
                              f"{run['shared_prefills']}, fallback rounds {run['fallback_rounds']}")
    finally:
        cluster.stop()
    console.print(f"\nfp32, the default pair, chain; n = {args.n} sampled choices (T 0.8, seed 5, 16 tokens) of one "
                  f"request over a {runs['with'][0]['prompt_tokens']}-token prompt; min / median / max over "
                  f"{args.repeats} runs")
    console.print(f"{'gates':>8}  " + "  ".join(f"{'choice ' + str(i) + ' first token':>22}" for i in range(args.n))
                  + f"  {'whole request':>18}")
    for label in ("without", "with"):
        console.print(f"{label:>8}  " + "  ".join(f"{spread([r['ttft_s'][i] for r in runs[label]]):>22}"
                                                  for i in range(args.n))
                      + f"  {spread([r['total_s'] for r in runs[label]]):>18}")
    same = all(a["texts"] == b["texts"] for a, b in zip(runs["without"], runs["with"]))
    console.print(f"same choices with and without: {'yes' if same else 'NO'}")
    with open(args.out, "w") as f:
        json.dump({"settings": vars(args), "runs": runs, "same_texts": same}, f, indent=1)


if __name__ == "__main__":
    main()
