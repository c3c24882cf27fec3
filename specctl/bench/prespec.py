"""``specctl bench prespec``: plain remote speculation against pre-speculation on the star,
as separate processes on loopback (bench star's cluster and workload), at N = 1, 2, N_full and
N_full + 1 targets (as many as ``--max-targets`` allows), with verification emulated so that its
time Z is about the draft's S (``--verify-delay-ms`` adds a sleep; ``--verify-time-ms`` sets a
floor with the compute inside).

Both draft servers (one plain, one ``--prespec``) and their targets are alive at once and
each N is measured for both back to back, ``repeats`` times, so drift on this machine hits
both alike. Each prespec row carries the hit rate, the branches drafted and used, the
share of idle time used, and the prediction of its tokens/s over plain's: SSD's round (Theorem 7
with a just-in-time fallback) on the star of N targets (``draft.plan.prespec_round_time``):
gain = (E_pre / E_plain) · T_plain(N) / max(e·Z_own + (h - e)·max(Z, S) + (1 - h)(Z + S) + w, N·(1 - h)·S),
T_plain(N) measured (plain's round in the same repeat: at N = 1 it is S + Z; past that it holds
the queue of the plain star, which StarSD's max(Z + S, N·S) leaves out), S and Z measured on
plain speculation at N = 1, w = half the pre-speculating server's mean background step at
N >= 2 (a request waits out the step in flight). h is the ready share: SSD's hit answers at
once, ours may still have drafting left, so a hit counts by the share of its proposal drafted,
and a round the trials left without pre-speculation counts as a miss. e is the share of rounds the
event loop answered at once from a published branch (draft.early): their round is the target's own
side of plain's, Z_own = plain's round less its target's wait for a proposal (Z, taken as plain's
round less the draft's busy time S, also holds draft-side time such an answer skips)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from dataclasses import dataclass

from specctl.bench.spread import spread
from specctl.bench.star import StarBenchSettings, StarCluster, _measure, _workload, predict
from specctl.draft.plan import prespec_round_time
from specctl.verify.client import remote_stats

PRESPEC_KEYS = ("hits", "hit_drafted", "misses", "partial_hits", "short_answers", "early_answers", "branches_drafted",
                "branches_used", "fallback_jit", "jit_carried", "fallback_ngram", "skipped")


@dataclass(frozen=True, slots=True)
class PrespecBenchSettings:
    star: StarBenchSettings  # the draft, targets, depth, workload and emulated verification
    budget: int = 8
    fallback: str = "jit"
    repeats: int = 3
    trials: bool = True  # False: --no-prespec-trials, pre-speculation in every round

    @property
    def prespec_star(self) -> StarBenchSettings:
        args = ("--prespec", "--prespec-budget", str(self.budget), "--fallback", self.fallback)
        return dataclasses.replace(self.star, draft_args=args + (() if self.trials else ("--no-prespec-trials",)))


async def _prespec_row(cluster: StarCluster, n: int, prompts: list[list[int]], texts: list) -> dict:
    stats = await remote_stats("127.0.0.1", cluster.draft_port)
    before, before_steps, before_busy = stats.get("prespec", {}), stats.get("background_steps", 0), stats.get("background_s", 0.0)
    row = await _measure(cluster, n, prompts, texts)
    draft = await remote_stats("127.0.0.1", cluster.draft_port)
    after = draft.get("prespec", {})
    for key in PRESPEC_KEYS:
        row[key] = after.get(key, 0) - before.get(key, 0)
    looked = row["hits"] + row["misses"]
    row["hit_rate"] = row["hits"] / looked if looked else 0.0
    row["ready_rate"] = row["hit_drafted"] / looked if looked else 0.0
    rounds = looked + row["skipped"]  # a round without pre-speculation is drafted when its outcome comes
    row["ready_share"] = row["hit_drafted"] / rounds if rounds else 0.0
    row["early_share"] = row["early_answers"] / rounds if rounds else 0.0  # answered at once by the event loop
    steps = draft.get("background_steps", 0) - before_steps
    row["background_step_mean_ms"] = 1e3 * (draft.get("background_s", 0.0) - before_busy) / steps if steps else 0.0
    row["proposal_bytes_mean"] = draft.get("proposal_bytes_mean", 0.0)
    row["background_delay_max_ms"] = draft.get("background_delay_max_ms", 0.0)
    row["background_step_max_ms"] = draft.get("background_step_max_ms", 0.0)
    return row


def compare(plain: dict, pre: dict, service_s: float, return_s: float, step_s: float = 0.0,
            own_return_s: float | None = None) -> dict:
    """The prespec row against the plain row of the same N and repeat, with the prediction (pure):
    SSD's round on the star of ``pre["N"]`` targets against plain's measured round, S, Z and
    the draft step measured on plain speculation at N = 1; the wait behind a background step
    is half the pre-speculating server's mean one when the row has it, else half ``step_s``.
    ``own_return_s``: the target's own side of plain's round at N = 1 (the round less its wait
    for a proposal), the round of a hit the event loop answered at once (``early_answers``)."""
    t_p = service_s / return_s if return_s > 0 else 0.0
    length_ratio = pre["mean_accepted_length"] / plain["mean_accepted_length"] if plain["mean_accepted_length"] else 1.0
    ready = pre.get("ready_share", pre["ready_rate"])
    background_step = pre.get("background_step_mean_ms", 0.0) / 1e3 or step_s
    plain_round = 1.0 / plain["R_p"] if plain.get("R_p") else service_s + return_s
    # (a row of an older report has no early share: none priced apart)
    at_once = min(pre.get("early_share", 0.0), ready) if own_return_s is not None else 0.0
    round_time = prespec_round_time(pre["N"], ready, service_s, return_s, background_step, at_once, own_return_s)
    predicted = length_ratio * plain_round / round_time
    gain = pre["O"] / plain["O"] if plain["O"] else 0.0
    return {"N": pre["N"], "gain": gain, "predicted_gain": predicted, "prediction_error": gain / predicted - 1,
            "T_p": t_p, "hit_rate": pre["hit_rate"], "ready_rate": pre["ready_rate"], "ready_share": ready}


def summarize(pairs: list[dict]) -> dict:
    """min / median / max of each N's gain and prediction error over the repeats (pure)."""
    by_n: dict[int, list[dict]] = {}
    for pair in pairs:
        by_n.setdefault(pair["N"], []).append(pair)
    return {str(n): {"gain": spread([p["gain"] for p in rows]), "predicted_gain": spread([p["predicted_gain"] for p in rows]),
                     "prediction_error": spread([p["prediction_error"] for p in rows]),
                     "hit_rate": spread([p["hit_rate"] for p in rows]), "same_as_plain": all(p["same_as_plain"] for p in rows)}
            for n, rows in sorted(by_n.items())}


def first_loads(max_targets: int) -> list[int]:
    """N = 1 and 2, as far as the target processes allow (an N = 1-only run: ``--max-targets 1``)."""
    return [n for n in (1, 2) if n <= max_targets]


def loads_past_two(n_full: int, max_targets: int) -> list[int]:
    """The loads measured after N = 1 and 2 (pure): N_full, or as near as the processes allow, and
    N_full + 1 when they allow it, since the aim "no loss at N >= N_full" is about past it too."""
    return [n for n in (min(n_full, max_targets), n_full + 1) if 2 < n <= max_targets]


def run_prespec_bench(s: PrespecBenchSettings, prompts: list[list[int]], progress=None) -> dict:
    rows: list[dict] = []
    pairs: list[dict] = []
    with contextlib.ExitStack() as stack:
        plain = stack.enter_context(StarCluster(s.star, s.star.max_batches[0]))
        pre = stack.enter_context(StarCluster(s.prespec_star, s.star.max_batches[0]))

        async def sweep() -> None:
            for cluster in (plain, pre):  # first forwards and settling, not measured
                await _workload(cluster, len(cluster.target_ports), prompts, 1)
            pending, n_full, model = first_loads(max(s.star.targets)), None, None
            while pending:
                n = pending.pop(0)
                for repeat in range(s.repeats):
                    plain_texts, pre_texts = [], []
                    a = await _measure(plain, n, prompts, plain_texts)
                    b = await _prespec_row(pre, n, prompts, pre_texts)
                    a.update(mode="plain", repeat=repeat)
                    b.update(mode="prespec", repeat=repeat)
                    rows.extend([a, b])
                    if n == 1 and model is None:
                        predict([a], s.star.depth)
                        n_full = a["N_full"]
                        service = a["model_S_ms"] / 1e3
                        model = (service, 1.0 / a["R_p"] - service, service / max(a["drafted_per_round"], 1.0),
                                 1.0 / a["R_p"] - a["proposal_ms"] / 1e3)
                        for more in loads_past_two(n_full, max(s.star.targets)):
                            pending.append(more)
                            if progress:
                                progress(added=s.repeats)
                    pair = compare(a, b, *model)
                    pair.update(repeat=repeat, same_as_plain=plain_texts == pre_texts, rows=[len(rows) - 2, len(rows) - 1])
                    pairs.append(pair)
                    if progress:
                        progress()

        asyncio.run(sweep())
    return {
        "settings": {"draft": s.star.draft, "target": s.star.target, "mode": s.star.mode, "depth": s.star.depth,
                     "max_tokens": s.star.max_tokens, "sessions": s.star.sessions, "verify_delay_ms": s.star.verify_delay_ms,
                     "verify_time_ms": s.star.verify_time_ms, "draft_step_ms": s.star.draft_step_ms,
                     "dtype": s.star.dtype, "draft_quant": s.star.draft_quant, "target_quant": s.star.target_quant,
                     "budget": s.budget, "fallback": s.fallback, "repeats": s.repeats, "trials": s.trials,
                     "emulated": s.star.emulated},
        "rows": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()} for row in rows],
        "pairs": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in pair.items()} for pair in pairs],
        "summary": summarize(pairs),
    }
