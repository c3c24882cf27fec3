"""What chunked prefill does for a session that is streaming when a long prompt arrives: the
default pair's embedded cluster (draft server, one target instance, gateway); one request
streams its tokens, and once it is under way another arrives with a prompt of about 1,500
tokens. Without chunks the long prompt's prefill is one job on each side, and the streaming
session gets no token until it is done; with chunks it decodes between them. Prints, per
setting, the streaming session's longest gap between two tokens, the long request's time to
its first token and both texts' sameness; writes a JSON file. ``--helpers N`` makes the long
prompt longer (60: ~1,500 tokens; 240: ~6,000); ``--fixed`` runs each chunk setting a second
time with every job of the same size (no shrinking deeper in the prompt, engine.prefill_jobs).

    python examples/chunked_prefill.py OUT.json [--chunks 0,512] [--repeats 2] [--dtype bf16] [--helpers 60] [--fixed]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import openai
from rich.console import Console

from specctl.cluster.embedded import ClusterConfig, ClusterThread
from specctl.config import build_config

STREAMING = "def quicksort(items):\n    \"\"\"Sort a list of numbers.\"\"\"\n"


def long_prompt(helpers: int) -> str:
    return ("# A module with many small helpers; review each one.\n"
            + "".join(f"def helper_{i}(values):\n    return [v * {i} + {i % 7} for v in values if v % {i % 5 + 2}]\n\n"
                      for i in range(helpers)))


def spread(xs: list[float]) -> str:
    return f"{min(xs):.2f}/{statistics.median(xs):.2f}/{max(xs):.2f}"


def one_run(url: str, model: str, stream_tokens: int, long_text: str) -> dict:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    arrivals: list[float] = []
    texts: dict[str, str] = {"streaming": "", "long": ""}
    long: dict = {}
    under_way = threading.Event()

    def send_long() -> None:
        under_way.wait()
        started = time.perf_counter()
        reply = client.completions.create(model=model, prompt=long_text, max_tokens=4, temperature=0)
        long.update(sent=started, done=time.perf_counter(), prompt_tokens=reply.usage.prompt_tokens)
        texts["long"] = reply.choices[0].text

    other = threading.Thread(target=send_long)
    other.start()
    for chunk in client.completions.create(model=model, prompt=STREAMING, max_tokens=stream_tokens, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].text:
            arrivals.append(time.perf_counter())
            texts["streaming"] += chunk.choices[0].text
            if len(arrivals) == 8:
                under_way.set()
    other.join()
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    during = [b - a for a, b in zip(arrivals, arrivals[1:]) if b > long["sent"] and a < long["done"]]
    return {"max_gap_s": round(max(gaps), 3), "max_gap_during_long_s": round(max(during or [0.0]), 3),
            # streamed pieces of text (a round's tokens each), not tokens
            "tokens_during_long": sum(1 for t in arrivals if long["sent"] < t < long["done"]),
            "long_latency_s": round(long["done"] - long["sent"], 3), "long_prompt_tokens": long["prompt_tokens"],
            "texts": texts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--chunks", default="0,512")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--stream-tokens", type=int, default=160)
    parser.add_argument("--helpers", type=int, default=60)
    parser.add_argument("--fixed", action="store_true")
    args = parser.parse_args()
    console = Console(width=120)
    settings = [(int(c), fixed) for c in args.chunks.split(",") for fixed in ((False, True) if args.fixed else (False,))
                if not (fixed and int(c) == 0)]
    runs: dict[str, list[dict]] = {name(*setting): [] for setting in settings}
    for repeat in range(args.repeats):
        for chunk, fixed in settings:  # alternated: the machine's drift falls on every setting
            config = build_config(None, dtype=args.dtype, prefill_chunk=chunk, prefix_cache_mb=0)
            cluster = ClusterThread(config, ClusterConfig(targets=1, gateway_port=0), Console(stderr=True))
            urls = cluster.start()
            try:
                if fixed:  # every job of ``chunk`` tokens, as before 2026-12-07
                    embedded = cluster.cluster
                    for decoder in (embedded.targets[0].model.decoder, embedded.draft_server.model.decoder):
                        decoder.prefill_key_cost = 0.0
                openai.OpenAI(base_url=urls["gateway"] + "/v1", api_key="unused").completions.create(
                    model=config.target, prompt="Hello", max_tokens=4, temperature=0)  # warm-up
                run = one_run(urls["gateway"], config.target, args.stream_tokens, long_prompt(args.helpers))
            finally:
                cluster.stop()
            runs[name(chunk, fixed)].append(run)
            console.print(f"repeat {repeat + 1} prefill_chunk {name(chunk, fixed)}: "
                          f"longest gap {run['max_gap_s']:.2f}s, "
                          f"{run['tokens_during_long']} pieces of text streamed meanwhile, long request "
                          f"{run['long_latency_s']:.2f}s ({run['long_prompt_tokens']} prompt tokens)")
    console.print(f"\n{args.dtype}, the default pair, embedded cluster; min / median / max over {args.repeats} runs")
    console.print(f"{'prefill_chunk':>13}  {'longest gap (s)':>17}  {'pieces meanwhile':>17}  {'long request (s)':>17}")
    for setting, rs in runs.items():
        console.print(f"{setting:>13}  {spread([r['max_gap_s'] for r in rs]):>17}  "
                      f"{spread([r['tokens_during_long'] for r in rs]):>17}  {spread([r['long_latency_s'] for r in rs]):>17}")
    first = next(iter(runs.values()))[0]["texts"]
    same = all(r["texts"] == first for rs in runs.values() for r in rs)
    console.print(f"every run's two texts the same: {'yes' if same else 'NO'}")
    with open(args.out, "w") as f:
        json.dump({"settings": vars(args), "runs": runs}, f, indent=1)


def name(chunk: int, fixed: bool) -> str:
    return f"{chunk} fixed" if fixed else str(chunk)


if __name__ == "__main__":
    main()
