"""``specctl bench star``: one draft server and N target instances as separate processes on
loopback, one session per target, StarSD's Table 1 per N next to the analytical model's
prediction from the measured t_s, t_v, t_c and acceptance.

``--verify-delay-ms`` makes every verification sleep that long on top of its compute, to
emulate targets on bigger or slower hardware; such runs are labelled emulated."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from specctl.draft.plan import StarModel
from specctl.errors import SpecctlError
from specctl.spec.sampling import SamplingParams
from specctl.verify.client import remote_generate, remote_stats


@dataclass(frozen=True, slots=True)
class StarBenchSettings:
    draft: str
    target: str
    targets: tuple[int, ...]
    depth: int
    max_tokens: int
    verify_delay_ms: float
    dtype: str
    mode: str = "chain"
    threads: int = 1  # per process: many targets share this machine's cores
    # Emulated runs put the targets at a lower CPU priority: in the topology being emulated
    # their compute runs on their own machines, not on the draft server's cores.
    target_nice: int = 10

    @property
    def target_niceness(self) -> int:
        return self.target_nice if self.verify_delay_ms > 0 else 0


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


def spawn_role(*args: str, niceness: int = 0) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # Idle OpenMP workers must sleep, not spin: several processes share these cores.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
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
            return
    raise SpecctlError(f"{what} did not start within {timeout:.0f}s")


class StarCluster:
    """Processes of one benchmark; stopped (SIGTERM, then kill) however the run ends."""

    def __init__(self, s: StarBenchSettings) -> None:
        self.settings, self.procs = s, []
        self.draft_port, *self.target_ports = free_ports(1 + max(s.targets))

    def __enter__(self) -> "StarCluster":
        s = self.settings
        common = ("--dtype", s.dtype, "--threads", str(s.threads), "--log-level", "warning")
        try:
            self.procs.append(spawn_role("draft", "--port", str(self.draft_port), "--model", s.draft, "--mode", s.mode,
                                     "--depth", str(s.depth), *common))
            wait_listening(self.procs[0], "draft server")
            for port in self.target_ports:
                self.procs.append(spawn_role("verify", "--model", s.target, "--draft", f"127.0.0.1:{self.draft_port}",
                                         "--port", str(port), "--verify-delay-ms", str(s.verify_delay_ms), *common,
                                         niceness=s.target_niceness))
            for i, proc in enumerate(self.procs[1:]):
                wait_listening(proc, f"target instance {i + 1}")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        stop_processes(self.procs)


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


async def _measure(cluster: StarCluster, n: int, prompts: list[list[int]]) -> dict:
    s = cluster.settings
    ports = cluster.target_ports[:n]
    params = SamplingParams(max_tokens=s.max_tokens, ignore_eos=True)
    d0 = await remote_stats("127.0.0.1", cluster.draft_port)
    t0 = [await remote_stats("127.0.0.1", p) for p in ports]
    start = time.perf_counter()
    results = await asyncio.gather(*(remote_generate("127.0.0.1", p, prompts[i % len(prompts)], params)
                                     for i, p in enumerate(ports)))
    wall = time.perf_counter() - start
    d1 = await remote_stats("127.0.0.1", cluster.draft_port)
    t1 = [await remote_stats("127.0.0.1", p) for p in ports]
    jobs = max(d1["jobs"] - d0["jobs"], 1)
    rounds = sum(b["rounds"] - a["rounds"] for a, b in zip(t0, t1))
    verify_busy = sum(b["busy_s"] - a["busy_s"] for a, b in zip(t0, t1))
    tokens = sum(len(r[0]) for r in results)
    accepted = sum(r[2]["accepted"] for r in results)
    drafted = sum(r[2]["drafted"] for r in results)
    return {
        "N": n, "wall_s": wall, "O": tokens / wall, "O_i": tokens / wall / n,
        "t_s_ms": 1e3 * (d1["busy_s"] - d0["busy_s"]) / jobs,
        "T_wait_ms": 1e3 * (d1["wait_s"] - d0["wait_s"]) / jobs,
        "T_idle_ms": 1e3 * (d1["idle_s"] - d0["idle_s"]) / jobs,
        "R_q": jobs / wall, "R_p": rounds / wall / n, "load": (d1["busy_s"] - d0["busy_s"]) / wall,
        "t_v_ms": 1e3 * verify_busy / max(rounds, 1) + s.verify_delay_ms,
        "mean_accepted_length": 1 + accepted / max(rounds, 1),
        "acceptance_rate": accepted / max(drafted, 1),
    }


def predict(rows: list[dict], depth: int) -> None:
    """Fill each row with the model's prediction from N=1's measured times: S = t_s per
    request, t_v measured, t_c = what remains of N=1's round time; progress per round is the
    measured mean accepted length (accepted + bonus), so O is in emitted tokens/s."""
    base = rows[0]
    service = base["t_s_ms"] / 1e3
    round_1 = 1.0 / base["R_p"] if base["R_p"] else service
    t_v = base["t_v_ms"] / 1e3
    t_c = max(0.0, round_1 - service - t_v)
    model = StarModel(t_s=service / depth, t_v=t_v, t_c=t_c, beta=0.0, depth=depth)
    tokens_per_round = base["mean_accepted_length"]
    for row in rows:
        n = row["N"]
        row["model_O"] = n * tokens_per_round / model.round_time(n)
        row["model_load"] = model.load(n)
        row["model_T_idle_ms"] = model.idle(n) * 1e3
        row["regime"] = model.regime(n)
        row["N_full"] = model.n_full
        row["model_t_c_ms"] = t_c * 1e3


def run_star_bench(s: StarBenchSettings, prompts: list[list[int]], progress=None) -> dict:
    rows = []
    with StarCluster(s) as cluster:
        async def all_n() -> None:
            # Warm-up: every target and the draft run once before measuring.
            await _measure(cluster, max(s.targets), prompts)
            for n in s.targets:
                rows.append(await _measure(cluster, n, prompts))
                if progress:
                    progress()

        asyncio.run(all_n())
    predict(rows, s.depth)
    return {
        "settings": {"draft": s.draft, "target": s.target, "targets": list(s.targets), "depth": s.depth,
                     "max_tokens": s.max_tokens, "verify_delay_ms": s.verify_delay_ms, "dtype": s.dtype, "mode": s.mode,
                     "emulated": s.verify_delay_ms > 0, "target_niceness": s.target_niceness},
        "rows": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()} for row in rows],
    }
