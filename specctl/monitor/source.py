"""Where the monitor's feeds come from: a gateway's /v1/stats, or the roles themselves
(probed over the wire protocol), assembled into the same shape."""

from __future__ import annotations

import asyncio
import ssl as ssl_module
import time

import aiohttp

from specctl.runtime.loop import parse_hostport
from specctl.verify.client import probe


async def gateway_feed(session: aiohttp.ClientSession, url: str, api_key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with session.get(url.rstrip("/") + "/v1/stats", headers=headers, timeout=aiohttp.ClientTimeout(total=3)) as r:
        r.raise_for_status()
        return await r.json()


PROBE_TIMEOUT_S = 3.0


async def _role(role: str, address: str, auth_token: str | None, ssl: ssl_module.SSLContext | None) -> dict:
    host, port = parse_hostport(address)
    try:
        welcome, stats = await asyncio.wait_for(probe(host, port, auth_token, ssl), PROBE_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - a role that does not answer is shown as down
        error = str(exc) or type(exc).__name__
        if type(exc) is TimeoutError:  # wait_for's own: a role serving TLS never answers plain TCP
            error = f"no answer within {PROBE_TIMEOUT_S:g} s{'' if ssl else ' (serving TLS? pass --tls-ca)'}"
        return {"role": role, "address": address, "up": False, "error": error, "stats": {}}
    return {"role": role, "address": address, "up": True, "error": "", "stats": stats, "model": welcome.model,
            "seen_at": time.time()}


async def roles_feed(drafters: list[str], targets: list[str], auth_token: str | None = None,
                     ssl: ssl_module.SSLContext | None = None) -> dict:
    parts = await asyncio.gather(*(_role("draft", d, auth_token, ssl) for d in drafters),
                                 *(_role("target", t, auth_token, ssl) for t in targets))
    drafts, targs = list(parts[: len(drafters)]), list(parts[len(drafters) :])
    model = next((p.get("model") for p in targs + drafts if p.get("up")), None)
    return {"time": time.time(), "model": model, "drafters": drafts, "targets": targs}
