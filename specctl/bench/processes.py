"""Role processes on loopback, for the benchmarks and the multi-process tests: free ports,
``python -m specctl ROLE ...`` started with its OpenMP settings, waiting for its "listening
on" line, and stopping them all however a run ends."""

from __future__ import annotations

import collections
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from specctl.errors import SpecctlError


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports (all held open while choosing, so none repeats)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


def spawn_role(*args: str, niceness: int = 0, threads: int | None = None, passive_omp: bool = True) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if passive_omp:  # several processes share these cores: idle OpenMP workers must sleep, not spin
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if threads is not None:  # size the OpenMP pool at start-up, as --threads later asks
        env["OMP_NUM_THREADS"] = str(threads)
    return subprocess.Popen([sys.executable, "-m", "specctl", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env,
                            preexec_fn=(lambda: os.nice(niceness)) if niceness else None)


def wait_listening(proc: subprocess.Popen, what: str, timeout: float = 600) -> None:
    deadline, seen = time.time() + timeout, []
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise SpecctlError(f"{what} exited during start-up: {''.join(seen[-5:]).strip()}")
        seen.append(line)
        if "listening on" in line:
            # Keep reading: a full pipe would block the process at its next log line.
            proc.log_tail = collections.deque(seen[-20:], maxlen=200)
            threading.Thread(target=proc.log_tail.extend, args=(proc.stdout,), daemon=True).start()
            return
    raise SpecctlError(f"{what} did not start within {timeout:.0f}s")


def stop_processes(procs: list[subprocess.Popen], sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> None:
    """Ask every role process to stop (they close cleanly on SIGTERM/SIGINT); kill the stragglers."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(sig)
    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
