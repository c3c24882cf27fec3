"""Whether a server role's idle OpenMP workers spin or sleep (``--omp-wait``).

After each parallel op libgomp's workers spin (about 300,000 turns) before they sleep, so the
next op starts without waking them: a role alone on its cores gains by it. Two busy roles in
separate processes on the same cores — a draft server and a target on one box, a pipeline's
stages — spin on the cores the other needs, and each waits out the other's spinning.
Measured on 2 cores (2026-12-04; a 0.5B draft server and a 1.5B target on loopback, 32-token
greedy requests through the gateway): three at once took 15-20 s with spinning workers and
6.6 s with sleeping ones, one alone 2.9 s against 3.7 s; a two-stage pipeline with its draft,
three at once 31 s against 7.5 s. A server role serves requests at once, so ``auto`` lets the
workers sleep when a peer role is on this host (a loopback address, one of this host's own
addresses, or its host name), as the benchmarks' own processes do (bench/processes.py). ``spin`` is libgomp's default (spin a while, then sleep),
not OMP_WAIT_POLICY=ACTIVE, whose workers spin for seconds after every op, idle or not.
libgomp reads the policy once, when torch loads it: it is set before torch is imported, and a
policy the environment already gives is left alone."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, MutableMapping

from specctl.errors import ConfigError

OMP_WAIT_CHOICES = ("auto", "spin", "sleep")
OMP_WAIT_HELP = ("idle OpenMP workers: sleep (OMP_WAIT_POLICY=PASSIVE: for roles that share this host's cores with "
                 "another busy process), spin (libgomp's default: they spin a while first, the lowest latency for a "
                 "role alone on its cores), or auto (sleep when a peer role is on this host: a loopback address, one "
                 "of this host's addresses or its name; else spin); OMP_WAIT_POLICY or GOMP_SPINCOUNT in the "
                 "environment win")


def _host(address: str) -> str:
    """HOST of HOST:PORT, [V6]:PORT or a bare host."""
    host = address.strip()
    if host.startswith("["):  # [::1]:9000
        return host[1:].partition("]")[0]
    return host.partition(":")[0] if host.count(":") == 1 else host


def is_loopback(address: str) -> bool:
    """Whether HOST:PORT (or a bare host) names a loopback address (a server bound there has
    its peers on this host)."""
    host = _host(address)
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def on_this_host(address: str) -> bool:
    """Whether HOST:PORT (or a bare host) is this host: a loopback address, an address of one of
    its interfaces (one a socket can bind), or its host name. Other names are not resolved: a
    role must not wait on DNS as it starts."""
    host = _host(address)
    if is_loopback(host) or host.lower() == socket.gethostname().lower():
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if ip.is_unspecified or ip.is_multicast:  # 0.0.0.0 is every interface, no peer's address
        return False
    with socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((str(ip), 0))
        except OSError:
            return False
    return True


def omp_wait_policy(choice: str, peers: Iterable[str]) -> str | None:
    """The OMP_WAIT_POLICY a role asks for: PASSIVE to sleep (``auto``: when one of its peers'
    addresses is on this host), None to spin (libgomp's default)."""
    if choice not in OMP_WAIT_CHOICES:
        raise ConfigError(f"--omp-wait must be one of {', '.join(OMP_WAIT_CHOICES)}, got {choice!r}")
    if choice == "auto":
        return "PASSIVE" if any(on_this_host(peer) for peer in peers) else None
    return "PASSIVE" if choice == "sleep" else None


def spinning_next_to(peername: object) -> str | None:
    """What to tell a draft server whose workers spin (``auto`` bound to all interfaces cannot
    tell where its targets run) when a target connects from ``peername`` (a socket's): None
    unless that is this host."""
    host = peername[0] if isinstance(peername, tuple) and peername else ""
    if not host or not on_this_host(str(host)):
        return None
    return (f"a target instance connected from this host ({host}) while this draft server's idle OpenMP workers "
            "spin (--omp-wait auto spins when bound to all interfaces): the two processes spin on each other's "
            "cores; restart the draft server with --omp-wait sleep")


def apply_omp_wait(choice: str, peers: Iterable[str], environ: MutableMapping[str, str],
                   torch_loaded: bool) -> str | None:
    """Set OMP_WAIT_POLICY in ``environ`` as :func:`omp_wait_policy` decides; what it did, as a
    log line, or None when it left libgomp's default. Nothing is set when the environment
    already says (its policy or a spin count) or torch is already loaded (libgomp has read it)."""
    peers = list(peers)
    policy = omp_wait_policy(choice, peers)
    if policy is None:
        return None
    given = [name for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if name in environ]
    if given:
        return f"idle OpenMP workers as the environment says ({given[0]}={environ[given[0]]})"
    if torch_loaded:
        return f"OMP_WAIT_POLICY={policy} not applied: torch (and libgomp) already loaded in this process"
    environ["OMP_WAIT_POLICY"] = policy
    if choice == "sleep":
        return "idle OpenMP workers sleep (--omp-wait sleep)"
    local = next(peer for peer in peers if on_this_host(peer))
    return (f"idle OpenMP workers sleep: a peer role is on this host ({local}), so the processes would spin on "
            "each other's cores; --omp-wait spin keeps them spinning")
