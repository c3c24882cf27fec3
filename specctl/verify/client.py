"""A client of a target instance: GENERATE -> streamed TOKENS -> DONE or ERROR, and a
probe (handshake + stats) that works against any role."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import ssl as ssl_module
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable

from specctl.errors import SpecctlError, connection_failure
from specctl.net.framing import read_message, write_message
from specctl.net.handshake import client_handshake
from specctl.net.keepalive import keep_alive
from specctl.net.protocol import (
    CacheFlushed, Cancel, Done, Error, FlushCache, PromptProgress, Stats, StatsRequest, Tokens, Welcome, encode,
)
from specctl.runtime.tls import tls_failure
from specctl.spec.params import SamplingParams
from specctl.verify.wire_params import generate_message


class RemoteError(SpecctlError):
    """The target instance ended the request with an error (``code`` says which kind)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


async def _connect(host: str, port: int, ssl: ssl_module.SSLContext | None):
    try:
        reader, writer = await asyncio.open_connection(host, port, ssl=ssl, server_hostname=host if ssl else None)
    except ssl_module.SSLError as exc:
        raise RemoteError("unreachable", tls_failure(host, port, exc)) from None
    except OSError as exc:
        raise RemoteError("unreachable", f"cannot reach {host}:{port}: {connection_failure(exc)}") from None
    keep_alive(writer)
    return reader, writer


class TargetConnection:
    """One connection to a target instance that carries many generations at once, told
    apart by request id: a gateway keeps one per instance rather than a TCP connection and
    a handshake per request. When it drops, every stream on it ends with RemoteError."""

    def __init__(self, host: str, port: int, role: str = "client", auth_token: str | None = None,
                 ssl: ssl_module.SSLContext | None = None) -> None:
        self.host, self.port, self.role, self.auth_token, self.ssl = host, port, role, auth_token, ssl
        self.welcome: Welcome | None = None
        self.closed = False
        self.lost_reason: str | None = None  # why the caller closed it under its streams (close's reason)
        self._streams: dict[int, asyncio.Queue] = {}
        self._reqs = itertools.count(1)
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task | None = None

    async def connect(self) -> "TargetConnection":
        reader, self._writer = await _connect(self.host, self.port, self.ssl)
        try:
            self.welcome = await client_handshake(reader, self._writer, role=self.role, auth_token=self.auth_token)
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            self.close()
            raise RemoteError("unreachable", f"{self.host}:{self.port} dropped the connection: {exc}") from None
        except BaseException:
            self.close()
            raise
        self._reading = asyncio.create_task(self._read_loop(reader))
        return self

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                message = await read_message(reader)
                queue = self._streams.get(getattr(message, "req", None))
                if queue is not None:
                    queue.put_nowait(message)
                elif isinstance(message, Error) and message.req is None:
                    return  # about the connection itself (a protocol error): it is closed next
        except (asyncio.IncompleteReadError, ConnectionError, SpecctlError):
            pass
        finally:
            self.close()

    def generate(self, prompt: list[int], params: SamplingParams, request_id: str = "",
                 resumed: list[int] | tuple[int, ...] = ()) -> "TargetStream":
        """Start a generation on this connection (``request_id``: names it in the target's log;
        ``resumed``: the output a lost instance already sent, which this one goes on from)."""
        if self.closed or self._writer is None:
            raise RemoteError("disconnected", f"the connection to {self.host}:{self.port} is closed")
        req = next(self._reqs)
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[req] = queue
        self._send(generate_message(req, prompt, params, request_id, resumed))
        return TargetStream(self, req, queue)

    def _send(self, message) -> None:
        try:
            self._writer.write(encode(message))
        except (ConnectionError, RuntimeError, AttributeError):
            self.close()

    def _forget(self, req: int) -> None:
        self._streams.pop(req, None)

    def close(self, reason: str | None = None) -> None:
        """``reason``: why its streams end (their RemoteError says it; default: the instance
        closed the connection)."""
        if self.closed:
            return
        self.closed, self.lost_reason = True, reason
        for queue in self._streams.values():
            queue.put_nowait(None)  # None: the connection is gone
        if self._writer is not None:
            self._writer.close()
        if self._reading is not None and self._reading is not asyncio.current_task():
            self._reading.cancel()


class TargetStream:
    """One generation on a target instance. ``close()`` before it finished cancels it on
    the target (its state is freed everywhere); the connection carries on."""

    def __init__(self, connection: TargetConnection, req: int, queue: asyncio.Queue) -> None:
        self.connection, self.req, self._queue = connection, req, queue
        self.finished = False

    @property
    def welcome(self) -> Welcome | None:
        return self.connection.welcome

    async def next(self) -> Tokens | PromptProgress | Done:
        """The next TOKENS (or PROMPT_PROGRESS, when the generation asked) or the final DONE; an
        ERROR or a lost connection raises RemoteError."""
        message = await self._queue.get()
        if message is None:
            self.finished = True
            c = self.connection
            raise RemoteError("disconnected", c.lost_reason
                              or f"target instance {c.host}:{c.port} closed the connection mid-stream")
        if isinstance(message, Error):
            self.finished = True
            raise RemoteError(message.code, message.message)
        if isinstance(message, Done):
            self.finished = True
        return message

    async def cancel(self, timeout_s: float = 2.0) -> dict:
        """Stop the generation; returns its statistics so far (DONE "cancelled"), or {} when the
        target does not answer in time (closing the stream then cancels it all the same)."""
        if self.finished:
            return {}
        self.connection._send(Cancel(self.req))
        try:
            async with asyncio.timeout(timeout_s):
                while not isinstance(event := await self.next(), Done):
                    pass
            return event.stats
        except (RemoteError, TimeoutError):
            return {}

    def close(self) -> None:
        if not self.finished and not self.connection.closed:
            self.connection._send(Cancel(self.req))
        self.finished = True
        self.connection._forget(self.req)


@asynccontextmanager
async def open_stream(host: str, port: int, prompt: list[int], params: SamplingParams, role: str = "client",
                      auth_token: str | None = None,
                      ssl: ssl_module.SSLContext | None = None) -> AsyncIterator[TargetStream]:
    """One generation on its own connection (a command-line client)."""
    connection = await TargetConnection(host, port, role, auth_token, ssl).connect()
    try:
        stream = connection.generate(prompt, params)
        try:
            yield stream
        finally:
            stream.close()
    finally:
        connection.close()


async def remote_generate(
    host: str,
    port: int,
    prompt: list[int],
    params: SamplingParams,
    on_tokens: Callable[[list[int]], None] | None = None,
    auth_token: str | None = None,
    ssl: ssl_module.SSLContext | None = None,
    until: Callable[[], bool] | None = None,
    on_scores: Callable[[Tokens], None] | None = None,
    on_progress: Callable[[PromptProgress], None] | None = None,
) -> tuple[list[int], str, dict]:
    """Returns (tokens, finish_reason, stats). ``until`` (asked after each TOKENS, e.g. a stop
    string seen) true: the generation is cancelled on the target, finish_reason "stop", and the
    stats are those so far. ``on_scores``: given each TOKENS as it came (the log-probabilities
    ``params`` asked for ride on them); ``on_progress``: asks the target how far the prompt is
    read and is given each PROMPT_PROGRESS."""
    tokens: list[int] = []
    if on_progress is not None:
        params = dataclasses.replace(params, prompt_progress=True)
    async with open_stream(host, port, prompt, params, auth_token=auth_token, ssl=ssl) as stream:
        while isinstance(event := await stream.next(), (Tokens, PromptProgress)):
            if isinstance(event, PromptProgress):
                on_progress(event)
                continue
            tokens.extend(event.tokens)
            if on_scores:
                on_scores(event)
            if on_tokens:
                on_tokens(tokens)
            if until is not None and until():
                return tokens, "stop", await stream.cancel()
        return tokens, event.finish_reason, event.stats


async def _ask(host: str, port: int, request, answer: type, auth_token: str | None,
               ssl: ssl_module.SSLContext | None) -> tuple[Welcome, object]:
    """Handshake as a monitor, send one request, read its answer: (who answered, the answer)."""
    reader, writer = await _connect(host, port, ssl)
    try:
        welcome = await client_handshake(reader, writer, role="monitor", auth_token=auth_token)
        await write_message(writer, request)
        reply = await read_message(reader)
        if isinstance(reply, Error):
            raise RemoteError(reply.code, reply.message)
        if not isinstance(reply, answer):
            raise RemoteError("unexpected", f"expected {answer.__name__}, got {type(reply).__name__}")
        return welcome, reply
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise RemoteError("disconnected", f"{host}:{port} dropped the connection: {exc}") from None
    finally:
        writer.close()


async def probe(host: str, port: int, auth_token: str | None = None,
                ssl: ssl_module.SSLContext | None = None) -> tuple[Welcome, dict]:
    """Ask any role for one stats snapshot: (who answered, its stats)."""
    welcome, reply = await _ask(host, port, StatsRequest(), Stats, auth_token, ssl)
    return welcome, reply.stats


async def flush_cache(host: str, port: int, auth_token: str | None = None,
                      ssl: ssl_module.SSLContext | None = None) -> CacheFlushed:
    """Empty a target instance's or draft server's prefix cache: what it dropped."""
    return (await _ask(host, port, FlushCache(), CacheFlushed, auth_token, ssl))[1]


async def remote_stats(host: str, port: int, auth_token: str | None = None,
                       ssl: ssl_module.SSLContext | None = None) -> dict:
    """One stats snapshot from any role."""
    return (await probe(host, port, auth_token, ssl))[1]
