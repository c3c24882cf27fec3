"""A request's id, as vLLM takes it: the client's ``X-Request-Id`` header, else the body's
``request_id`` (vLLM's field), else a fresh one. It names the answer (``chatcmpl-<id>``,
``cmpl-<id>``), goes with each of its generations to the target instance (whose log lines name
it, a choice as ``<id>-<index>``), and with ``--enable-request-id-headers`` comes back in the
answer's ``X-Request-Id`` header (every answer's: the id given, or a fresh one)."""

from __future__ import annotations

import re
import uuid

from aiohttp import web

from specctl.gateway.api import ApiError

HEADER = "X-Request-Id"
MAX_LENGTH = 256
# the request's storage key (aiohttp >= 3.13 types them; a plain string before)
KEY = web.RequestKey("request_id", str) if hasattr(web, "RequestKey") else "request_id"
_VISIBLE = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no spaces: safe in a header and on one log line


def request_id(request: web.Request, body_id: str | None = None) -> str:
    """The request's id (``body_id``: the body's ``request_id``), kept on the request for the
    answer's header; a 400 for one that is empty, too long or not printable ASCII."""
    given = request.headers.get(HEADER)
    name, value = (HEADER, given) if given is not None else ("request_id", body_id)
    if value is None:
        value = uuid.uuid4().hex
    elif len(value) > MAX_LENGTH or not _VISIBLE.fullmatch(value):
        raise ApiError(400, f"{name} must be 1-{MAX_LENGTH} printable ASCII characters without spaces",
                       param=None if name == HEADER else name)
    request[KEY] = value
    return value


def add_header(request: web.Request, response: web.StreamResponse) -> None:
    """The answer's X-Request-Id: the request's id (a generation's, as it named its answer), else
    the header the client sent, else a fresh one (vLLM's middleware)."""
    if HEADER not in response.headers:
        response.headers[HEADER] = request.get(KEY) or request.headers.get(HEADER) or uuid.uuid4().hex
