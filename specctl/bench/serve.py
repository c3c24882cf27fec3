"""``specctl bench serve``: the cluster as clients meet it — concurrent streaming requests
through the gateway — for the target alone and with speculation, each verifying one
session at a time or the due sessions of an instance together (batched verification).
Every variant runs in the same process on the same loaded models, one after the other."""

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
from specctl.cluster.embedded import ClusterConfig, EmbeddedCluster
from specctl.config import Config
from specctl.engine.loader import LoadedModel
from specctl.runtime.compute import ComputeThread

VARIANTS = {  # name -> (speculate, batched verification)
    "ar": (False, False), "ar batched": (False, True), "spec": (True, False), "spec batched": (True, True),
}


@dataclass(frozen=True, slots=True)
class ServeBenchSettings:
    concurrency: tuple[int, ...]
    max_tokens: int
    requests_per_client: int
    max_batch: int
    variants: tuple[str, ...] = tuple(VARIANTS)


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
        "ttft_p50_ms": round(1e3 * statistics.median(r["ttft_s"] for _, r in results), 1),
        "latency_p50_ms": round(1e3 * statistics.median(r["latency_s"] for _, r in results), 1),
        "texts": {str(which): r["text"] for which, r in results},
    }


async def run_serve_bench(config: Config, models: tuple[LoadedModel, LoadedModel | None], prompts: list[BenchPrompt],
                          settings: ServeBenchSettings, advance: Callable[[], None] = lambda: None,
                          compute: ComputeThread | None = None) -> dict:
    rows = []
    for variant in settings.variants:
        speculate, batched = VARIANTS[variant]
        variant_config = dataclasses.replace(config, max_batch=settings.max_batch if batched else 1)
        cluster = EmbeddedCluster(variant_config, ClusterConfig(targets=1, gateway_port=0, speculate=speculate), models=models,
                                  compute=compute)
        try:
            urls = await cluster.start()
            await _one_warmup(urls["gateway"], prompts[0])
            for clients in settings.concurrency:
                rows.append({"variant": variant, **await _level(urls["gateway"], prompts, clients, settings)})
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
    for clients in settings.concurrency:
        rows.append({"variant": "gateway", **await _level(url, prompts, clients, settings)})
        advance()
    for r in rows:
        r.pop("texts")
    return {"settings": {**dataclasses.asdict(settings), "variants": ["gateway"], "gateway": url}, "rows": rows}


async def _one_warmup(url: str, prompt: BenchPrompt) -> None:
    async with aiohttp.ClientSession() as session:
        await _one(session, url, prompt, 4)


def summarize(rows: list[dict], settings: ServeBenchSettings) -> dict:
    """Ratios against the baselines of the same concurrency, and whether every variant
    produced the same texts as the target alone."""
    by = {(r["variant"], r["clients"]): r for r in rows}
    for r in rows:
        for base in ("ar", "ar batched"):
            ref = by.get((base, r["clients"]))
            r[f"vs {base}"] = round(r["tokens_per_s"] / ref["tokens_per_s"], 3) if ref and ref["tokens_per_s"] else None
        ref = by.get(("ar", r["clients"]))
        if ref:
            same = [r["texts"].get(k) == v for k, v in ref["texts"].items()]
            r["same_as_ar"] = round(sum(same) / len(same), 3) if same else None
    for r in rows:
        r.pop("texts")
    return {"settings": dataclasses.asdict(settings), "rows": rows}
