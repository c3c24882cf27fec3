"""A client of a target instance: GENERATE -> streamed TOKENS -> DONE or ERROR."""

from __future__ import annotations

import asyncio
import ssl as ssl_module
from typing import Callable

from specctl.errors import SpecctlError
from specctl.net.framing import read_message, write_message
from specctl.net.handshake import client_handshake
from specctl.net.protocol import Done, Error, Generate, Tokens
from specctl.spec.sampling import SamplingParams


class RemoteError(SpecctlError):
    """The target instance ended the request with an error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


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
    try:
        reader, writer = await asyncio.open_connection(host, port, ssl=ssl, server_hostname=host if ssl else None)
    except OSError as exc:
        raise RemoteError("unreachable", f"cannot reach target instance {host}:{port}: {exc.strerror or exc}") from None
    try:
        await client_handshake(reader, writer, role="client", auth_token=auth_token)
        await write_message(writer, Generate(
            1, prompt, params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed,
            list(params.stop_token_ids), params.ignore_eos,
        ))
        tokens: list[int] = []
        while True:
            try:
                message = await read_message(reader)
            except asyncio.IncompleteReadError:
                raise RemoteError("disconnected", f"target instance {host}:{port} closed the connection mid-stream") from None
            if isinstance(message, Tokens):
                tokens.extend(message.tokens)
                if on_tokens:
                    on_tokens(tokens)
            elif isinstance(message, Done):
                return tokens, message.finish_reason, message.stats
            elif isinstance(message, Error):
                raise RemoteError(message.code, message.message)
    finally:
        writer.close()


async def remote_stats(host: str, port: int, auth_token: str | None = None,
                       ssl: ssl_module.SSLContext | None = None) -> dict:
    """One stats snapshot from any role (connects as a monitor)."""
    from specctl.net.protocol import Stats, StatsRequest

    reader, writer = await asyncio.open_connection(host, port, ssl=ssl, server_hostname=host if ssl else None)
    try:
        await client_handshake(reader, writer, role="monitor", auth_token=auth_token)
        await write_message(writer, StatsRequest())
        reply = await read_message(reader)
        if not isinstance(reply, Stats):
            raise RemoteError("unexpected", f"expected Stats, got {type(reply).__name__}")
        return reply.stats
    finally:
        writer.close()
