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
    ts: float = typer.Option(..., "--ts", help="draft time per drafted token t_s (ms)"),
    tv: float = typer.Option(..., "--tv", help="verification time per round t_v (ms)"),
    tc: float = typer.Option(0.0, "--tc", help="communication time per round t_c (ms)"),
    beta: float = typer.Option(..., "--beta", help="per-token acceptance probability β in [0, 1)"),
    depth: int = typer.Option(..., "--depth", help="proposal depth d"),
    standalone: Optional[float] = typer.Option(None, "--standalone", help="the target's standalone tokens/s (sets N_max)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
) -> None:
    """Predict draft load, idle time and throughput for N = 1.. targets sharing one draft server."""
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
