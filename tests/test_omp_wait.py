"""--omp-wait: idle OpenMP workers sleep when a peer role shares this host (runtime/omp_wait.py)."""

import ipaddress
import socket

import pytest

from specctl.bench.processes import free_port, spawn_role, stop_processes, wait_listening
from specctl.cli.verify import peer_hosts
from specctl.errors import ConfigError
from specctl.runtime.omp_wait import apply_omp_wait, is_loopback, omp_wait_policy, on_this_host, spinning_next_to
from tests.conftest import run_here


@pytest.mark.parametrize("address, local", [
    ("127.0.0.1:9000", True), ("127.8.0.3", True), ("localhost:9000", True), ("LOCALHOST", True), ("[::1]:9000", True),
    ("::1", True), ("10.0.0.2:9000", False), ("0.0.0.0", False), ("gpu-box:9100", False), ("[fe80::1]:9", False),
])
def test_on_this_host_is_a_loopback_address(address, local):
    assert on_this_host(address) is local
    assert is_loopback(address) is local


def own_address() -> str | None:
    """An address of this host's that is not loopback (the one a datagram out would leave by)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("198.51.100.7", 9))  # no packet is sent: it only picks the interface
        except OSError:
            return None
        return probe.getsockname()[0]


def test_this_hosts_own_address_and_name_are_on_this_host():
    assert on_this_host(f"{socket.gethostname()}:9000")
    address = own_address()
    if address is None or ipaddress.ip_address(address).is_loopback:
        pytest.skip("this host has no route out, so no address but loopback to find")
    assert on_this_host(f"{address}:9000") and not is_loopback(f"{address}:9000")
    others = [f"{a}:9000" for a in ("198.51.100.7", "203.0.113.9") if a != address]
    assert not any(map(on_this_host, others))


def test_auto_sleeps_only_with_a_peer_on_this_host():
    assert omp_wait_policy("auto", ["gpu-box:9100", "127.0.0.1:9000"]) == "PASSIVE"
    assert omp_wait_policy("auto", ["gpu-box:9100", "10.0.0.2:9101"]) is None
    assert omp_wait_policy("auto", []) is None
    assert omp_wait_policy("sleep", ["gpu-box:9100"]) == "PASSIVE"
    assert omp_wait_policy("spin", ["127.0.0.1:9000"]) is None
    with pytest.raises(ConfigError, match=r"^--omp-wait must be one of auto, spin, sleep, got 'active'$"):
        omp_wait_policy("active", [])


def test_apply_sets_the_policy_and_says_why():
    environ = {}
    line = apply_omp_wait("auto", ["gpu-box:1", "127.0.0.1:9000"], environ, torch_loaded=False)
    assert environ == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert line == ("idle OpenMP workers sleep: a peer role is on this host (127.0.0.1:9000), so the processes would "
                    "spin on each other's cores; --omp-wait spin keeps them spinning")
    environ = {}
    assert apply_omp_wait("sleep", [], environ, torch_loaded=False) == "idle OpenMP workers sleep (--omp-wait sleep)"
    assert environ == {"OMP_WAIT_POLICY": "PASSIVE"}
    environ = {}
    assert apply_omp_wait("auto", ["gpu-box:1"], environ, torch_loaded=False) is None
    assert apply_omp_wait("spin", ["127.0.0.1:1"], environ, torch_loaded=False) is None
    assert environ == {}


@pytest.mark.parametrize("given", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "1000"}])
def test_the_environment_wins(given):
    environ = dict(given)
    line = apply_omp_wait("auto", ["127.0.0.1:9000"], environ, torch_loaded=False)
    assert environ == given
    name, value = next(iter(given.items()))
    assert line == f"idle OpenMP workers as the environment says ({name}={value})"


def test_nothing_is_set_once_torch_is_loaded():
    environ = {}
    line = apply_omp_wait("sleep", [], environ, torch_loaded=True)
    assert environ == {}
    assert line == "OMP_WAIT_POLICY=PASSIVE not applied: torch (and libgomp) already loaded in this process"


def test_a_targets_peers_are_its_draft_servers_and_the_other_stages():
    stages = [("127.0.0.1", 9100), ("box-b", 9101), ("10.0.0.3", 9102)]
    assert peer_hosts(["laptop:9000", "ngram", "suffix"], [], 1) == ["laptop:9000"]
    assert peer_hosts([], stages, 1) == ["box-b", "10.0.0.3"]  # its own entry is where it listens
    assert peer_hosts([], stages, 2) == ["127.0.0.1", "10.0.0.3"]


@pytest.mark.parametrize("role", ["draft", "verify"])
def test_a_bad_choice_is_a_usage_error(role):
    result = run_here(role, "--omp-wait", "active")
    assert result.returncode == 2
    assert "error: --omp-wait must be one of auto, spin, sleep, got 'active'" in result.stderr


def test_a_draft_server_on_loopback_sets_it_before_torch_loads(tiny_dir, monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    proc = spawn_role("draft", "--port", str(free_port()), "--model", f"{tiny_dir['llama']}@2", "--mode", "chain",
                      "--dtype", "fp32", "--threads", "1", passive_omp=False)
    try:
        wait_listening(proc, "draft server", timeout=120)
        log = "".join(proc.log_tail)
    finally:
        stop_processes([proc])
    assert ("idle OpenMP workers sleep: a peer role is on this host (127.0.0.1), so the processes would spin on "
            "each other's cores; --omp-wait spin keeps them spinning") in log


def test_a_spinning_draft_server_is_told_of_a_target_on_its_own_host():
    said = spinning_next_to(("127.0.0.1", 50123))
    assert said == ("a target instance connected from this host (127.0.0.1) while this draft server's idle OpenMP "
                    "workers spin (--omp-wait auto spins when bound to all interfaces): the two processes spin on "
                    "each other's cores; restart the draft server with --omp-wait sleep")
    assert spinning_next_to(("10.255.255.1", 50123)) is None  # a target on another box: spinning is right
    assert spinning_next_to(None) is None and spinning_next_to("") is None  # no address (a socket of no family)


def test_a_draft_server_on_every_interface_spins_and_says_so_when_a_target_comes_from_its_host(tiny_dir, monkeypatch):
    """Bound to 0.0.0.0, auto cannot know where its targets run and keeps libgomp's spinning; the
    first target that connects from this host has the draft server log what to do, once."""
    import asyncio

    from specctl.engine.loader import load_model
    from specctl.net.handshake import open_peer

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    fingerprint = load_model("tiny@2", tiny_dir["llama"], "fp32", num_layers=2).vocab_fingerprint
    port = free_port()
    proc = spawn_role("draft", "--host", "0.0.0.0", "--port", str(port), "--model", f"{tiny_dir['llama']}@2", "--mode",
                      "chain", "--dtype", "fp32", "--threads", "1", passive_omp=False)

    async def connect_twice():
        for _ in range(2):
            _, writer, _ = await open_peer("127.0.0.1", port, role="target", model="m", fingerprint=fingerprint)
            writer.close()
            await asyncio.sleep(0.3)

    try:
        wait_listening(proc, "draft server", timeout=120)
        asyncio.run(connect_twice())
        log = "".join(proc.log_tail)
    finally:
        stop_processes([proc])
    assert "idle OpenMP workers sleep" not in log
    assert log.count("a target instance connected from this host (127.0.0.1) while this draft server's idle OpenMP "
                     "workers spin") == 1
