"""A client and a server that disagree about TLS, or a certificate that does not verify: a clear
error that says what to do, never a bare timeout or an SSL traceback (net/handshake.py,
runtime/tls.py, the monitor's probes)."""

import asyncio
import re

import pytest

from specctl.monitor import source
from specctl.net import handshake
from specctl.net.framing import write_message
from specctl.net.handshake import HandshakeTimeout, TLSFailed, client_handshake, open_peer
from specctl.net.protocol import PROTOCOL_VERSION, Challenge
from specctl.runtime.tls import client_context, server_context
from specctl.verify.client import RemoteError, remote_stats
from tests.conftest import run_here, self_signed_cert

NO_HANDSHAKE = ("no handshake from the server within 0.2 s: is it a specctl role, running (not stopped or swamped), "
                "and does it serve TLS (then pass --tls-ca CA)?")


async def _server(ssl=None, challenge: bool = False):
    """A listening server that says nothing, or (challenge) a specctl role's first frame."""
    async def handle(reader, writer):
        if challenge:
            await write_message(writer, Challenge(PROTOCOL_VERSION, "draft", b"n" * 16))
        await reader.read()  # until the client leaves
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=ssl)
    return server, server.sockets[0].getsockname()[1]


async def test_a_plain_client_of_a_tls_server_is_told_to_pass_its_ca(tmp_path, monkeypatch):
    monkeypatch.setattr(handshake, "HANDSHAKE_TIMEOUT_S", 0.2)
    cert, key = self_signed_cert(tmp_path)
    server, port = await _server(ssl=server_context(cert, key))
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        with pytest.raises(HandshakeTimeout) as caught:
            await client_handshake(reader, writer, role="target")
        writer.close()
        assert str(caught.value) == NO_HANDSHAKE
        assert isinstance(caught.value, TimeoutError)  # the draft link's reconnect loop still retries on it
        with pytest.raises(HandshakeTimeout, match=re.escape(NO_HANDSHAKE)):
            await open_peer("127.0.0.1", port, role="target")
    finally:
        server.close()


async def test_a_tls_client_of_a_plain_server_is_told_to_drop_its_ca(tmp_path):
    cert, _ = self_signed_cert(tmp_path)
    server, port = await _server(challenge=True)
    try:
        with pytest.raises(TLSFailed) as caught:
            await open_peer("127.0.0.1", port, role="target", ssl=client_context(cert))
        assert re.fullmatch(rf"TLS with 127\.0\.0\.1:{port} failed \(\w+\): does it serve TLS \(--tls-cert\)\? "
                            r"For a server without TLS drop --tls-ca", str(caught.value))
        assert isinstance(caught.value, ConnectionError)  # reconnect loops treat it as a connection failure
        with pytest.raises(RemoteError) as remote:
            await remote_stats("127.0.0.1", port, ssl=client_context(cert))
        assert remote.value.code == "unreachable" and str(remote.value) == str(caught.value)
    finally:
        server.close()


async def test_a_certificate_that_does_not_verify_says_so(tmp_path):
    cert, key = self_signed_cert(tmp_path)
    other_ca, _ = self_signed_cert(tmp_path, "-other")
    server, port = await _server(ssl=server_context(cert, key))
    try:
        with pytest.raises(TLSFailed) as caught:
            await open_peer("127.0.0.1", port, role="target", ssl=client_context(other_ca))
        assert re.fullmatch(rf"TLS with 127\.0\.0\.1:{port} failed: its certificate does not verify against "
                            r"--tls-ca \(.+\)", str(caught.value))
    finally:
        server.close()


async def test_the_monitor_shows_a_tls_role_probed_without_tls_as_down_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(source, "PROBE_TIMEOUT_S", 0.3)
    monkeypatch.setattr(handshake, "HANDSHAKE_TIMEOUT_S", 5.0)  # the probe's own deadline comes first
    cert, key = self_signed_cert(tmp_path)
    server, port = await _server(ssl=server_context(cert, key))
    try:
        feed = await source.roles_feed([f"127.0.0.1:{port}"], [])
        assert feed["drafters"][0]["up"] is False
        assert feed["drafters"][0]["error"] == "no answer within 0.3 s (serving TLS? pass --tls-ca)"
        feed = await source.roles_feed([], [f"127.0.0.1:{port}"], ssl=client_context(cert))  # it answers TLS, not stats
        assert feed["targets"][0]["error"] == "no answer within 0.3 s"
    finally:
        server.close()


def test_the_monitors_tls_ca_is_for_roles_probed_directly():
    result = run_here("monitor", "--once", "--tls-ca", "ca.pem")
    assert result.returncode == 2
    assert ("error: --tls-ca is for the roles probed directly (--draft/--target); a gateway is reached by its URL"
            in result.stderr)
