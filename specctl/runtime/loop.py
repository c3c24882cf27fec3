"""Running a role's async main: uvloop when installed, clean shutdown on Ctrl-C/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Awaitable, Callable

from specctl.errors import ConfigError


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


async def wait_for_shutdown() -> None:
    """Until SIGTERM or SIGINT (Ctrl-C)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # pragma: no cover - Windows
            pass
    await stop.wait()


def run(main: Awaitable) -> None:
    try:
        import uvloop

        uvloop.run(main)
    except ImportError:  # pragma: no cover
        asyncio.run(main)


async def serve(server, announce: Callable[[int], None]) -> None:
    """Start a server role, say where it listens, serve until Ctrl-C or SIGTERM, close it."""
    bound = await server.start()
    announce(bound)
    try:
        await wait_for_shutdown()
    finally:
        await server.close()
