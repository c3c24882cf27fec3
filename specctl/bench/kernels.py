"""``specctl bench kernels``: how fast one decoder step is, against the memory-bandwidth limit.

A decode or verification step of a small batch reads every weight once (and the KV cache
of the context); at batch sizes this small it is memory-bound, so the bound is
bytes read / bandwidth. The bandwidth is measured here (a device-to-device copy, bytes
read + written), not taken from a data sheet. Models can be real checkpoints or random
weights of a real model's shape (``bench.shapes``): timing does not depend on the values."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from specctl.engine.model import Decoder

VERIFY_SIZES = (1, 2, 4, 8, 16, 32, 64)


def weight_bytes_per_step(decoder: Decoder) -> int:
    """Bytes of weights a one-token step reads: every parameter once, except the embedding
    table, of which a step reads a few rows (unless the LM head reads it all: tied, unpacked),
    and a mixture of experts' experts, of which a token reads its top k."""
    spec = decoder.spec
    head_weight = getattr(decoder.lm_head, "weight", None)
    seen, total = set(), 0.0
    for name, parameter in decoder.named_parameters():
        if id(parameter) in seen:
            continue
        seen.add(id(parameter))
        if name.startswith("embed_tokens.") and parameter is not head_weight:
            continue
        share = spec.experts_per_token / spec.num_experts if ".mlp.experts." in name else 1.0
        total += parameter.numel() * parameter.element_size() * share
    return round(total)


def bandwidth_limit_ms(step_bytes: int, bandwidth_gbps: float) -> float:
    return step_bytes / (bandwidth_gbps * 1e9) * 1e3


def measure_bandwidth_gbps(device: str, megabytes: int = 1024, repeats: int = 10) -> float:
    """Copy bandwidth of ``device`` in GB/s, counting bytes read and written."""
    source = torch.empty(megabytes << 20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    timings = []
    for _ in range(repeats + 2):
        start = _now(device)
        target.copy_(source)
        timings.append(_now(device) - start)
    return 2 * source.numel() / statistics.median(timings[2:]) / 1e9


def _now(device: str) -> float:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def _timed(device: str, repeats: int, step: Callable[[], torch.Tensor], reset: Callable[[], object]
           ) -> tuple[float, float, float]:
    """min / median / max ms of ``repeats`` runs of ``step`` (after 3 untimed ones: they capture
    graphs), each ending in the host sync every real step has (its last logits' argmax), each
    followed by ``reset`` (untimed)."""
    timings = []
    for _ in range(repeats + 3):
        start = _now(device)
        int(step().argmax())
        timings.append((_now(device) - start) * 1e3)
        reset()
    kept = timings[3:]
    return min(kept), statistics.median(kept), max(kept)


@dataclass(frozen=True, slots=True)
class StepTiming:
    tokens: int
    ms_min: float
    ms_median: float
    ms_max: float


def primed_cache(decoder: Decoder, context: int, room: int, generator: torch.Generator):
    """A new cache holding ``context`` random tokens (their prefill run), with ``room`` slots more."""
    cache = decoder.new_cache(context + room)
    prompt = torch.randint(0, decoder.spec.vocab_size, (context,), generator=generator)
    decoder(prompt, torch.arange(context), cache, logits_at=torch.tensor([context - 1]))
    return cache


def time_steps(decoder: Decoder, context: int, sizes: tuple[int, ...], repeats: int,
               on_done: Callable[[], None] = lambda: None) -> list[StepTiming]:
    """Median (and spread) of ``repeats`` forwards of n new tokens after ``context`` cached ones,
    for each n in ``sizes``; the cache is cut back to the context after every step."""
    device = str(decoder.device)
    generator = torch.Generator().manual_seed(0)
    cache = primed_cache(decoder, context, max(sizes) + 1, generator)
    results = []
    for n in sizes:
        tokens = torch.randint(0, decoder.spec.vocab_size, (n,), generator=generator)
        positions = torch.arange(context, context + n)
        spread = _timed(device, repeats, lambda: decoder(tokens, positions, cache)[-1],
                        lambda: cache.truncate(context))
        results.append(StepTiming(n, *spread))
        on_done()
    cache.release()
    return results


@dataclass(frozen=True, slots=True)
class BatchTiming:
    sessions: int
    tokens: int  # new tokens of each session
    how: str  # "one replay a session" or "one eager forward"
    ms_min: float
    ms_median: float
    ms_max: float


REPLAY_EACH, ONE_EAGER = "one replay a session", "one eager forward"


def time_batches(decoder: Decoder, context: int, sessions: tuple[int, ...], tokens: tuple[int, ...], repeats: int,
                 on_done: Callable[[], None] = lambda: None) -> list[BatchTiming]:
    """A forward of several sessions (a draft server's batched step, a target's batched
    verification): each of ``sessions`` sessions adds ``tokens`` new tokens after ``context``
    of its own. Where the decoder's steps are graph replays, both ways a batch can run are
    timed — a replay per session (``Decoder.forward_many``'s choice up to
    ``REPLAY_PER_SESSION_UP_TO``) and one eager forward of all of them."""
    device = str(decoder.device)
    generator = torch.Generator().manual_seed(0)
    caches = [primed_cache(decoder, context, max(tokens) + 1, generator) for _ in range(max(sessions))]
    static = decoder.static
    per_session = static.per_session if static is not None else False
    results = []
    try:
        for count in sessions:
            for n in tokens:
                new = [torch.randint(0, decoder.spec.vocab_size, (n,), generator=generator) for _ in range(count)]
                positions = [torch.arange(context, context + n)] * count
                if static is not None:
                    static.per_session = per_session  # as the decoder had it: does it replay this many?
                hows = [True, False] if static is not None and static.replays_each(count) else [False]
                for replay_each in hows:
                    if static is not None:
                        static.per_session = replay_each
                    spread = _timed(
                        device, repeats,
                        lambda: decoder.forward_many(new, positions, caches[:count], [None] * count,
                                                     [torch.tensor([n - 1])] * count)[-1][-1],
                        lambda: [cache.truncate(context) for cache in caches[:count]])
                    results.append(BatchTiming(count, n, REPLAY_EACH if replay_each else ONE_EAGER, *spread))
                on_done()
    finally:
        if static is not None:
            static.per_session = per_session
        for cache in caches:
            cache.release()
    return results
