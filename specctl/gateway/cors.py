"""Cross-origin requests (CORS) for browser clients of the gateway, as vLLM's
``--allowed-origins``: an allowed ``Origin`` gets ``Access-Control-Allow-Origin`` on every
answer (streamed ones too) and its preflight ``OPTIONS`` a 204 naming the methods and
headers it may use.

Choice made here: vLLM allows every origin by default; here none is allowed until
``--allowed-origins`` names them (``*`` for any), because a gateway on a laptop would
otherwise answer any web page its user opens."""

from __future__ import annotations

from aiohttp import web

METHODS = "GET, POST, DELETE, OPTIONS"
HEADERS = "Authorization, Content-Type"


def allow_origin(origin: str | None, allowed: tuple[str, ...]) -> str | None:
    """The Access-Control-Allow-Origin value for ``origin`` (None: not allowed, no header)."""
    if not origin or not allowed:
        return None
    if "*" in allowed:
        return "*"
    return origin if origin in allowed else None


def preflight(request: web.Request, allowed: tuple[str, ...]) -> web.Response | None:
    """The answer to a CORS preflight from an allowed origin (None: not a preflight, or not allowed)."""
    if request.method != "OPTIONS" or "Access-Control-Request-Method" not in request.headers:
        return None
    origin = allow_origin(request.headers.get("Origin"), allowed)
    if origin is None:
        return None
    return web.Response(status=204, headers={
        "Access-Control-Allow-Origin": origin, "Access-Control-Allow-Methods": METHODS,
        "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers", HEADERS),
        "Access-Control-Max-Age": "600", "Vary": "Origin"})


def add_allow_origin(request: web.Request, response: web.StreamResponse, allowed: tuple[str, ...]) -> None:
    """Before an answer's headers go out (aiohttp's on_response_prepare, so streams get it too)."""
    origin = allow_origin(request.headers.get("Origin"), allowed)
    if origin is not None:
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Vary"] = "Origin"
