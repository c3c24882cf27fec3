"""The versioned handshake: the server sends a Challenge with a nonce; the client answers
Hello (role, vocabulary fingerprint, HMAC of the nonce when a token is set); the server
answers Welcome or an Error and closes. The token itself never crosses the wire."""

from __future__ import annotations

import asyncio
import ssl as ssl_module
from typing import Awaitable, Callable

from specctl.errors import SpecctlError, StageUnavailable, VocabMismatch
from specctl.net.framing import new_nonce, read_message, sign, verify_signature, write_message
from specctl.net.keepalive import keep_alive
from specctl.net.protocol import PROTOCOL_VERSION, Challenge, Error, Hello, ProtocolError, Welcome
from specctl.runtime.tls import tls_failure

HANDSHAKE_TIMEOUT_S = 10.0


class AuthError(SpecctlError):
    """Wrong or missing auth token."""


class HandshakeRefused(SpecctlError):
    """The server refused the handshake (version, role or capacity)."""


class HandshakeTimeout(SpecctlError, TimeoutError):
    """The server sent no handshake in time: not a specctl role, or one serving TLS to a client
    speaking plain TCP (a TimeoutError still, for the callers that retry on one)."""


class TLSFailed(SpecctlError, ConnectionError):
    """TLS could not be set up (a ConnectionError still, for the callers that reconnect)."""


async def _handshake_message(reader: asyncio.StreamReader, what: str):
    try:
        return await asyncio.wait_for(read_message(reader, max_bytes=64 << 10), HANDSHAKE_TIMEOUT_S)
    except TimeoutError:
        raise HandshakeTimeout(f"no {what} from the server within {HANDSHAKE_TIMEOUT_S:g} s: is it a specctl role, "
                               "running (not stopped or swamped), and does it serve TLS (then pass --tls-ca CA)?"
                               ) from None


async def server_handshake(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    *,
    role: str,
    model: str,
    fingerprint: str,
    max_sessions: int,
    auth_token: str | None,
    accept_roles: dict[str, bool],  # client role -> must its vocabulary fingerprint match?
    before_welcome: Callable[[Hello], Awaitable[None]] | None = None,
) -> Hello:
    """Returns the client's Hello, or sends an Error and raises (the caller closes).
    ``before_welcome`` runs once the client is accepted and before it is welcomed (a
    pipeline stage builds the rest of its chain there); a SpecctlError from it is sent
    to the client as an "unavailable" error."""
    nonce = new_nonce()
    await write_message(writer, Challenge(PROTOCOL_VERSION, role, nonce))
    hello = await asyncio.wait_for(read_message(reader, max_bytes=64 << 10), HANDSHAKE_TIMEOUT_S)

    async def refuse(code: str, message: str, exc: type[Exception]) -> None:
        await write_message(writer, Error(code, message))
        raise exc(message)

    if not isinstance(hello, Hello):
        await refuse("protocol", f"expected Hello, got {type(hello).__name__}", ProtocolError)
    if hello.version != PROTOCOL_VERSION:
        await refuse("version", f"protocol version {hello.version} is not supported (this {role} speaks {PROTOCOL_VERSION})", HandshakeRefused)
    if auth_token and not verify_signature(auth_token, nonce, hello.auth):
        await refuse("auth", "authentication failed: wrong or missing auth token (--auth-token / SPECCTL_AUTH_TOKEN)", AuthError)
    if hello.role not in accept_roles:
        await refuse("role", f"a {role} does not serve {hello.role!r} clients (accepts: {', '.join(accept_roles)})", HandshakeRefused)
    if accept_roles[hello.role] and hello.fingerprint != fingerprint:
        await refuse(
            "vocab_mismatch",
            f"vocabulary mismatch: {role} model {model!r} has fingerprint {fingerprint}, the {hello.role} "
            f"{hello.model!r} has {hello.fingerprint}; draft and target must share a tokenizer",
            VocabMismatch,
        )
    if before_welcome is not None:
        try:
            await before_welcome(hello)
        except SpecctlError as exc:
            await refuse("unavailable", str(exc), type(exc))
    await write_message(writer, Welcome(PROTOCOL_VERSION, role, model, fingerprint, max_sessions))
    return hello


async def client_handshake(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    *,
    role: str,
    model: str = "",
    fingerprint: str = "",
    auth_token: str | None = None,
    layers: list[int] | None = None,
) -> Welcome:
    challenge = await _handshake_message(reader, "handshake")
    if not isinstance(challenge, Challenge):
        raise ProtocolError(f"expected Challenge, got {type(challenge).__name__}")
    auth = sign(auth_token, challenge.nonce) if auth_token else b""
    await write_message(writer, Hello(PROTOCOL_VERSION, role, fingerprint, model, auth, layers or []))
    reply = await _handshake_message(reader, "answer to its handshake")
    if isinstance(reply, Error):
        raise {"auth": AuthError, "vocab_mismatch": VocabMismatch, "unavailable": StageUnavailable}.get(
            reply.code, HandshakeRefused)(reply.message)
    if not isinstance(reply, Welcome):
        raise ProtocolError(f"expected Welcome, got {type(reply).__name__}")
    return reply


async def open_peer(host: str, port: int, *, role: str, model: str = "", fingerprint: str = "",
                    auth_token: str | None = None, ssl: ssl_module.SSLContext | None = None,
                    layers: list[int] | None = None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, Welcome]:
    """Connect (TLS when ``ssl`` is given) and shake hands as ``role``; the connection is
    closed again when the handshake fails."""
    try:
        reader, writer = await asyncio.open_connection(host, port, ssl=ssl, server_hostname=host if ssl else None)
    except ssl_module.SSLError as exc:
        raise TLSFailed(tls_failure(host, port, exc)) from None
    keep_alive(writer)
    try:
        welcome = await client_handshake(reader, writer, role=role, model=model, fingerprint=fingerprint,
                                         auth_token=auth_token, layers=layers)
    except BaseException:
        writer.close()
        raise
    return reader, writer, welcome
