"""``specctl bench serve``: the cluster as clients meet it — concurrent streaming requests
through the gateway — for the target alone and with speculation, each verifying one
session at a time or the due sessions of an instance together (batched verification).
Every variant runs in the same process on the same loaded models, one after the other;
with repeats the variants' order rotates each time, so a slow minute of the machine falls
on each in turn, and the ratios come with their spread over the repeats."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import aiohttp

from specctl.bench.prompts import BenchPrompt
from specctl.bench.spread import spread
from specctl.cluster.embedded import ClusterConfig, EmbeddedCluster
from specctl.config import AUTO_DEPTH, Config
from specctl.engine.loader import LoadedModel
from specctl.runtime.compute import ComputeThread

VARIANTS = {  # name -> (speculate, batched verification)
    "ar": (False, False), "ar batched": (False, True), "spec": (True, False), "spec batched": (True, True),
    # plain rounds while a target runs more than spec_max_sessions sessions, shorter chains by spec_depth_by_load
    "spec by load": (True, True),
    # each load's depth, or plain rounds, learnt by the target from its own rounds (spec_depth_by_load "auto")
    "spec auto": (True, True),
}
BY_LOAD, AUTO = "spec by load", "spec auto"


@dataclass(frozen=True, slots=True)
class ServeBenchSettings:
    concurrency: tuple[int, ...]
    max_tokens: int
    requests_per_client: int
    max_batch: int
    variants: tuple[str, ...] = ("ar", "ar batched", "spec", "spec batched")
    repeats: int = 1
    spec_max_sessions: int = 0  # the "spec by load" variant's (the others always speculate or never)
    spec_depth_by_load: str = ""  # the "spec by load" variant's (the others draft at the profile's depth)


async def _one(session: aiohttp.ClientSession, url: str, prompt: BenchPrompt, max_tokens: int) -> dict:
    body = {"max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    if prompt.chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt.prompt}]
    else:
        path, body["prompt"] = "/v1/completions", prompt.prompt
    start, first, text, usage = time.perf_counter(), None, [], {}
    async with session.post(url + path, json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"gateway answered {response.status}: {await response.text()}")
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                piece = choice.get("text") or (choice.get("delta") or {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
    end = time.perf_counter()
    return {"text": "".join(text), "tokens": usage.get("completion_tokens", 0), "latency_s": end - start,
            "ttft_s": (first or end) - start}


async def _level(url: str, prompts: list[BenchPrompt], clients: int, settings: ServeBenchSettings) -> dict:
    async def client(index: int, session: aiohttp.ClientSession) -> list[tuple[int, dict]]:
        done = []
        for r in range(settings.requests_per_client):
            which = (index * settings.requests_per_client + r) % len(prompts)
            done.append((which, await _one(session, url, prompts[which], settings.max_tokens)))
        return done

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        start = time.perf_counter()
        results = [item for part in await asyncio.gather(*(client(i, session) for i in range(clients))) for item in part]
        wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for _, r in results)
    return {
        "clients": clients, "requests": len(results), "tokens": tokens, "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 3),
        "texts": {str(which): r["text"] for which, r in results},
        "ttfts_s": [r["ttft_s"] for _, r in results], "latencies_s": [r["latency_s"] for _, r in results],
    }


async def run_serve_bench(config: Config, models: tuple[LoadedModel, LoadedModel | None], prompts: list[BenchPrompt],
                          settings: ServeBenchSettings, advance: Callable[[], None] = lambda: None,
                          compute: ComputeThread | None = None) -> dict:
    rows = []
    for repeat in range(settings.repeats):
        turn = repeat % len(settings.variants)
        for variant in settings.variants[turn:] + settings.variants[:turn]:
            speculate, batched = VARIANTS[variant]
            by_load = variant == BY_LOAD
            depths = settings.spec_depth_by_load if by_load else AUTO_DEPTH if variant == AUTO else ""
            variant_config = dataclasses.replace(config, max_batch=settings.max_batch if batched else 1,
                                                 spec_max_sessions=settings.spec_max_sessions if by_load else 0,
                                                 spec_depth_by_load=depths)
            cluster = EmbeddedCluster(variant_config, ClusterConfig(targets=1, gateway_port=0, speculate=speculate),
                                      models=models, compute=compute)
            try:
                urls = await cluster.start()
                await _one_warmup(urls["gateway"], prompts[0])
                for clients in settings.concurrency:
                    level = await _level(urls["gateway"], prompts, clients, settings)
                    tuner = cluster.targets[0].depth_tuner if cluster.targets else None
                    if tuner is not None:  # what it learnt by the end of this level (and the levels before)
                        level["depth_tuner"], level["depth_tuner_epochs"] = tuner.report(), tuner.epoch_log()
                    rows.append({"variant": variant, "repeat": repeat, **level})
                    advance()
            finally:
                await cluster.close()
    return summarize(rows, settings)


async def run_gateway_bench(url: str, prompts: list[BenchPrompt], settings: ServeBenchSettings,
                            advance: Callable[[], None] = lambda: None) -> dict:
    """The concurrency levels against a gateway that is already running (vLLM's ``bench serve
    --base-url``): the one variant "gateway", whatever it serves; no baseline to compare with."""
    await _one_warmup(url, prompts[0])
    rows = []
    for repeat in range(settings.repeats):
        for clients in settings.concurrency:
            rows.append({"variant": "gateway", "repeat": repeat, **await _level(url, prompts, clients, settings)})
            advance()
    report = summarize(rows, dataclasses.replace(settings, variants=("gateway",)))
    report["settings"]["gateway"] = url
    return report


async def _one_warmup(url: str, prompt: BenchPrompt) -> None:
    async with aiohttp.ClientSession() as session:
        await _one(session, url, prompt, 4)


def summarize(rows: list[dict], settings: ServeBenchSettings) -> dict:
    """One row per variant and concurrency over its repeats: tokens/s of the totals, TTFT and
    latency p50 over every request; its ratios against the baselines of the same concurrency
    (the totals' ratio, and with repeats each repeat's own ratio's spread), and the share of
    its texts the same as the target alone's in the same repeat (ar's, else ar batched's)."""
    runs: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        runs.setdefault((r["variant"], r["clients"]), []).append(r)
    merged = {key: _merged(key, levels) for key, levels in runs.items()}
    rates = {key: _rate(levels) for key, levels in runs.items()}  # unrounded, for the ratios
    for (variant, clients), row in merged.items():
        for base in ("ar", "ar batched"):
            ref = rates.get((base, clients))
            row[f"vs {base}"] = round(rates[(variant, clients)] / ref, 3) if ref else None
            if ref and settings.repeats > 1:
                ratios = [mine["tokens_per_s"] / theirs["tokens_per_s"]
                          for mine, theirs in zip(_by_repeat(runs[(variant, clients)]), _by_repeat(runs[(base, clients)]))
                          if theirs["tokens_per_s"]]
                row[f"vs {base} per repeat"] = spread(ratios, 3) if ratios else None
        # the target alone's texts: ar's, or batched ar's where ar was not run (the same texts, tested)
        reference = runs.get(("ar", clients)) or runs.get(("ar batched", clients))
        if reference is not None:
            row["same_as_ar_of"] = reference[0]["variant"]
            ar_texts = {r["repeat"]: r["texts"] for r in reference}
            same = [r["texts"].get(k) == v for r in runs[(variant, clients)] for k, v in ar_texts[r["repeat"]].items()]
            row["same_as_ar"] = round(sum(same) / len(same), 3) if same else None
    ordered = sorted(merged.values(), key=lambda r: (settings.variants.index(r["variant"]), r["clients"]))
    return {"settings": dataclasses.asdict(settings), "rows": ordered}


def _by_repeat(levels: list[dict]) -> list[dict]:
    return sorted(levels, key=lambda r: r["repeat"])


def _rate(levels: list[dict]) -> float:
    """Tokens per second of the levels' totals."""
    wall = sum(r["wall_s"] for r in levels)
    return sum(r["tokens"] for r in levels) / wall if wall else 0.0


def _merged(key: tuple[str, int], levels: list[dict]) -> dict:
    variant, clients = key
    row = {"variant": variant, "clients": clients, "requests": sum(r["requests"] for r in levels),
           "tokens": sum(r["tokens"] for r in levels), "wall_s": round(sum(r["wall_s"] for r in levels), 3),
           "tokens_per_s": round(_rate(levels), 3),
           "ttft_p50_ms": round(1e3 * statistics.median(t for r in levels for t in r["ttfts_s"]), 1),
           "latency_p50_ms": round(1e3 * statistics.median(t for r in levels for t in r["latencies_s"]), 1)}
    if len(levels) > 1:
        row["tokens_per_s_per_repeat"] = [r["tokens_per_s"] for r in _by_repeat(levels)]
    if any("depth_tuner" in r for r in levels):  # spec auto: each repeat's tuner, load by load
        row["depth_tuner_per_repeat"] = [r.get("depth_tuner") for r in _by_repeat(levels)]
        row["depth_tuner_epochs_per_repeat"] = [r.get("depth_tuner_epochs") for r in _by_repeat(levels)]
    return row
