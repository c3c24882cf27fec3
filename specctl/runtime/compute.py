"""One compute thread per device owns the model and every torch call. The asyncio loop
hands it work through a queue and awaits futures, so network I/O never waits on compute
and compute never waits on the network (StarSD appendix E.3).

The queue is the global request buffer: the thread serves it in arrival order and
records StarSD's timings: t_s (service time), T_wait (time queued) and T_idle (the
thread's idle gaps), from which load % follows."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(slots=True)
class ComputeStats:
    jobs: int = 0
    busy_s: float = 0.0
    idle_s: float = 0.0
    wait_s: float = 0.0
    started: float = 0.0

    def snapshot(self, queued: int) -> dict:
        wall = max(time.perf_counter() - self.started, 1e-9)
        return {
            "jobs": self.jobs,
            "queue_depth": queued,
            "t_s_ms": round(1e3 * self.busy_s / self.jobs, 3) if self.jobs else 0.0,
            "T_wait_ms": round(1e3 * self.wait_s / self.jobs, 3) if self.jobs else 0.0,
            "T_idle_ms": round(1e3 * self.idle_s / self.jobs, 3) if self.jobs else 0.0,
            "load": round(self.busy_s / wall, 4),
            "jobs_per_s": round(self.jobs / wall, 3),
        }


class ComputeThread:
    def __init__(self, name: str = "compute") -> None:
        self._queue: queue.Queue = queue.Queue()
        self.stats = ComputeStats(started=time.perf_counter())
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put((fn, args, future, loop, time.perf_counter()))
        return await future

    def submit_nowait(self, fn: Callable[..., Any], *args: Any) -> None:
        """Fire work whose result nobody awaits (freeing a session's state on disconnect)."""
        self._queue.put((fn, args, None, None, time.perf_counter()))

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _serve(self) -> None:
        idle_since = time.perf_counter()
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, args, future, loop, queued_at = item
            start = time.perf_counter()
            self.stats.idle_s += start - idle_since
            self.stats.wait_s += start - queued_at
            try:
                result, error = fn(*args), None
            except BaseException as exc:  # delivered to the awaiting coroutine
                result, error = None, exc
            idle_since = time.perf_counter()
            self.stats.busy_s += idle_since - start
            self.stats.jobs += 1
            if future is not None:
                loop.call_soon_threadsafe(_resolve, future, result, error)


def _resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
