"""What the server roles' commands share: help texts, config checking, the admission model."""

from __future__ import annotations

import urllib.parse

from specctl.errors import ConfigError

AUTH_HELP = "shared auth token (or SPECCTL_AUTH_TOKEN); peers sign a nonce with it, it never crosses the wire"
PREFIX_CACHE_HELP = ("MiB of finished sessions' KV kept for prompts that start the same way (a chat's next turn, "
                     "a shared system prompt), so their prefill computes only the rest (default: 1024 on the CPU, "
                     "where a target computes every prompt row as a decode step would, so a restored prefix is "
                     "bit-identical to a fresh prefill; off for a bf16/fp16 target on CUDA, whose restored "
                     "prefixes differ from a fresh prefill by rounding; 0 = off)")

SPEC_MAX_SESSIONS_HELP = ("speculate while a target instance runs at most this many sessions; past them its rounds "
                          "verify the root alone (plain decoding, the same output) until the load falls, as vLLM's "
                          "speculative_disable_by_batch_size (default: the profile's; 0 = always speculate)")

SPEC_DEPTH_HELP = ("SESSIONS:DEPTH,...: while a target instance runs that many sessions or more, its draft's "
                   "chains and trees are at most that deep (e.g. 4:4,6:2: shorter proposals as the batch grows, as "
                   "SmartSpec); auto: each load's depth, or plain rounds, learnt from the instance's own rounds; "
                   "default: the profile's; '' = the draft's depth at any load")


def gateway_url(url: str, flag: str = "--gateway") -> str:
    """A gateway's base URL: http(s)://HOST[:PORT] (HOST:PORT alone means http://), without a
    trailing slash; anything else is a one-line error before anything connects."""
    text = url.strip()
    if "://" not in text:
        text = f"http://{text}"
    parts = urllib.parse.urlsplit(text)
    try:
        port_ok = parts.port is None or parts.port > 0
    except ValueError:
        port_ok = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
        raise ConfigError(f"{flag} must be a gateway's URL, e.g. http://127.0.0.1:8000, got {url!r}")
    return text.rstrip("/")


def checked(config_class, **values):
    """A server config from flags; its own validation becomes a one-line user error."""
    try:
        return config_class(**values)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def admission_model(plan: str | None, standalone: float | None, depth: int):
    """The StarSD model behind --admission-plan TS_MS,TV_MS,TC_MS,BETA (times in ms)."""
    from specctl.draft.plan import StarModel

    if plan is None and standalone is None:
        return None
    if plan is None or standalone is None:
        raise ConfigError("--admission-plan and --standalone go together")
    try:
        ts, tv, tc, beta = (float(part) for part in plan.split(","))
        return StarModel(ts / 1e3, tv / 1e3, tc / 1e3, beta, depth)
    except ValueError as exc:
        raise ConfigError(f"--admission-plan wants TS_MS,TV_MS,TC_MS,BETA, e.g. 40,220,1,0.8 ({exc})") from None
