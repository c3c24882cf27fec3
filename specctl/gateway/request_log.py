"""vLLM's --enable-log-requests: one log line when a generation request is taken (its id, what
it asks beyond the defaults — not its prompt's text) and one when it ends (status, tokens,
seconds), so a request a client reports can be found by its id (gateway.request_id) in the
gateway's log and in its target instance's."""

from __future__ import annotations

import dataclasses
import logging

from specctl.spec.params import SamplingParams

log = logging.getLogger("specctl.gateway.requests")
LONGEST_VALUE = 80  # characters of one parameter's value on the line (a grammar can be long)
_DEFAULTS = SamplingParams()


def enable() -> None:
    """Asked for by the flag: shown whatever --log-level says (up's is warning)."""
    log.setLevel(logging.INFO)


ALWAYS = ("temperature", "max_tokens")  # shown even at their defaults (the APIs' defaults differ from the engine's)


def asked(params: SamplingParams) -> str:
    """temperature, max_tokens and the parameters that differ from the engine's defaults, as
    name=value (long values cut)."""
    fields = []
    for field in dataclasses.fields(params):
        value = getattr(params, field.name)
        if field.name in ALWAYS or value != getattr(_DEFAULTS, field.name):
            text = repr(value)
            fields.append(f"{field.name}={text if len(text) <= LONGEST_VALUE else text[:LONGEST_VALUE] + '...'}")
    return ", ".join(fields)


def received(request_id: str, endpoint: str, prompt_tokens: list[int], params: SamplingParams, n: int,
             stream: bool) -> None:
    """``prompt_tokens``: each prompt's length (a completion request may batch several)."""
    log.info("request %s received (%s): %s prompt tokens, n=%d, stream=%s, %s", request_id, endpoint,
             "+".join(map(str, prompt_tokens)), n, stream, asked(params))


def finished(request_id: str, endpoint: str, status: str, completion_tokens: int, seconds: float) -> None:
    log.info("request %s finished (%s): %s, %d completion tokens, %.3f s", request_id, endpoint, status,
             completion_tokens, seconds)
