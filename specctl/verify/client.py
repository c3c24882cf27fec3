"""A client of a target instance: GENERATE -> streamed TOKENS -> DONE or ERROR, and a
probe (handshake + stats) that works against any role."""

from __future__ import annotations

import asyncio
import ssl as ssl_module
from typing import Callable

from specctl.errors import SpecctlError
from specctl.net.framing import read_message, write_message
from specctl.net.handshake import client_handshake
from specctl.net.protocol import Cancel, Done, Error, Generate, Stats, StatsRequest, Tokens, Welcome
from specctl.spec.sampling import SamplingParams


class RemoteError(SpecctlError):
    """The target instance ended the request with an error (``code`` says which kind)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


async def _connect(host: str, port: int, ssl: ssl_module.SSLContext | None):
    try:
        return await asyncio.open_connection(host, port, ssl=ssl, server_hostname=host if ssl else None)
    except OSError as exc:
        raise RemoteError("unreachable", f"cannot reach {host}:{port}: {exc.strerror or exc}") from None


class TargetStream:
    """One generation on a target instance, as an async context manager: leaving it early
    closes the connection, which cancels the session and frees its state everywhere."""

    def __init__(self, host: str, port: int, prompt: list[int], params: SamplingParams, role: str = "client",
                 auth_token: str | None = None, ssl: ssl_module.SSLContext | None = None) -> None:
        self.host, self.port, self.prompt, self.params = host, port, prompt, params
        self.role, self.auth_token, self.ssl = role, auth_token, ssl
        self.welcome: Welcome | None = None
        self._reader = self._writer = None

    async def __aenter__(self) -> "TargetStream":
        self._reader, self._writer = await _connect(self.host, self.port, self.ssl)
        try:
            self.welcome = await client_handshake(self._reader, self._writer, role=self.role, auth_token=self.auth_token)
            p = self.params
            await write_message(self._writer, Generate(
                1, self.prompt, p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, list(p.stop_token_ids), p.ignore_eos,
            ))
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            self._writer.close()
            raise RemoteError("unreachable", f"{self.host}:{self.port} dropped the connection: {exc}") from None
        except BaseException:
            self._writer.close()
            raise
        return self

    async def __aexit__(self, *exc_info) -> None:
        if self._writer is not None:
            self._writer.close()

    async def next(self) -> Tokens | Done:
        """The next TOKENS or the final DONE; an ERROR or a lost connection raises RemoteError."""
        while True:
            try:
                message = await read_message(self._reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                raise RemoteError("disconnected", f"target instance {self.host}:{self.port} closed the connection mid-stream") from None
            if isinstance(message, (Tokens, Done)):
                return message
            if isinstance(message, Error):
                raise RemoteError(message.code, message.message)

    async def cancel(self, timeout_s: float = 2.0) -> dict:
        """Stop the generation; returns its statistics so far (DONE "cancelled"), or {} when the
        target does not answer in time (leaving the context then cancels it all the same)."""
        try:
            await write_message(self._writer, Cancel(1))
            async with asyncio.timeout(timeout_s):
                while not isinstance(event := await self.next(), Done):
                    pass
            return event.stats
        except (RemoteError, ConnectionError, TimeoutError):
            return {}


async def remote_generate(
    host: str,
    port: int,
    prompt: list[int],
    params: SamplingParams,
    on_tokens: Callable[[list[int]], None] | None = None,
    auth_token: str | None = None,
    ssl: ssl_module.SSLContext | None = None,
) -> tuple[list[int], str, dict]:
    """Returns (tokens, finish_reason, stats)."""
    tokens: list[int] = []
    async with TargetStream(host, port, prompt, params, auth_token=auth_token, ssl=ssl) as stream:
        while isinstance(event := await stream.next(), Tokens):
            tokens.extend(event.tokens)
            if on_tokens:
                on_tokens(tokens)
        return tokens, event.finish_reason, event.stats


async def probe(host: str, port: int, auth_token: str | None = None,
                ssl: ssl_module.SSLContext | None = None) -> tuple[Welcome, dict]:
    """Handshake as a monitor and ask for one stats snapshot: (who answered, its stats)."""
    reader, writer = await _connect(host, port, ssl)
    try:
        welcome = await client_handshake(reader, writer, role="monitor", auth_token=auth_token)
        await write_message(writer, StatsRequest())
        reply = await read_message(reader)
        if not isinstance(reply, Stats):
            raise RemoteError("unexpected", f"expected Stats, got {type(reply).__name__}")
        return welcome, reply.stats
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise RemoteError("disconnected", f"{host}:{port} dropped the connection: {exc}") from None
    finally:
        writer.close()


async def remote_stats(host: str, port: int, auth_token: str | None = None,
                       ssl: ssl_module.SSLContext | None = None) -> dict:
    """One stats snapshot from any role."""
    return (await probe(host, port, auth_token, ssl))[1]
