"""The prediction of `specctl bench prespec`, applied as it stands now to every stored run. The runs
up to 2026-11-26 were looked at while the star form of the prediction was chosen (2026-11-27), so
they show the fit; runs made after it are the held-out check.

    python examples/prespec_prediction_check.py [docs/results/bench-prespec-*.json ...] [--json OUT]

For each run and N: the measured gain over plain speculation (median of the repeats) beside the
prediction of `specctl.bench.prespec.compare` (SSD's round on StarSD's star) with the run's own
inputs (S, Z and the draft step of plain speculation at N = 1; per repeat plain's round, the ready
share, the mean background step where the run recorded it, and the mean accepted lengths). A
run's draft is "emulated" when every draft forward had a floor (`--draft-step-ms`: a forward
costs about the same for 1 or 16 rows, as on a GPU), else it is this CPU's draft."""
import argparse
import glob
import json
import statistics

from rich.console import Console
from rich.table import Table

from specctl.bench.prespec import compare


def ready_share(row: dict) -> float:
    """The share of rounds answered from a ready branch, rebuilt for runs stored before the field."""
    if "ready_share" in row:
        return row["ready_share"]
    rounds = row.get("hits", 0) + row.get("misses", 0) + (row.get("skipped") or 0)
    return row.get("hit_drafted", row.get("hits", 0)) / rounds if rounds else 0.0


def check(report: dict) -> list[dict] | None:
    rows = report["rows"]
    base = next((r for r in rows if r["N"] == 1 and r["mode"] == "plain" and r.get("model_S_ms")), None)
    if base is None:
        return None
    service = base["model_S_ms"] / 1e3
    return_time = 1.0 / base["R_p"] - service
    # runs stored before the field: drafted per round from the accepted length and acceptance rate
    drafted = base.get("drafted_per_round") or (base["mean_accepted_length"] - 1) / max(base["acceptance_rate"], 1e-9)
    step = service / max(drafted, 1.0)
    by_n: dict[int, list[dict]] = {}
    for pair in report["pairs"]:
        plain, pre = (rows[i] for i in pair["rows"])
        pre = {**pre, "ready_rate": pre.get("ready_rate", pre["hit_rate"]), "ready_share": ready_share(pre)}
        by_n.setdefault(pair["N"], []).append(compare(plain, pre, service, return_time, step))
    settings = report["settings"]
    return [{"N": n, "T_p": service / return_time, "trials": settings.get("trials"),
             "draft": "emulated" if settings.get("draft_step_ms") else "cpu",
             "gain": statistics.median(p["gain"] for p in pairs),
             "predicted": statistics.median(p["predicted_gain"] for p in pairs),
             "error": statistics.median(p["prediction_error"] for p in pairs)}
            for n, pairs in sorted(by_n.items())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*")
    parser.add_argument("--json", help="write the checks here")
    args = parser.parse_args()
    files = args.files or sorted(glob.glob("docs/results/bench-prespec-*.json"))
    table = Table(title="bench prespec's prediction (SSD's round on StarSD's star) on stored runs")
    for column in ("run", "draft", "T_p", "N", "gain (median)", "predicted", "error"):
        table.add_column(column, justify="left" if column == "run" else "right")
    checks: dict[str, list[dict]] = {}
    for path in files:
        with open(path) as f:
            result = check(json.load(f))
        if result is None:
            continue
        name = path.rsplit("bench-prespec-", 1)[-1].removesuffix(".json")
        checks[name] = result
        for i, c in enumerate(result):
            table.add_row(name if i == 0 else "", c["draft"], f"{c['T_p']:.2f}", str(c["N"]), f"{c['gain']:.2f}x",
                          f"{c['predicted']:.2f}x", f"{c['error']:+.0%}")
    flat = [c for result in checks.values() for c in result]
    for draft in ("emulated", "cpu"):
        for ns, label in (((1,), "N = 1"), ((2, 3, 4, 5), "N >= 2")):
            picked = [c for c in flat if c["draft"] == draft and c["N"] in ns]
            within = sum(abs(c["error"]) <= 0.15 for c in picked)
            table.caption = (table.caption + "; " if table.caption else "") + f"{draft} draft, {label}: {within}/{len(picked)} within 15 %"
    Console(width=160).print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(checks, f, indent=1)


if __name__ == "__main__":
    main()
