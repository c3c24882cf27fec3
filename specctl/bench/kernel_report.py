"""``specctl bench kernels``' JSON report from the timings bench.kernels measures: per step
size each variant's spread, the fastest's tokens a second and fraction of the memory-bandwidth
limit, and batches of sessions against their steps one after another."""

from __future__ import annotations

import torch

from specctl.bench.kernels import BatchTiming, StepTiming, bandwidth_limit_ms, weight_bytes_per_step
from specctl.engine.model import Decoder


def kernels_report(name: str, decoder: Decoder, timings: dict[str, list[StepTiming]], bandwidth_gbps: float,
                   context: int, settings: dict, batches: dict[str, list[BatchTiming]] | None = None) -> dict:
    """The JSON report: per step size, each variant's timings (eager, CUDA graphs, graphs +
    torch.compile), and tokens/s and the fraction of the bandwidth limit of the fastest."""
    spec = decoder.spec
    kv_bytes = spec.kv_bytes_per_token(decoder.dtype) * context
    step_bytes = weight_bytes_per_step(decoder) + kv_bytes
    limit = bandwidth_limit_ms(step_bytes, bandwidth_gbps)
    rows = []
    for i, tokens in enumerate(t.tokens for t in next(iter(timings.values()))):
        best = min((variant[i] for variant in timings.values()), key=lambda t: t.ms_median)
        rows.append({
            "tokens": tokens,
            "ms_min_median_max": {name: [v[i].ms_min, v[i].ms_median, v[i].ms_max] for name, v in timings.items()},
            "tokens_per_s": tokens / best.ms_median * 1e3,
            "fraction_of_bandwidth_limit": limit / best.ms_median,
        })
    return {
        "model": name,
        "settings": settings,
        "device": torch.cuda.get_device_name(decoder.device) if decoder.device.type == "cuda" else "cpu",
        "params_millions": round(sum(p.numel() for p in decoder.parameters()) / 1e6, 1),
        "bytes_per_step": step_bytes,
        "bandwidth_gbps": round(bandwidth_gbps, 1),
        "bandwidth_limit_ms": limit,
        "variants": list(timings),
        "steps": rows,
        "batches": [
            {"variant": variant, "sessions": b.sessions, "tokens_each": b.tokens, "how": b.how,
             "ms_min_median_max": [b.ms_min, b.ms_median, b.ms_max],
             "vs_sessions_times_one_step": _vs_one_at_a_time(b, timings[variant])}
            for variant, timed in (batches or {}).items() for b in timed
        ],
    }


def _vs_one_at_a_time(batch: BatchTiming, steps: list[StepTiming]) -> float | None:
    """The batch's median over its sessions' steps one after another (None: that size was not timed)."""
    one = next((t.ms_median for t in steps if t.tokens == batch.tokens), None)
    return batch.ms_median / (batch.sessions * one) if one else None
