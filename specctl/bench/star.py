"""``specctl bench star``: one draft server and N target instances as separate processes on
loopback, one session per target, StarSD's Table 1 per N next to the analytical model's
prediction from the measured t_s, t_v, t_c and acceptance.

``--verify-delay-ms`` makes every verification sleep that long on top of its compute, to
emulate targets on bigger or slower hardware; ``verify_time_ms`` (bench prespec) makes every
verification take at least that long, its compute inside it; such runs are labelled emulated.

Each draft batching limit (``--max-batch 1,4``) is one sweep over N with its own processes:
``1`` is StarSD's one-request-at-a-time service, the regime the analytical model describes;
a larger limit drafts the pending requests of several targets in one forward, our step
beyond StarSD, which keeps system throughput rising past N_full."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from dataclasses import dataclass

from specctl.bench.processes import free_ports, spawn_role, stop_processes, wait_listening
from specctl.bench.spread import spread
from specctl.draft.plan import StarModel
from specctl.errors import SpecctlError
from specctl.spec.params import SamplingParams
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
    max_batches: tuple[int, ...] = (1, 4)  # one sweep per draft batching limit
    draft_quant: str = "int8"
    target_quant: str = "none"
    sessions: int = 4  # per target and N, the same prompts in the same order
    threads: int = 1  # per process: many targets share this machine's cores
    # Idle OpenMP workers sleep instead of spinning: right when 9-18 processes share the cores,
    # wrong for a like-for-like comparison with one process (bench net), which inherits the caller's policy.
    passive_omp: bool = True
    # Emulated runs put the targets at a lower CPU priority: in the topology being emulated
    # their compute runs on their own machines, not on the draft server's cores.
    target_nice: int = 10
    # The targets stand for other machines even without a sleep (bench prespec): nice them anyway.
    nice_unemulated: bool = False
    draft_args: tuple[str, ...] = ()  # more flags for the draft server (bench prespec: --prespec ...)
    verify_time_ms: float = 0.0  # every verification takes at least this long, its compute included
    draft_step_ms: float = 0.0  # every draft forward takes at least this long (a device whose rows are ~free)
    repeats: int = 1  # sweeps over N with the same processes; the summary gives each figure's spread

    @property
    def emulated(self) -> bool:
        return self.verify_delay_ms > 0 or self.verify_time_ms > 0 or self.draft_step_ms > 0

    @property
    def target_niceness(self) -> int:
        return self.target_nice if self.emulated or self.nice_unemulated else 0


class StarCluster:
    """Processes of one benchmark; stopped (SIGTERM, then kill) however the run ends."""

    def __init__(self, s: StarBenchSettings, max_batch: int) -> None:
        self.settings, self.max_batch, self.procs = s, max_batch, []
        self.draft_port, *self.target_ports = free_ports(1 + max(s.targets))

    def __enter__(self) -> "StarCluster":
        s = self.settings
        # no prefix cache: every repeat prefills its prompts, as the first did (the rounds are what is measured)
        common = ("--dtype", s.dtype, "--threads", str(s.threads), "--log-level", "warning", "--prefix-cache-mb", "0",
                  *(() if s.passive_omp else ("--omp-wait", "spin")))  # spin: the caller's policy, not auto's sleep
        env = {"threads": s.threads, "passive_omp": s.passive_omp}
        try:
            self.procs.append(spawn_role("draft", "--port", str(self.draft_port), "--model", s.draft, "--mode", s.mode,
                                         "--depth", str(s.depth), "--max-batch", str(self.max_batch),
                                         "--draft-quant", s.draft_quant, "--step-time-ms", str(s.draft_step_ms),
                                         *s.draft_args, *common, **env))
            wait_listening(self.procs[0], "draft server")
            for port in self.target_ports:
                self.procs.append(spawn_role("verify", "--model", s.target, "--draft", f"127.0.0.1:{self.draft_port}",
                                         "--port", str(port), "--verify-delay-ms", str(s.verify_delay_ms),
                                         "--verify-time-ms", str(s.verify_time_ms),
                                         "--quant", s.target_quant, *common,
                                         niceness=s.target_niceness, **env))
                # One at a time: a target loading fp32 weights to quantize them peaks at several
                # GB, and N of them loading at once ran this 24 GB machine out of memory.
                wait_listening(self.procs[-1], f"target instance {len(self.procs) - 1}")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        stop_processes(self.procs)


async def _snapshots(cluster: StarCluster, n: int) -> tuple[dict, list[dict]]:
    draft, *targets = await asyncio.gather(remote_stats("127.0.0.1", cluster.draft_port),
                                           *(remote_stats("127.0.0.1", p) for p in cluster.target_ports[:n]))
    return draft, targets


async def _until_idle(cluster: StarCluster, n: int, timeout_s: float = 60.0) -> None:
    """Wait until no session is open on the draft server or any target (the next N starts clean)."""
    deadline = time.perf_counter() + timeout_s
    while True:
        draft, targets = await _snapshots(cluster, n)
        if draft["sessions"] == 0 and all(t["sessions"] == 0 for t in targets):
            return
        if time.perf_counter() > deadline:
            raise SpecctlError(f"sessions still open {timeout_s:.0f}s after their clients left: draft "
                               f"{draft['sessions']}, targets {[t['sessions'] for t in targets]}")
        await asyncio.sleep(0.2)


async def _workload(cluster: StarCluster, n: int, prompts: list[list[int]], sessions: int) -> list[list[list[int]]]:
    """The first N targets each serve the same sessions in the same order, one after another:
    identical work, so every N and every sweep sees the same text and acceptance, and the
    targets finish together (no long tail of one slow session). Returns each target's texts."""
    params = SamplingParams(max_tokens=cluster.settings.max_tokens, ignore_eos=True)

    async def client(port: int) -> list[list[int]]:
        return [(await remote_generate("127.0.0.1", port, prompts[k % len(prompts)], params))[0] for k in range(sessions)]

    return list(await asyncio.gather(*(client(p) for p in cluster.target_ports[:n])))


async def _measure(cluster: StarCluster, n: int, prompts: list[list[int]], texts: list | None = None) -> dict:
    """One row at N targets (``texts``, when given, receives what every target generated)."""
    s = cluster.settings
    d0, t0 = await _snapshots(cluster, n)
    start = time.perf_counter()
    outputs = await _workload(cluster, n, prompts, s.sessions)
    if texts is not None:
        texts.extend(outputs)
    wall = time.perf_counter() - start
    await _until_idle(cluster, n)
    d1, t1 = await _snapshots(cluster, n)
    delta = lambda key: sum(b[key] - a[key] for a, b in zip(t0, t1))  # noqa: E731
    jobs = max(d1["jobs"] - d0["jobs"], 1)
    rounds = delta("rounds")
    return {
        "N": n, "max_batch": cluster.max_batch, "wall_s": wall, "O": delta("tokens") / wall,
        "O_i": delta("tokens") / wall / n,
        "t_s_ms": 1e3 * (d1["busy_s"] - d0["busy_s"]) / jobs,
        "T_wait_ms": 1e3 * (d1["wait_s"] - d0["wait_s"]) / jobs,
        # Idle time inside the window: the server's own idle counter also holds the gap before
        # the window's first request (the other sweeps' turns).
        "T_idle_ms": 1e3 * max(wall - (d1["busy_s"] - d0["busy_s"]), 0.0) / jobs,
        "mean_batch": jobs / max(d1["passes"] - d0["passes"], 1), "R_q": jobs / wall,
        "R_p": rounds / wall / n, "load": (d1["busy_s"] - d0["busy_s"]) / wall,
        "t_v_ms": max(1e3 * delta("busy_s") / max(rounds, 1), s.verify_time_ms) + s.verify_delay_ms,
        "verify_cpu_ms": 1e3 * delta("cpu_s") / max(rounds, 1),
        # What a target waits for a proposal; less the draft's T_wait + t_s, it is the network and event loops.
        "proposal_ms": 1e3 * delta("proposal_wait_s") / max(rounds, 1),
        "mean_accepted_length": 1 + delta("accepted") / max(delta("drafts"), 1),
        "acceptance_rate": delta("accepted") / max(delta("drafted"), 1),
        "drafted_per_round": delta("drafted") / max(delta("drafts"), 1),
    }


def predict(rows: list[dict], depth: int) -> None:
    """Fill each row with the model's prediction. S = the median t_s of the rows served one
    request at a time (the same quantity measured at every N: one number, robust to one noisy
    run); t_v measured at N=1; t_c = what remains of N=1's round time. Progress per round
    is the row's own measured mean accepted length (accepted + bonus), so O is in emitted
    tokens/s."""
    base = rows[0]
    single = [r["t_s_ms"] for r in rows if r.get("mean_batch", 1.0) <= 1.05] or [base["t_s_ms"]]
    service = statistics.median(single) / 1e3
    round_1 = 1.0 / base["R_p"] if base["R_p"] else service
    t_v = base["t_v_ms"] / 1e3
    t_c = max(0.0, round_1 - base["t_s_ms"] / 1e3 - t_v)
    model = StarModel(t_s=service / depth, t_v=t_v, t_c=t_c, beta=0.0, depth=depth)
    for row in rows:
        n = row["N"]
        row["model_O"] = n * row["mean_accepted_length"] / model.round_time(n)
        row["model_load"] = model.load(n)
        row["model_T_idle_ms"] = model.idle(n) * 1e3
        row["regime"] = model.regime(n)
        row["N_full"] = model.n_full
        row["model_S_ms"] = service * 1e3
        row["model_t_c_ms"] = t_c * 1e3


def _sweeps(s: StarBenchSettings, prompts: list[list[int]], progress=None) -> list[dict]:
    """One sweep over N per batching limit, interleaved: every limit has its own processes,
    all alive at once, and each N is measured for every limit back to back. This machine's
    speed drifts by 10-25% over a run, so rows that are compared are taken a minute apart,
    not a whole sweep apart. N_full (as estimated from the first limit's rows after each N)
    is measured too when the list lacks it, since the scaling figures are read there. With
    repeats, the sweeps run again over the same N (N_full included) with the same processes;
    each row says its repeat and is fitted with its own repeat's rows."""
    rows: dict[int, list[dict]] = {limit: [] for limit in s.max_batches}
    with contextlib.ExitStack() as stack:
        clusters = [stack.enter_context(StarCluster(s, limit)) for limit in s.max_batches]

        async def all_n() -> None:
            # Every process runs its first (slow) forwards, and the machine settles after
            # loading the models, before anything is measured.
            for cluster in clusters:
                await _workload(cluster, len(cluster.target_ports), prompts, 1)
            counts, added = list(s.targets), False
            for repeat in range(s.repeats):
                pending, measured = list(counts), []
                while pending:
                    n = pending.pop(0)
                    measured.append(n)
                    for cluster in clusters:
                        rows[cluster.max_batch].append({**await _measure(cluster, n, prompts), "repeat": repeat})
                        if progress:
                            progress()
                    if repeat:
                        continue
                    first = rows[s.max_batches[0]]
                    predict(first, s.depth)
                    n_full = first[0]["N_full"]
                    if not added and n_full in range(n + 1, max(s.targets)) and n_full not in pending:
                        pending, added = sorted(pending + [n_full]), True
                        if progress:
                            progress(added=len(clusters) * s.repeats)
                counts = measured

        asyncio.run(all_n())
    for limit_rows in rows.values():
        for repeat in range(s.repeats):
            predict([row for row in limit_rows if row["repeat"] == repeat], s.depth)
    return [row for limit in s.max_batches for row in rows[limit]]


def summarize(rows: list[dict]) -> dict:
    """The issue's scaling figures from the measured rows (pure): StarSD's one-at-a-time
    sweep (max_batch 1) for load and the model; the most batched sweep for the gain past
    N_full, against one-at-a-time at N_full (where StarSD saturates)."""
    most = max(r["max_batch"] for r in rows)
    serial = [r for r in rows if r["max_batch"] == 1]
    batched = [r for r in rows if r["max_batch"] == most]
    base = serial or batched
    n_full = base[0]["N_full"]
    full = [r for r in base if r["N"] >= n_full]
    first = base[0]
    summary = {"N_full": n_full, "Z_over_S": (first["t_v_ms"] + first["model_t_c_ms"]) / first["model_S_ms"],
               # Every N's error; the model is fitted on N=1, so its error there is ~0 by construction.
               "model_error_by_N": [[r["N"], r["O"] / r["model_O"] - 1] for r in base],
               "max_model_error_past_fit": max((abs(r["O"] / r["model_O"] - 1) for r in base if r["N"] > 1), default=None)}
    if full:
        summary["min_load_n_ge_n_full"] = min(r["load"] for r in full)
        reference = full[0]  # the first measured N at or past N_full
        top = max(batched, key=lambda r: r["N"])
        summary.update({"reference_N": reference["N"], "reference_O": reference["O"], "batched_N": top["N"],
                        "batched_max_batch": top["max_batch"], "batched_O": top["O"],
                        "batched_gain": top["O"] / reference["O"],
                        # the same in draft rounds/s, which does not depend on acceptance at all
                        "batched_round_gain": top["R_q"] / reference["R_q"]})
    return summary


# the figures whose spread over repeats the summary gives
SPREAD_KEYS = ("batched_gain", "batched_round_gain", "reference_O", "batched_O", "max_model_error_past_fit")


def summarize_repeats(summaries: list[dict]) -> dict:
    """One summary over the repeats' own (pure): the repeat of the median batched gain (the
    lower median: a measured repeat, its figures consistent with one another; the first
    repeat where no N reached N_full), with the min / median / max over the repeats of each
    SPREAD_KEYS figure every repeat has. One repeat: its summary as it is."""
    if len(summaries) == 1:
        return summaries[0]
    if all("batched_gain" in one for one in summaries):
        middle = dict(sorted(summaries, key=lambda one: one["batched_gain"])[(len(summaries) - 1) // 2])
    else:
        middle = dict(summaries[0])
    middle["repeats"] = len(summaries)
    middle["spread"] = {name: spread([one[name] for one in summaries], 4) for name in SPREAD_KEYS
                        if all(one.get(name) is not None for one in summaries)}
    return middle


def run_star_bench(s: StarBenchSettings, prompts: list[list[int]], progress=None) -> dict:
    rows = _sweeps(s, prompts, progress)
    summary = summarize_repeats([summarize([row for row in rows if row["repeat"] == repeat])
                                 for repeat in range(s.repeats)])
    return {
        "settings": {"draft": s.draft, "target": s.target, "targets": list(s.targets), "depth": s.depth,
                     "max_tokens": s.max_tokens, "sessions": s.sessions, "verify_delay_ms": s.verify_delay_ms, "dtype": s.dtype, "mode": s.mode,
                     "max_batches": list(s.max_batches), "draft_quant": s.draft_quant, "target_quant": s.target_quant,
                     "verify_time_ms": s.verify_time_ms, "emulated": s.emulated, "target_niceness": s.target_niceness,
                     "repeats": s.repeats},
        "rows": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()} for row in rows],
        "summary": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in summary.items()},
    }
