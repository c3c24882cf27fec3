"""``specctl plan``: StarSD's analytical model for one draft server and N targets."""

from __future__ import annotations

import json
import math
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from specctl.draft.plan import StarModel
from specctl.errors import ConfigError


def plan_report(model: StarModel, standalone: Optional[float]) -> dict:
    n_max = model.n_max(standalone)
    rows = []
    for n in range(1, max(n_max, model.n_full) + 3):
        rows.append({
            "N": n, "T_idle_ms": round(model.idle(n) * 1e3, 3), "load": round(model.load(n), 4),
            "system_tokens_per_s": round(model.system_throughput(n), 3),
            "per_target_tokens_per_s": round(model.per_target_throughput(n), 3), "regime": model.regime(n),
        })
    return {"E_l": round(model.expected_accepted, 4), "S_ms": round(model.service * 1e3, 3),
            "Z_ms": round(model.return_time * 1e3, 3), "N_full": model.n_full, "N_max": n_max, "rows": rows}


def plan(
    ts: Optional[float] = typer.Option(None, "--ts", help="draft time per drafted token t_s (ms)"),
    tv: Optional[float] = typer.Option(None, "--tv", help="verification time per round t_v (ms)"),
    tc: float = typer.Option(0.0, "--tc", help="communication time per round t_c (ms)"),
    beta: Optional[float] = typer.Option(None, "--beta", help="per-token acceptance probability β in [0, 1)"),
    depth: Optional[int] = typer.Option(None, "--depth", help="proposal depth d"),
    standalone: Optional[float] = typer.Option(None, "--standalone", help="the target's standalone tokens/s (sets N_max)"),
    pipeline: bool = typer.Option(False, "--pipeline", help="SpecPipe instead: pick the tree width w from "
                                  "--stages, --widths, --step-ms and --hit"),
    stages: int = typer.Option(4, "--stages", help="--pipeline: pipeline stages m"),
    widths: str = typer.Option("1,2,4,8", "--widths", help="--pipeline: candidate widths w"),
    step_ms: Optional[str] = typer.Option(None, "--step-ms", help="--pipeline: measured step time t(w) per width (ms)"),
    hit: Optional[str] = typer.Option(None, "--hit", help="--pipeline: measured hit rate P(w) per width (bench "
                                      "pipeline reports it)"),
    refill: Optional[int] = typer.Option(None, "--refill", help="--pipeline: levels sent with the token after a "
                                         "miss (default: stages - 1, as verify --stage does; 0 = the token alone)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
) -> None:
    """Predict draft load, idle time and throughput for N = 1.. targets sharing one draft server
    (StarSD); with --pipeline, SpecPipe's time between tokens per tree width (E(T), eq. 2)."""
    if pipeline:
        _plan_pipeline(stages, widths, step_ms, hit, stages - 1 if refill is None else refill, as_json)
        return
    if None in (ts, tv, beta, depth):
        raise ConfigError("plan needs --ts, --tv, --beta and --depth (or --pipeline with its own flags)")
    if standalone is not None and not (math.isfinite(standalone) and standalone > 0):
        raise ConfigError(f"--standalone must be a positive number of tokens/s, got {standalone}")
    try:
        model = StarModel(ts / 1e3, tv / 1e3, tc / 1e3, beta, depth)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    report = plan_report(model, standalone)
    if as_json:
        print(json.dumps(report))
        return
    console = Console()
    console.print(f"E[l] = {report['E_l']:.3f} accepted tokens/round, S(d) = {report['S_ms']:.1f} ms, "
                  f"Z(d) = {report['Z_ms']:.1f} ms, N_full = {report['N_full']}, N_max = {report['N_max']}"
                  + ("" if standalone else " (no --standalone: N_max = N_full)"))
    table = Table()
    for column in ("N", "T_idle ms", "draft load", "system tok/s", "per-target tok/s", "regime"):
        table.add_column(column, justify="right")
    for r in report["rows"]:
        table.add_row(str(r["N"]), f"{r['T_idle_ms']:.1f}", f"{r['load']:.0%}", f"{r['system_tokens_per_s']:.2f}",
                      f"{r['per_target_tokens_per_s']:.2f}", r["regime"])
    console.print(table)


def _numbers(text: str, flag: str, kind=float) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag} must be comma-separated numbers, got {text!r}") from None


def _plan_pipeline(stages: int, widths: str, step_ms: str | None, hit: str | None, refill: int, as_json: bool) -> None:
    from specctl.pipeline.plan import WidthOption, pick_width

    if step_ms is None or hit is None:
        raise ConfigError("plan --pipeline needs --step-ms and --hit, one value per width (bench pipeline measures them)")
    ws, ts, ps = _numbers(widths, "--widths", int), _numbers(step_ms, "--step-ms"), _numbers(hit, "--hit")
    if not len(ws) == len(ts) == len(ps):
        raise ConfigError(f"--widths, --step-ms and --hit need one value per width ({len(ws)}, {len(ts)}, {len(ps)} given)")
    rows, best = pick_width(stages, [WidthOption(w, t, p) for w, t, p in zip(ws, ts, ps)], refill)
    if as_json:
        print(json.dumps({"stages": stages, "refill": refill, "best_width": best, "rows": rows}))
        return
    table = Table(title=f"SpecPipe over {stages} stages, refill D = {refill}: "
                        "E(T) = t(w) (1 + (1 - P(w)) m - P(w) (1 - P(w)^D))")
    for column in ("w", "t(w) ms", "P(w)", "E(T) ms", ""):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(str(r["width"]), f"{r['step_ms']:.1f}", f"{r['hit_rate']:.0%}", f"{r['expected_tbt_ms']:.1f}",
                      "best" if r["width"] == best else "")
    Console().print(table)
