"""TCP keepalive on every connection between roles. A peer whose box loses power, or whose
network drops, sends no FIN: an idle connection to it would look alive for ever (Linux's own
keepalive, where on, waits two hours), and whatever the other side keeps for it (a target's
draft sessions on the draft server, a gateway's sessions on a target, a chain's KV on the
stages, an HTTP client's request queued or running at the gateway) would never be freed.
With these settings the kernel probes a connection idle for 30 s every 10 s and resets it
after 3 unanswered probes (about a minute), so the usual disconnect path frees it. A stopped
process (SIGSTOP) still has its kernel answer the probes: it is not taken for dead (it may
resume); the roles' own timeouts deal with hangs."""

from __future__ import annotations

import asyncio
import socket

KEEPALIVE_IDLE_S = 30
KEEPALIVE_INTERVAL_S = 10
KEEPALIVE_PROBES = 3


def keep_alive(connection: asyncio.StreamWriter | asyncio.BaseTransport | None) -> None:
    """Turn keepalive on for the connection's TCP socket (nothing for other transports, or
    for a connection already gone)."""
    sock = connection.get_extra_info("socket") if connection is not None else None
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    # Linux names the idle time TCP_KEEPIDLE, macOS TCP_KEEPALIVE; a platform without one keeps its default
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPALIVE", KEEPALIVE_IDLE_S),
                        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S), ("TCP_KEEPCNT", KEEPALIVE_PROBES)):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)
