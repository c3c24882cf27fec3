"""Running a role's async main: uvloop when installed, clean shutdown on Ctrl-C/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from typing import Awaitable, Callable

from specctl.errors import ConfigError
from specctl.runtime.compute import ComputeThread


def parse_hostport(value: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep:
        host, port = default_host, value
    try:
        number = int(port)
    except ValueError:
        raise ConfigError(f"expected HOST:PORT, got {value!r}") from None
    if not 0 < number < 65536:
        raise ConfigError(f"port must be in 1..65535, got {number}")
    return host.strip("[]") or default_host, number


def setup_logging(level: str = "info") -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


_SHUTDOWN_WAITERS: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
_SHUTDOWN_REQUESTED = threading.Event()  # a signal that came before anyone waited for it


async def wait_for_shutdown() -> None:
    """Until SIGTERM or SIGINT (Ctrl-C). In the loop's own thread the loop catches the
    signals; in a loop thread beside a main-thread compute loop, compute_in_main_thread does."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):  # pragma: no cover - Windows
                pass
    if _SHUTDOWN_REQUESTED.is_set():
        stop.set()
    entry = (loop, stop)
    _SHUTDOWN_WAITERS.append(entry)
    try:
        await stop.wait()
    finally:
        _SHUTDOWN_WAITERS.remove(entry)


def compute_in_main_thread(side: Callable[[], None], compute: ComputeThread,
                           on_signal: Callable[[], None] | None = None,
                           signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> None:
    """Serve ``compute`` from the main thread while ``side`` runs in a second thread; the
    compute loop ends when ``side`` returns. torch's OpenMP pays a large fork/join cost on
    every small op issued from a non-main thread (measured: an int8 draft layer 1.9x
    slower), and decoding is many small ops. ``signals`` go to ``on_signal`` (default:
    wake every ``wait_for_shutdown``), since only the main thread receives them."""
    failure: list[BaseException] = []

    def run_side() -> None:
        try:
            side()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            failure.append(exc)
        finally:
            compute.stop()

    def handler(_signum, _frame) -> None:
        (on_signal or request_shutdown)()

    previous = {sig: signal.signal(sig, handler) for sig in signals}
    thread = threading.Thread(target=run_side, name="specctl-side")
    thread.start()
    try:
        compute.serve_here()
    finally:
        thread.join()
        for sig, old in previous.items():
            signal.signal(sig, old)
    if failure:
        raise failure[0]


def request_shutdown() -> None:
    """What SIGINT/SIGTERM do: wake every wait_for_shutdown (or the next one to start)."""
    _SHUTDOWN_REQUESTED.set()
    for loop, event in list(_SHUTDOWN_WAITERS):
        loop.call_soon_threadsafe(event.set)


def run_with_compute(main: Callable[[ComputeThread], Awaitable], compute: ComputeThread) -> None:
    """A role's async main in a second thread, its compute served from the main thread."""
    compute_in_main_thread(lambda: run(main(compute)), compute)


def run_job_with_compute(main: Callable[[ComputeThread], Awaitable], compute: ComputeThread) -> None:
    """A batch job's async main (a benchmark), its compute served from the main thread. Ctrl-C
    or SIGTERM cancel it — its ``finally`` blocks close what it started — and then raise
    KeyboardInterrupt here (typer exits 130). A server awaits the signal
    (``wait_for_shutdown``); a job never does, so the handler alone left it running."""
    interrupted = threading.Event()
    running: list[tuple[asyncio.AbstractEventLoop, asyncio.Task]] = []

    async def cancellable() -> None:
        running.append((asyncio.get_running_loop(), asyncio.current_task()))
        if interrupted.is_set():  # the signal came before the loop started
            raise asyncio.CancelledError
        await main(compute)

    def cancel() -> None:
        interrupted.set()
        for loop, task in running:
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # the loop has closed: the job ended on its own
                pass

    try:
        compute_in_main_thread(lambda: run(cancellable()), compute, on_signal=cancel)
    except asyncio.CancelledError:
        if interrupted.is_set():
            raise KeyboardInterrupt from None
        raise


def run(main: Awaitable) -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is not available on Windows
        asyncio.run(main)
        return
    uvloop.run(main)


async def serve(server, announce: Callable[[int], None]) -> None:
    """Start a server role, say where it listens, serve until Ctrl-C or SIGTERM, close it."""
    bound = await server.start()
    announce(bound)
    try:
        await wait_for_shutdown()
    finally:
        await server.close()
