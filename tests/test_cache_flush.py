"""Flushing the prefix caches (gateway.cache_routes, FLUSH_CACHE): vLLM's /reset_prefix_cache
and SGLang's /flush_cache empty every target instance's and draft server's cache, the next
request prefills from scratch with the same text, and a role that cannot be reached is named."""

import asyncio
import json
import threading
import urllib.error
import urllib.request

import pytest

from specctl.draft.server import DraftServer, DraftServerConfig
from specctl.engine.loader import load_model
from specctl.net.protocol import CacheFlushed
from specctl.spec.drafters import ModelChainDrafter
from specctl.verify.client import flush_cache
from specctl.verify.server import TargetServer, TargetServerConfig
from tests.test_gateway import specctl_generate
from tests.test_prefill_gate import _store


def _flush(base: str, method: str = "POST", path: str = "/reset_prefix_cache", headers: dict | None = None):
    request = urllib.request.Request(base + path, method=method, headers=headers or {},
                                     data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_a_flush_empties_every_role_s_cache_and_the_next_request_prefills_it_again(cluster, client, tiny_dir):
    base, model = cluster[1]["gateway"], str(tiny_dir["llama"])
    prompt = "A long opening that the instance keeps in its prefix cache until it is flushed. " * 3
    first = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0)
    second = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1
    status, body = _flush(base)
    assert status == 200 and body["flushed"] is True
    by_role = {}
    for line in body["roles"]:
        by_role.setdefault(line["role"], []).append(line)
    assert len(by_role["target"]) == 2 and len(by_role["draft"]) == 1
    # the embedded cluster's instances share one model: one line dropped its texts, the other none left
    assert sorted(line["entries"] > 0 for line in by_role["target"]) == [False, True]
    assert by_role["draft"][0]["entries"] > 0 and by_role["draft"][0]["freed_mb"] > 0
    third = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0)
    assert third.usage.prompt_tokens_details.cached_tokens == 0
    assert first.choices[0].text == second.choices[0].text == third.choices[0].text == \
        specctl_generate(tiny_dir, prompt, 10)["text"]
    # SGLang's name, either method: the third request's text goes, then nothing is left to drop
    status, body = _flush(base, "GET", "/flush_cache")
    assert status == 200 and sum(line["entries"] for line in body["roles"] if line["role"] == "target") > 0
    status, body = _flush(base, "POST", "/flush_cache")
    assert status == 200 and all(line["entries"] == 0 and line["freed_mb"] == 0 for line in body["roles"])


@pytest.mark.parametrize("role", ["target", "draft"])
async def test_a_flush_waits_for_the_session_closes_queued_before_it(tiny_dir, role):
    """A session answered DONE stores its text on the compute thread just after; a flush sent
    once the reply is in must drop that text too (answered at once, it raced the store: the
    third request of the test above found its prompt cached in a loaded CI run)."""
    model = load_model("tiny-llama", tiny_dir["llama"], "fp32")
    model.decoder.use_prefix_cache(64 << 20)
    server = (TargetServer(model, TargetServerConfig(port=0), None) if role == "target" else
              DraftServer(model, ModelChainDrafter(model.decoder, 3), DraftServerConfig(port=0)))
    port = await server.start()
    busy = threading.Event()
    try:
        server.compute.submit_nowait(busy.wait, 30)  # the compute thread in the middle of a round
        # a closed session's store, queued behind it
        server.compute.submit_nowait(_store, model.decoder, model.decoder.prefix_cache, list(range(5, 40)))
        asking = asyncio.create_task(flush_cache("127.0.0.1", port))
        await asyncio.sleep(0.3)
        assert not asking.done()
        busy.set()
        answer = await asyncio.wait_for(asking, 30)
        assert (answer.role, answer.entries) == (role, 1) and answer.freed_bytes > 0
        assert model.decoder.prefix_cache.snapshot()["entries"] == 0
    finally:
        busy.set()
        await server.close()


def test_a_draft_server_flushes_for_a_monitor_connection_too(cluster):
    """Any authenticated peer may flush (a monitor or the gateway's probe connection), as any
    may read stats; the answer says what went."""
    host, port = cluster[1]["draft"].rsplit(":", 1)
    answer = asyncio.run(flush_cache(host, int(port)))
    assert isinstance(answer, CacheFlushed) and answer.role == "draft" and answer.entries >= 0


async def test_an_unreachable_role_is_named_with_a_503_and_the_api_key_is_checked(tiny_dir):
    import aiohttp
    from transformers import AutoTokenizer

    from specctl.bench.processes import free_port
    from specctl.gateway.metrics import GatewayMetrics
    from specctl.gateway.server import Gateway, GatewayConfig
    from specctl.gateway.upstream import Upstream

    dead = f"127.0.0.1:{free_port()}"
    gateway = Gateway(GatewayConfig(model_name="tiny", context=512, port=0, api_key="k3y"),
                      AutoTokenizer.from_pretrained(tiny_dir["llama"]), Upstream([dead], poll_interval_s=0.1),
                      GatewayMetrics())
    port = await gateway.start()
    try:
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{port}/reset_prefix_cache"
            async with session.post(url) as response:
                assert response.status == 401
            async with session.post(url, headers={"Authorization": "Bearer k3y"}) as response:
                assert response.status == 503
                body = await response.json()
            assert body["flushed"] is False
            [line] = body["roles"]
            assert line["role"] == "target" and line["address"] == dead
            assert line["error"].startswith(f"cannot reach {dead}")
    finally:
        await gateway.close()


def test_a_cache_salt_keeps_a_request_s_prefix_to_requests_of_the_same_salt(cluster, client, tiny_dir):
    """vLLM's cache_salt through the gateway: the prompt another salt (or none) stored is not
    reused, the same salt's is; every text is the target's own; an empty salt is a 400."""
    model = str(tiny_dir["llama"])
    prompt = "A salted opening that only one tenant's requests may reuse from the prefix cache. " * 3

    def cached(salt: str | None) -> tuple[int, str]:
        extra = {"cache_salt": salt} if salt is not None else {}
        answer = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0, extra_body=extra)
        return answer.usage.prompt_tokens_details.cached_tokens, answer.choices[0].text

    first = cached("tenant-a")
    assert first[0] == 0
    assert cached("tenant-b") == (0, first[1]) and cached(None) == (0, first[1])
    again = cached("tenant-a")
    assert again[0] > 0 and again[1] == first[1] == specctl_generate(tiny_dir, prompt, 10)["text"]
    # the gateway's routing picture holds the salt beside the prompt (gateway.upstream)
    held = [salt for link in cluster[0].cluster.gateway.upstream.targets for salt, _ in link.prefilled]
    assert {"tenant-a", "tenant-b", ""} <= set(held)
    status, body = _post(cluster[1]["gateway"] + "/v1/completions", {"prompt": prompt, "cache_salt": ""})
    assert (status, body["error"]["param"]) == (400, "cache_salt")
    assert body["error"]["message"] == ("cache_salt must be a non-empty string if given (vLLM's rule): leave it out to "
                                        "share the prefix cache")


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())
