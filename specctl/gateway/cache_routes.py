"""The gateway's prefix-cache flush, under the names benchmark scripts call it by: vLLM's
``POST /reset_prefix_cache`` and SGLang's ``/flush_cache`` (GET or POST). Every target
instance and draft server the gateway knows drops its cached prefixes, so the next requests
prefill from scratch (a cold-start measurement; outputs do not change, the cache being
lossless). Sessions running go on: entries are copies, never a session's own cache."""

from __future__ import annotations

from aiohttp import web

from specctl.gateway.request_body import check_key
from specctl.gateway.upstream import Upstream


def cache_routes(upstream: Upstream, api_key: str | None) -> list[web.RouteDef]:
    async def flush(request: web.Request) -> web.Response:
        check_key(request, api_key)
        roles = await upstream.flush_caches()
        failed = [line for line in roles if "error" in line]
        # 200 when every role flushed; 503 when one could not (each line says which and why)
        return web.json_response({"flushed": not failed, "roles": roles}, status=503 if failed else 200)

    return [web.post("/reset_prefix_cache", flush), web.post("/flush_cache", flush), web.get("/flush_cache", flush)]
