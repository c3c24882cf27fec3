"""One compute thread per device owns the model and every torch call. The asyncio loop
hands it work through a queue and awaits futures, so network I/O never waits on compute
and compute never waits on the network (StarSD appendix E.3).

The queue is the global request buffer. The thread serves it work-conservingly in
arrival order; a job submitted with a batch key is served together with every other
queued job of the same key (up to ``max_batch``) in one call — one draft forward for the
pending requests of many sessions and targets. It records StarSD's timings: t_s
(service time per request), T_wait (time queued) and T_idle (idle gaps), per lane: roles
that share a device in one process share its thread through lanes."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

# How long a thread that roles share waits after a pass for the jobs its results cause (its
# follow-ups: a verification after a proposal, the next proposal after a verification).
# Loopback and the event loop bring them within a millisecond or two; a job that causes none
# costs this wait once.
FOLLOW_UPS_WAIT_S = 0.005


@dataclass(slots=True)
class ComputeStats:
    jobs: int = 0
    passes: int = 0
    busy_s: float = 0.0
    cpu_s: float = 0.0  # the compute thread's CPU time while busy: below busy_s when it was made to wait
    idle_s: float = 0.0
    wait_s: float = 0.0
    started: float = 0.0
    # Background work (pre-speculation) runs only while no job is queued; a job that arrives
    # during a background step waits for that step at most (the delay recorded here).
    background_s: float = 0.0
    background_steps: int = 0
    background_step_max_s: float = 0.0
    background_delay_max_s: float = 0.0

    def snapshot(self, queued: int) -> dict:
        wall = max(time.perf_counter() - self.started, 1e-9)
        per_job = lambda total: round(1e3 * total / self.jobs, 3) if self.jobs else 0.0  # noqa: E731
        return {
            "jobs": self.jobs,
            "queue_depth": queued,
            "t_s_ms": per_job(self.busy_s),
            "T_wait_ms": per_job(self.wait_s),
            "T_idle_ms": round(1e3 * self.idle_s / self.passes, 3) if self.passes else 0.0,
            "mean_batch": round(self.jobs / self.passes, 3) if self.passes else 0.0,
            "load": round(self.busy_s / wall, 4),
            "jobs_per_s": round(self.jobs / wall, 3),
            "busy_s": round(self.busy_s, 6),
            "cpu_s": round(self.cpu_s, 6),
            "idle_s": round(self.idle_s, 6),
            "wait_s": round(self.wait_s, 6),
            "passes": self.passes,
            "background_s": round(self.background_s, 6),
            "background_steps": self.background_steps,
            "background_step_max_ms": round(1e3 * self.background_step_max_s, 3),
            "background_delay_max_ms": round(1e3 * self.background_delay_max_s, 3),
        }


@dataclass(slots=True)
class _Job:
    fn: Callable[..., Any]
    args: tuple
    future: asyncio.Future | None
    loop: asyncio.AbstractEventLoop | None
    queued_at: float
    lane: "ComputeLane"
    batch_key: tuple | None = None


class ComputeLane:
    """One role's share of a compute thread: its jobs join the thread's single queue (so
    roles in one process never run torch from two threads at once — two OpenMP teams on
    the same cores spin against each other), and its statistics are its own."""

    def __init__(self, thread: "ComputeThread", owns_thread: bool = False, max_batch: int | None = None) -> None:
        self.thread, self.owns_thread = thread, owns_thread
        self.max_batch = max_batch  # None: the thread's
        self.stats = ComputeStats(started=time.perf_counter())
        self.last_end: float | None = None  # when this lane's last pass ended (T_idle)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.thread._put(_Job(fn, args, future, loop, time.perf_counter(), self))
        return await future

    async def run_batched(self, key: str, fn: Callable[[list], list], item: Any) -> Any:
        """``fn(items)`` gets every queued item of this lane and key and returns one result
        (or an exception instance) per item, in order."""
        return await self.submit_batched(key, fn, item)

    def submit_batched(self, key: str, fn: Callable[[list], list], item: Any) -> asyncio.Future:
        """``run_batched``, queued before this call returns (not when a task first runs)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.thread._put(_Job(fn, (item,), future, loop, time.perf_counter(), self, (id(self), key)))
        return future

    def submit_nowait(self, fn: Callable[..., Any], *args: Any) -> None:
        """Fire work whose result nobody awaits (freeing a session's state on disconnect)."""
        self.thread._put(_Job(fn, args, None, None, time.perf_counter(), self))

    @property
    def queue_depth(self) -> int:
        return self.thread.depth_of(self)

    def add_background(self, fn: Callable[[], bool]) -> None:
        """``fn()`` does one bounded step of background work and says whether it did any; it
        runs on the compute thread only while no job is queued, after ``wake_background()``."""
        self.thread._background.append((self, fn))

    def wake_background(self) -> None:
        self.thread._wake_background()

    def stop(self) -> None:
        """Stops the thread only when this lane owns it (a shared thread has another owner)."""
        if self.owns_thread:
            self.thread.stop()


class ComputeThread:
    """``spawn=False``: no thread is started; the caller serves the queue from its own
    thread with ``serve_here()`` — the main thread, where torch's OpenMP runs small ops
    about twice as fast as from any other thread (see ``runtime.loop.compute_in_main_thread``)."""

    def __init__(self, name: str = "compute", max_batch: int = 1, spawn: bool = True) -> None:
        self.max_batch = max_batch
        # > 0 where roles share the thread (an embedded cluster: share_between_roles)
        self.follow_ups_s = 0.0
        self._jobs: deque[_Job | None] = deque()
        self._arrivals = 0
        self._follow_ups: tuple[float, int] | None = None
        self._ready = threading.Condition()
        self._background: list[tuple[ComputeLane, Callable[[], bool]]] = []
        self._background_due = False
        self._recent_background: deque[tuple[float, float]] = deque(maxlen=16)  # (start, end) of recent steps
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True) if spawn else None
        if self._thread is not None:
            self._thread.start()

    def share_between_roles(self, wait_s: float = FOLLOW_UPS_WAIT_S) -> None:
        """Roles in this process submit each other's next jobs (a draft server and the target
        instances it drafts for, over loopback). After a pass the thread then waits up to
        ``wait_s`` for as many new jobs as the pass answered before it takes the next batch, so
        sessions answered together are served together. Taking the first follow-up at once
        (work-conserving) split four sessions into groups that alternated on the thread and
        never merged (mostly two sessions a forward; bench serve at 4 clients, spec batched
        14.6 -> 20.0 tok/s and ar batched 10.1 -> 20.6 with the wait)."""
        self.follow_ups_s = wait_s

    def serve_here(self) -> None:
        """Serve jobs in the calling thread until ``stop()``."""
        self._serve()

    def lane(self, owns_thread: bool = False, max_batch: int | None = None) -> ComputeLane:
        """Where a role submits its work (run, run_batched, submit_nowait) and keeps its stats."""
        return ComputeLane(self, owns_thread, max_batch)

    def _put(self, job: _Job | None) -> None:
        with self._ready:
            self._jobs.append(job)
            self._arrivals += 1
            self._ready.notify()

    @property
    def queue_depth(self) -> int:
        return len(self._jobs)

    def depth_of(self, lane: ComputeLane) -> int:
        with self._ready:
            return sum(1 for job in self._jobs if job is not None and job.lane is lane)

    def stop(self) -> None:
        self._put(None)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def _wake_background(self) -> None:
        with self._ready:
            self._background_due = True
            self._ready.notify()

    def _take(self) -> list[_Job] | None:
        """The next batch of jobs; [] = no job queued, background work is due; None = stop."""
        with self._ready:
            if self._follow_ups is not None:  # the last pass's follow-ups, expected (share_between_roles)
                deadline, count = self._follow_ups
                self._follow_ups = None
                while self._arrivals < count and (left := deadline - time.perf_counter()) > 0:
                    self._ready.wait(left)
            while not self._jobs:
                if self._background_due and self._background:
                    return []
                self._ready.wait()
            first = self._jobs.popleft()
            if first is None:
                return None
            batch = [first]
            limit = first.lane.max_batch or self.max_batch
            if first.batch_key is not None and limit > 1:
                for job in list(self._jobs):
                    if len(batch) >= limit:
                        break
                    if job is not None and job.batch_key == first.batch_key:
                        self._jobs.remove(job)
                        batch.append(job)
            return batch

    def _run_background(self) -> None:
        did = False
        for lane, fn in self._background:
            start = time.perf_counter()
            try:
                worked = bool(fn())
            except Exception:  # noqa: BLE001 - background work must never stop the thread
                logging.getLogger("specctl.compute").exception("background work failed")
                worked = False
            end = time.perf_counter()
            if worked:
                did = True
                self._recent_background.append((start, end))
                lane.stats.background_s += end - start
                lane.stats.background_steps += 1
                lane.stats.background_step_max_s = max(lane.stats.background_step_max_s, end - start)
        if not did:
            with self._ready:
                self._background_due = False

    def _serve(self) -> None:
        while (batch := self._take()) is not None:
            if not batch:
                self._run_background()
                continue
            start, cpu_start = time.perf_counter(), time.thread_time()
            head = batch[0]
            lane, stats = head.lane, head.lane.stats
            stats.idle_s += start - (lane.last_end if lane.last_end is not None else stats.started)
            stats.wait_s += sum(start - job.queued_at for job in batch)
            # How long the head job waited on background steps (one at most, by design).
            waited = sum(max(0.0, min(end, start) - max(began, head.queued_at)) for began, end in self._recent_background)
            stats.background_delay_max_s = max(stats.background_delay_max_s, waited)
            try:
                if head.batch_key is None:
                    outcomes = [(head.fn(*head.args), None)]
                else:
                    outcomes = [(r, None) if not isinstance(r, BaseException) else (None, r)
                                for r in head.fn([job.args[0] for job in batch])]
            except BaseException as exc:  # delivered to every awaiting coroutine
                outcomes = [(None, exc)] * len(batch)
            lane.last_end = time.perf_counter()
            if self.follow_ups_s:
                with self._ready:
                    self._follow_ups = (lane.last_end + self.follow_ups_s,
                                        self._arrivals + sum(job.future is not None for job in batch))
            stats.busy_s += lane.last_end - start
            stats.cpu_s += time.thread_time() - cpu_start
            stats.jobs += len(batch)
            stats.passes += 1
            for job, (result, error) in zip(batch, outcomes):
                if job.future is not None:
                    try:
                        job.loop.call_soon_threadsafe(_resolve, job.future, result, error)
                    except RuntimeError:  # its loop has closed (a cancelled job ended meanwhile): no one waits
                        pass


def timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """``fn(*args)`` and the seconds it took, measured where it runs (a job: not its wait in the queue)."""
    started = time.perf_counter()
    return fn(*args), time.perf_counter() - started


def _resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
