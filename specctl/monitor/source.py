"""Where the monitor's feeds come from: a gateway's /v1/stats, or the roles themselves
(probed over the wire protocol), assembled into the same shape."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from specctl.runtime.loop import parse_hostport
from specctl.verify.client import probe


async def gateway_feed(session: aiohttp.ClientSession, url: str, api_key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with session.get(url.rstrip("/") + "/v1/stats", headers=headers, timeout=aiohttp.ClientTimeout(total=3)) as r:
        r.raise_for_status()
        return await r.json()


async def _role(role: str, address: str, auth_token: str | None) -> dict:
    host, port = parse_hostport(address)
    try:
        welcome, stats = await asyncio.wait_for(probe(host, port, auth_token), 3.0)
    except Exception as exc:  # noqa: BLE001 - a role that does not answer is shown as down
        return {"role": role, "address": address, "up": False, "error": str(exc) or type(exc).__name__, "stats": {}}
    return {"role": role, "address": address, "up": True, "error": "", "stats": stats, "model": welcome.model,
            "seen_at": time.time()}


async def roles_feed(drafters: list[str], targets: list[str], auth_token: str | None = None) -> dict:
    parts = await asyncio.gather(*(_role("draft", d, auth_token) for d in drafters),
                                 *(_role("target", t, auth_token) for t in targets))
    drafts, targs = list(parts[: len(drafters)]), list(parts[len(drafters) :])
    model = next((p.get("model") for p in targs + drafts if p.get("up")), None)
    return {"time": time.time(), "model": model, "drafters": drafts, "targets": targs}
