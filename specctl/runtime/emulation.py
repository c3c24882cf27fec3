"""Emulated device time, for benchmarks only (never in production): a step padded to a
device's time with its real compute inside it, and a lane standing for a slower target."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from specctl.runtime.compute import ComputeLane


def sleep_rest(started: float, delay_s: float) -> None:
    """Emulated device time (--stage-delay-ms, --step-time-ms): a step that began at ``started``
    takes ``delay_s`` in all, its real compute included (it takes longer only if the compute
    does). The real compute stands in for the device's work, so it is not added on top of it."""
    rest = delay_s - (time.perf_counter() - started)
    if rest > 0:
        time.sleep(rest)


def floored(floor_s: float, device, compute: Callable[..., Any], *args: Any) -> Any:
    """``compute(*args)`` taking at least ``floor_s`` (``draft --step-time-ms``: a device whose step
    time does not grow with its rows, as a GPU's does not up to tens of rows; 0 = off, a plain
    call); on CUDA the floor counts the device's work, not its launch."""
    if not floor_s:
        return compute(*args)
    started = time.perf_counter()
    out = compute(*args)
    if device.type == "cuda":
        import torch  # here: this module, as runtime/compute.py, loads without torch

        torch.cuda.synchronize(device)
    sleep_rest(started, floor_s)
    return out


class SlowedLane:
    """A lane whose batched work (verification) waits ``delay_s`` before it is queued, and
    then takes at least ``floor_s`` from its submission, its compute included: stands for a
    slower target device in emulated benchmarks (bench star adds a delay; bench prespec sets
    a floor, so the compute — slowed or not by what else runs on this machine's cores —
    happens inside the emulated device time), never in production."""

    def __init__(self, lane: ComputeLane, delay_s: float, floor_s: float = 0.0) -> None:
        self.lane, self.delay_s, self.floor_s = lane, delay_s, floor_s

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self.lane.run(fn, *args)

    async def run_batched(self, key: str, fn: Callable[[list], list], item: Any) -> Any:
        loop = asyncio.get_running_loop()
        submitted = loop.time()
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        result = await self.lane.run_batched(key, fn, item)
        left = self.floor_s - (loop.time() - submitted)
        if left > 0:
            await asyncio.sleep(left)
        return result

    def submit_nowait(self, fn: Callable[..., Any], *args: Any) -> None:
        self.lane.submit_nowait(fn, *args)
