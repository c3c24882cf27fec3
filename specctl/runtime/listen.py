"""What every server role is configured with: where to listen and what to refuse."""

from __future__ import annotations

import asyncio
import errno
import os
import logging
import time
from dataclasses import dataclass

from aiolimiter import AsyncLimiter

from specctl.errors import ConfigError
from specctl.net.keepalive import keep_alive
from specctl.net.protocol import MAX_FRAME_BYTES

log = logging.getLogger("specctl.listen")


def peer_name(writer: asyncio.StreamWriter) -> str:
    """The connection's peer as HOST:PORT ([HOST]:PORT for IPv6), as the log lines name roles."""
    peer = writer.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        host = f"[{peer[0]}]" if ":" in str(peer[0]) else peer[0]
        return f"{host}:{peer[1]}"
    return str(peer)


@dataclass(slots=True)
class ListenConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0 = any free port
    max_sessions: int = 64
    max_frame_bytes: int = MAX_FRAME_BYTES
    kv_budget_bytes: int | None = None
    auth_token: str | None = None
    max_messages_per_s: float = 5000.0  # per connection (0 = unlimited); faster peers are slowed, not dropped

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")
        if self.max_frame_bytes < 1024:
            raise ValueError("max_frame_bytes must be >= 1024")
        if self.max_messages_per_s < 0:
            raise ValueError("max_messages_per_s must be >= 0 (0 = unlimited)")


class MessageRate:
    """The per-peer rate limit of DESIGN §5: a connection that sends more than ``per_s``
    messages a second has its next message wait (a leaky bucket), so one flooding peer
    cannot starve the others; it is slowed down, never disconnected."""

    def __init__(self, per_s: float) -> None:
        self._limiter = AsyncLimiter(per_s, 1.0) if per_s > 0 else None

    async def admit(self) -> bool:
        """Wait for room for one more message; True when the peer had to wait."""
        if self._limiter is None:
            return False
        waited = not self._limiter.has_capacity()
        await self._limiter.acquire()
        return waited


class LiveConnections:
    """The running connection handlers of a server, so that closing the server ends them
    all (a listening socket's close leaves accepted connections running)."""

    def __init__(self) -> None:
        self._tasks: dict[asyncio.Task, asyncio.StreamWriter] = {}

    def track(self, writer: asyncio.StreamWriter) -> None:
        """Called first thing in a connection handler."""
        task = asyncio.current_task()
        if task is not None:
            self._tasks[task] = writer
            task.add_done_callback(lambda t: self._tasks.pop(t, None))

    async def close_all(self, timeout_s: float = 5.0) -> None:
        for writer in list(self._tasks.values()):
            writer.transport.abort()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)


class ListeningServer:
    """What the server roles share: listen, track the live connections, write each
    connection's frames from its own queue, and on close end every connection and stop
    the compute lane. Subclasses set ``config``, ``ssl`` and ``compute`` and write ``_handle``."""

    config: ListenConfig

    def __init__(self) -> None:
        self._server: asyncio.base_events.Server | None = None
        self._live = LiveConnections()
        self.throttled = 0  # messages that waited for the per-peer rate limit
        self.rejected_requests = 0  # well-formed messages refused (bad or inconsistent requests)
        self._rejections_unlogged = 0
        self._last_rejection_log = 0.0

    def reject(self, peer: str, reason: str) -> None:
        """Count a refused request and log it in one line, at most once a second (a peer
        sending thousands of bad requests must not flood the log)."""
        self.rejected_requests += 1
        now = time.monotonic()
        if now - self._last_rejection_log < 1.0:
            self._rejections_unlogged += 1
            return
        more = f" ({self._rejections_unlogged} more since the last line)" if self._rejections_unlogged else ""
        log.warning("refused a request from %s: %s%s", peer, reason, more)
        self._last_rejection_log, self._rejections_unlogged = now, 0

    async def start(self) -> int:
        try:
            self._server = await asyncio.start_server(self._accepted, self.config.host, self.config.port, ssl=self.ssl)
        except OSError as exc:
            reason = os.strerror(exc.errno).lower() if exc.errno else str(exc)
            raise ConfigError(f"cannot listen on {self.config.host}:{self.config.port}: {reason}"
                              + ("; stop what listens there or pick another port with --port"
                                 if exc.errno == errno.EADDRINUSE else "")) from None
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop listening and end every connection (their sessions are freed)."""
        if self._server is not None:
            self._server.close()
        await self._live.close_all()
        if self._server is not None:
            await self._server.wait_closed()
        self.compute.stop()

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        keep_alive(writer)  # a peer that drops off without a FIN is found, and its state freed
        await self._handle(reader, writer)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    @staticmethod
    async def _write_loop(outgoing: asyncio.Queue, writer: asyncio.StreamWriter) -> None:
        """A slow peer only ever blocks its own queue (no head-of-line blocking). A peer that
        went away ends the loop quietly: the reader sees it and closes the connection."""
        while (frame := await outgoing.get()) is not None:
            writer.write(frame)
            try:
                await writer.drain()
            except ConnectionError:
                return
