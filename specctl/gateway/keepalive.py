"""Streams whose first token is long in coming: their headers, then an SSE comment every few
seconds, while a long prompt is prefilled (or the request waits its turn for a session).

A streamed request's reply begins with its first token, so that a failure before it (no
instance free in time, a prompt the target refuses) is still an HTTP status. But a long
prompt on a CPU target takes minutes to prefill (Claude Code's 19k-token prompt on the 1.5B
target, 2 cores: 3,072 tokens in the first 5 minutes), and clients give up on a response
whose headers or events do not come: Node's fetch after 300 s (undici's headersTimeout),
Claude Code's watchdog after 300 s without an event, where it then sent the same request
again — and again, never served. So a stream that has not started after
``HEADERS_AFTER_S`` gets its headers and an SSE comment (which every SSE reader skips) every
``KEEPALIVE_S`` (Anthropic's stream: its message_start, then a ping event every
``KEEPALIVE_S``, since Claude Code's watchdog also ends a stream with no event for 300 s); a
failure to start after that is the choices' first event, which the reply sends in its own
shape, as it sends a failure mid-stream."""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

from aiohttp import web

from specctl.gateway.api import ApiError
from specctl.gateway.choices import Choices
from specctl.verify.client import RemoteError

HEADERS_AFTER_S = 10.0
KEEPALIVE_S = 10.0
# the request's key of the stream opened while it waited (a typed key where aiohttp has them, as request_id's)
OPENED = web.RequestKey("opened_stream", web.StreamResponse) if hasattr(web, "RequestKey") else "opened_stream"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
COMMENT = b": waiting for the first token\n\n"  # (a long prefill, or a turn for a session)


async def event_stream(request: web.Request) -> web.StreamResponse:
    """The request's event stream: the one opened while it waited for its first token, or a new one."""
    response = request.get(OPENED)
    if response is None:
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
    return response


@contextlib.asynccontextmanager
async def started(choices: Choices, request: web.Request | None, reply: object = None) -> AsyncIterator[Choices]:
    """``async with choices``; for a stream (``request`` given) whose start takes longer than
    HEADERS_AFTER_S, the headers and a keep-alive every KEEPALIVE_S until it starts: a comment,
    or the ``reply``'s own (its ``KEEPALIVE``, after its ``open(response)`` where it has one:
    Anthropic's ping after message_start)."""
    entering = asyncio.ensure_future(choices.__aenter__())
    try:
        if request is not None:
            done, _ = await asyncio.wait({entering}, timeout=HEADERS_AFTER_S)
            while not done:
                if (response := request.get(OPENED)) is None:
                    response = request[OPENED] = await event_stream(request)
                    if hasattr(reply, "open"):
                        await reply.open(response)
                await response.write(getattr(reply, "KEEPALIVE", COMMENT))
                done, _ = await asyncio.wait({entering}, timeout=KEEPALIVE_S)
        await entering
    except BaseException as exc:
        entering.cancel()  # the client left while it waited: the choices stop themselves
        with contextlib.suppress(BaseException):
            await entering
        if not (isinstance(exc, (ApiError, RemoteError)) and request is not None and request.get(OPENED)):
            raise
        choices.failed(exc)  # its headers are gone: the reply sends the failure as its stream's last event
    try:
        yield choices
    finally:
        await choices.__aexit__(None, None, None)
