"""How the gateway's errors leave: every failure of a request becomes a JSON error body with its
HTTP status — OpenAI's shape, Anthropic's on its routes (gateway.anthropic_api) — and the
gateway carries on; an unexpected one is logged with its request id."""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from aiohttp import web

from specctl.gateway import request_id
from specctl.gateway.anthropic_api import error_body as anthropic_error
from specctl.gateway.api import ApiError

log = logging.getLogger("specctl.gateway")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_middleware(max_body_bytes: int) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        shape = anthropic_error if request.path.startswith("/v1/messages") else ApiError.body
        try:
            return await handler(request)
        except ApiError as exc:
            headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else None
            return web.json_response(shape(exc), status=exc.status, headers=headers)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            message = {413: f"request body too large (limit {max_body_bytes} bytes): send fewer prompts a request, "
                            "or start the gateway with a larger --max-body-kb",
                       404: f"no route {request.method} {request.path}"}.get(exc.status, exc.reason)
            return web.json_response(shape(ApiError(exc.status, message)), status=exc.status)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as exc:  # noqa: BLE001 - one request's failure must not take the gateway down
            log.exception("request %s %s failed", request.path, request.get(request_id.KEY, ""))
            return web.json_response(shape(ApiError(500, f"internal error: {exc}", type="server_error")), status=500)
    return errors
