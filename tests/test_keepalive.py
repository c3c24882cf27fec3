"""TCP keepalive on every connection between roles (net/keepalive.py): both ends of a role's
listening connection and of the clients' connections probe an idle peer, so one that drops
off without a FIN is found and its state freed."""

import asyncio
import socket
import sys

import pytest

from specctl.net.handshake import open_peer, server_handshake
from specctl.net.keepalive import KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES
from specctl.runtime.listen import ListenConfig, ListeningServer
from specctl.verify.client import _connect


def keepalive_of(writer: asyncio.StreamWriter) -> tuple[int, ...]:
    sock = writer.get_extra_info("socket")
    options = [sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) != 0]
    if sys.platform == "linux":
        options += [sock.getsockopt(socket.IPPROTO_TCP, option)
                    for option in (socket.TCP_KEEPIDLE, socket.TCP_KEEPINTVL, socket.TCP_KEEPCNT)]
    return tuple(options)


EXPECTED = (True, KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES) if sys.platform == "linux" else (True,)


class Idle:
    def stop(self) -> None:
        pass


class ShakeHands(ListeningServer):
    """A role that shakes hands and keeps what it saw of each accepted connection."""

    def __init__(self) -> None:
        super().__init__()
        self.config, self.ssl, self.compute = ListenConfig(), None, Idle()
        self.accepted: asyncio.Queue = asyncio.Queue()

    async def _handle(self, reader, writer) -> None:
        self._live.track(writer)
        await server_handshake(reader, writer, role="draft", model="m", fingerprint="f", max_sessions=4,
                               auth_token=None, accept_roles={"target": True, "client": False})
        self.accepted.put_nowait(keepalive_of(writer))
        await reader.read()


async def test_both_ends_of_a_role_connection_probe_an_idle_peer():
    assert (KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES) == (30, 10, 3)  # found in about a minute
    server = ShakeHands()
    port = await server.start()
    try:
        _, writer, _ = await open_peer("127.0.0.1", port, role="target", model="m", fingerprint="f")
        assert keepalive_of(writer) == EXPECTED  # the client's end (targets, stages, the gateway's probes)
        assert await asyncio.wait_for(server.accepted.get(), 10) == EXPECTED  # the role's end
        writer.close()
        _, writer = await _connect("127.0.0.1", port, None)  # a client's connection to a target instance
        assert keepalive_of(writer) == EXPECTED
        writer.close()
    finally:
        await server.close()


async def test_the_gateway_probes_an_idle_http_client(tiny_dir):
    """A client whose box went off without a FIN: its queued or running request would wait for
    the queue timeout or the stream's end; the probes reset the connection, which cancels it."""
    import aiohttp
    from aiohttp import web
    from transformers import AutoTokenizer

    from specctl.bench.processes import free_port
    from specctl.gateway.metrics import GatewayMetrics
    from specctl.gateway.server import Gateway, GatewayConfig
    from specctl.gateway.upstream import Upstream

    async def probe(request: web.Request) -> web.Response:  # what the gateway's end of this connection has
        return web.json_response(list(keepalive_of(request.transport)))

    metrics = GatewayMetrics()
    gateway = Gateway(GatewayConfig(model_name="tiny", context=512, port=0),
                      AutoTokenizer.from_pretrained(tiny_dir["llama"]),
                      Upstream([f"127.0.0.1:{free_port()}"], metrics=metrics, poll_interval_s=0.1), metrics)
    make_app = gateway.app

    def with_probe() -> web.Application:
        app = make_app()
        app.router.add_get("/probe", probe)
        return app

    gateway.app = with_probe
    port = await gateway.start()
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/probe") as response:
                assert tuple(await response.json()) == EXPECTED
    finally:
        await gateway.close()


@pytest.mark.skipif(sys.platform != "linux", reason="Linux's names of the options")
def test_an_unconnected_socket_starts_without_keepalive():
    """What the settings change: a fresh socket has none (so the test above cannot pass by default)."""
    with socket.socket() as sock:
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0
