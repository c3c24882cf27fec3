"""Reading a request before its fields: the gateway's API key, and its body decoded into a
request struct of gateway.api — what is not JSON, not UTF-8 or not the struct's shape is a 400
that says where; fields the gateway does not serve are named once in the log and ignored."""

from __future__ import annotations

import logging
import re
from typing import Any, NoReturn

import msgspec

from specctl.gateway.api import ApiError

log = logging.getLogger("specctl.gateway")


def check_key(request: Any, api_key: str | None) -> None:
    """The gateway's --api-key, as OpenAI's clients send it or as Anthropic's do (``x-api-key``);
    a 401 otherwise."""
    if api_key and request.headers.get("Authorization", "") != f"Bearer {api_key}" and (
            request.headers.get("x-api-key") != api_key):
        raise ApiError(401, "Incorrect API key provided: send `Authorization: Bearer <key>`", code="invalid_api_key")


_warned_fields: set[str] = set()  # unknown request fields already named in the log
MAX_WARNED_FIELDS = 64  # clients may send any names: the log names the first ones, memory stays bounded


def parse_body(body: bytes, kind: type[msgspec.Struct]) -> Any:
    if not body.strip():
        raise ApiError(400, "the request body is empty: send a JSON object")
    try:
        req = msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        where = re.search(r"at `\$\.(\w+)", str(exc)) or re.search(r"missing required field `(\w+)`", str(exc))
        raise ApiError(400, f"invalid request: {exc}", param=where[1] if where else None) from None
    except msgspec.DecodeError as exc:
        if "UTF-8" in str(exc):  # msgspec >= 0.23: "Invalid UTF-8 encoded string", without the byte
            _not_utf8(body)
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    except UnicodeDecodeError:  # a string that is not UTF-8 (msgspec < 0.23 raises it as is)
        _not_utf8(body)
    _warn_unknown(body, kind)
    return req


def _not_utf8(body: bytes) -> NoReturn:
    """The 400 for a body whose strings are not UTF-8, naming the first byte that is not."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the request body is not valid UTF-8 JSON: a string holds byte "
                            f"0x{exc.object[exc.start]:02x}, which is not UTF-8") from None
    raise ApiError(400, "the request body is not valid UTF-8 JSON")


def _warn_unknown(body: bytes, kind: type[msgspec.Struct]) -> None:
    """Name each field the gateway neither serves nor refuses once in the log (ignored, as vLLM does)."""
    fields = msgspec.json.decode(body, type=dict[str, msgspec.Raw]).keys()  # a valid object: decoded above
    room = max(0, MAX_WARNED_FIELDS - len(_warned_fields))
    unknown = sorted(set(fields) - set(kind.__struct_fields__) - _warned_fields)[:room]
    if unknown:
        _warned_fields.update(unknown)
        log.warning("ignoring request field(s) %s: not a field this gateway serves on %s", ", ".join(unknown),
                    getattr(kind, "endpoint", kind.__name__))
