"""The benchmark commands' tables: pure functions of their JSON reports."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def table_console(min_width: int = 120) -> Console:
    """Where a benchmark's tables go: stdout at least ``min_width`` columns wide, so a table
    piped to a file keeps its figures whole (rich assumes 80 columns off a terminal)."""
    return Console(width=max(Console().width, min_width))


def fmt(value: float | None, spec: str = "{:.2f}") -> str:
    return "-" if value is None else spec.format(value)


def render_local_table(report: dict) -> Table:
    s = report["settings"]
    table = Table(title=f"bench local: {s['target']} / {s['draft']}, {s['dtype']}, {s['prompts']} prompts x "
                        f"{s['max_tokens']} tokens, {s['repeats']} repeat(s)")
    for column in ("mode", "tokens/s", "vs ar", "min / median / max", "mean accepted length",
                   "acceptance", "same as ar"):
        table.add_column(column, justify="right" if column != "mode" else "left")
    for mode, r in report["modes"].items():
        spread = r["speedup_min_median_max"]
        table.add_row(mode, fmt(r["tokens_per_s"]), fmt(r["speedup_vs_ar"], "{:.2f}x"),
                      "-" if spread is None else " / ".join(f"{x:.2f}x" for x in spread),
                      fmt(r["mean_accepted_length"]), fmt(r["acceptance_rate"], "{:.0%}"),
                      fmt(r["outputs_equal_to_ar"], "{:.0%}"))
    return table


def render_local_kinds(report: dict) -> Table:
    kinds = sorted({kind for r in report["modes"].values() for kind in r["per_kind"]})
    table = Table(title="by class of prompt: tokens/s vs ar (same as ar)")
    table.add_column("mode")
    for kind in kinds:
        table.add_column(kind, justify="right")
    for mode, r in report["modes"].items():
        cells = []
        for kind in kinds:
            k = r["per_kind"].get(kind, {})
            ratio, same = k.get("speedup_vs_ar"), k.get("outputs_equal_to_ar")
            cells.append("-" if ratio is None else f"{ratio:.2f}x ({same:.0%})" if same is not None else f"{ratio:.2f}x")
        table.add_row(mode, *cells)
    return table


def render_star_table(report: dict) -> Table:
    s = report["settings"]
    label = (f" (emulated: +{s['verify_delay_ms']:.0f} ms per verification, targets at nice "
             f"{s.get('target_niceness', 0)})") if s["emulated"] else ""
    table = Table(title=f"bench star: {s['draft']} -> {s['target']}, d={s['depth']}{label}")
    repeats = s.get("repeats", 1) > 1
    if repeats:
        table.add_column("repeat", justify="right")
    for column in ("batch", "N", "O", "O model", "O_i", "t_s", "T_wait", "T_idle", "R_q", "R_p", "load", "load model",
                   "regime"):
        table.add_column(column, justify="right")
    for r in report["rows"]:
        batch = f"{r['max_batch']} ({r['mean_batch']:.1f})" if "mean_batch" in r else "-"
        table.add_row(*([str(r["repeat"] + 1)] if repeats else []), batch, str(r["N"]), f"{r['O']:.2f}",
                      f"{r['model_O']:.2f}", f"{r['O_i']:.2f}", f"{r['t_s_ms']:.0f}",
                      f"{r['T_wait_ms']:.0f}", f"{r['T_idle_ms']:.0f}", f"{r['R_q']:.2f}", f"{r['R_p']:.2f}",
                      f"{r['load']:.0%}", f"{r['model_load']:.0%}", "full" if r["regime"] == "fully loaded" else "under")
    table.caption = ("batch: the draft's batching limit (mean requests per forward); O, O_i: tokens/s; t_s, T_wait, "
                     "T_idle: ms per draft request; R_q: draft requests/s; R_p: rounds/s per target")
    return table


def render_star_summary(summary: dict) -> str:
    errors = ", ".join(f"N={n}: {e:+.1%}" for n, e in summary["model_error_by_N"])
    lines = [f"Z = {summary['Z_over_S']:.1f} S, N_full {summary['N_full']}; one-at-a-time, measured O vs the model "
             f"(fitted on N=1): {errors}"]
    if "min_load_n_ge_n_full" in summary:
        lines[0] += f", draft load >= {summary['min_load_n_ge_n_full']:.0%} for N >= N_full"
        lines.append(f"batched drafting (max batch {summary['batched_max_batch']}) at N={summary['batched_N']}: "
                     f"{summary['batched_O']:.2f} tok/s = {summary['batched_gain']:.2f}x one-at-a-time at "
                     f"N={summary['reference_N']} ({summary['reference_O']:.2f} tok/s); {summary['batched_round_gain']:.2f}x in draft rounds/s")
    if "spread" in summary:
        figures = "; ".join(f"{name} {v['min']:.2f} / {v['median']:.2f} / {v['max']:.2f}"
                            for name, v in summary["spread"].items())
        which = "the repeat of the median batched gain" if "batched_gain" in summary else "the first repeat"
        lines.append(f"over {summary['repeats']} repeats (the lines above: {which}), min / median / max: {figures}")
    return "\n".join(lines)


def render_serve_table(report: dict, title: str) -> Table:
    table = Table(title=title)
    for column in ("clients", "variant", "tokens/s", "vs ar", "vs ar batched", "TTFT p50", "latency p50", "same as ar"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    for r in sorted(report["rows"], key=lambda r: (r["clients"], list(report["settings"]["variants"]).index(r["variant"]))):
        table.add_row(str(r["clients"]), r["variant"], f"{r['tokens_per_s']:.2f}",
                      ratio_cell(r.get("vs ar"), r.get("vs ar per repeat")),
                      ratio_cell(r.get("vs ar batched"), r.get("vs ar batched per repeat")),
                      f"{r['ttft_p50_ms']:.0f} ms", f"{r['latency_p50_ms']:.0f} ms", fmt(r.get("same_as_ar"), "{:.0%}"))
    captions = []
    if report["settings"].get("repeats", 1) > 1:
        captions.append("tokens/s and ratios: of the totals over the repeats; below a ratio its min-max over the repeats")
    if any(r.get("same_as_ar_of") == "ar batched" for r in report["rows"]):
        captions.append("same as ar: the texts of ar batched (ar not run)")
    table.caption = "; ".join(captions) or None
    return table


def hit_cell(row: dict) -> str:
    if row.get("hit_rate") is None:
        return "-"
    return f"{row['hit_rate']:.0%} / {row.get('bubbles_per_token', 0):.2f}"


def render_pipeline_table(report: dict) -> Table:
    s = report["settings"]
    table = Table(title=f"bench pipeline: {s['prompts']} prompts x {s['max_tokens']} tokens, {s['stage_delay_ms']:.0f} ms "
                        f"emulated per stage step, {s['repeats']} repeat(s); n stages, TBT = time between tokens "
                        "(median, min-max), tok/s = all sessions together, ratios of tok/s, hit = steps whose token "
                        "was in the tree / steps wasted on a pruned level per token")
    against_specpipe = any("vs_specpipe" in r for r in report["rows"])  # prompts with Predicted Outputs
    columns = ("n", "mode", "TBT ms", "tok/s", "vs PP", "vs chain") + (("vs SpecPipe",) if against_specpipe else ())
    for column in columns + ("hit", "E(T) ms", "same"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for r in report["rows"]:
        predicted = r.get("predicted_tbt_ms")
        prediction = "-" if predicted is None else f"{predicted:.0f} ({r['prediction_error']:.0%})"
        spread = "" if r["tbt_ms_min"] == r["tbt_ms_max"] else f" ({r['tbt_ms_min']:.0f}-{r['tbt_ms_max']:.0f})"
        ratios = [ratio_cell(r["vs_pp"], r.get("vs_pp_per_prompt")),
                  ratio_cell(r["vs_pp_chain"], r.get("vs_pp_chain_per_prompt"))]
        if against_specpipe:
            ratios.append(ratio_cell(r.get("vs_specpipe"), r.get("vs_specpipe_per_prompt")))
        table.add_row(str(r["stages"]), r["mode"], f"{r['tbt_ms']:.0f}{spread}", f"{r['tokens_per_s']:.2f}",
                      *ratios, hit_cell(r), prediction, f"{r['same_as_target']}/{r['runs']}")
    table.caption = "vs PP / vs chain: the ratio of the totals; below it the per-prompt ratios' min-max"
    if against_specpipe:
        table.caption += ("; specpipe+prediction: a request's Predicted Output grafted onto SpecPipe's tree (what "
                          "a SpecPipe target runs), pp+chain+prediction: the round loop with it")
    return table


def ratio_cell(ratio: float | None, per_prompt: dict | None) -> str:
    if ratio is None:
        return "-"
    if per_prompt is None or per_prompt["min"] == per_prompt["max"]:
        return f"{ratio:.2f}x"
    return f"{ratio:.2f}x\n{per_prompt['min']:.2f}-{per_prompt['max']:.2f}"


def render_prespec_table(report: dict) -> Table:
    s = report["settings"]
    label = ""
    if s.get("verify_time_ms"):
        label += f", every verification >= {s['verify_time_ms']:.0f} ms (emulated)"
    if s["verify_delay_ms"]:
        label += f", +{s['verify_delay_ms']:.0f} ms per verification (emulated)"
    if s.get("draft_step_ms"):
        label += f", every draft forward >= {s['draft_step_ms']:.0f} ms (emulated)"
    table = Table(title=f"bench prespec: {s['draft']} -> {s['target']}, {s.get('mode', 'chain')} d={s['depth']}, budget {s['budget']}, "
                        f"fallback {s['fallback']}, {'trials' if s.get('trials', True) else 'every round'}{label}")
    for column in ("N", "plain O", "prespec O", "gain", "predicted", "hit (ready)", "partial (short)", "skipped", "branches used",
                   "MAL plain/pre", "T_p", "same as plain"):
        table.add_column(column, justify="right")
    rows = report["rows"]
    for pair in report["pairs"]:
        plain, pre = (rows[i] for i in pair["rows"])
        table.add_row(str(pair["N"]), f"{plain['O']:.2f}", f"{pre['O']:.2f}", f"{pair['gain']:.2f}x",
                      f"{pair['predicted_gain']:.2f}x", f"{pre['hit_rate']:.0%} ({pre.get('ready_rate', pre['hit_rate']):.0%})",
                      f"{pre['partial_hits']} ({pre.get('short_answers', 0)})",
                      str(pre.get("skipped", 0)),
                      f"{pre['branches_used']}/{pre['branches_drafted']}",
                      f"{plain['mean_accepted_length']:.2f}/{pre['mean_accepted_length']:.2f}", f"{pair['T_p']:.2f}",
                      "yes" if pair["same_as_plain"] else "NO")
    spread = "; ".join(f"N={n}: gain {v['gain']['min']:.2f}/{v['gain']['median']:.2f}/{v['gain']['max']:.2f}x"
                       for n, v in report["summary"].items())
    table.caption = (f"O: tokens/s of all N targets; gain: prespec O / plain O of the same repeat (min/median/max: "
                     f"{spread}); predicted: SSD's round (Theorem 7) on the star of N targets against plain's measured "
                     f"round, with half a background step's wait at N >= 2 and the measured ready share (hits, a partial "
                     f"one by the share of its proposal drafted when its outcome came, a short one whole, among all rounds: "
                     f"one the trials skipped is a miss), T_p = S/Z; short: partial "
                     f"hits answered at once with the tokens drafted so far")
    return table


def render_kernels_table(report: dict) -> Table:
    s = report["settings"]
    table = Table(title=f"bench kernels: {report['model']} ({report['params_millions']}M params, {s['dtype']}) on "
                        f"{report['device']}, context {s['context']}; limit {report['bandwidth_limit_ms']:.2f} ms/step "
                        f"at {report['bandwidth_gbps']:.0f} GB/s")
    table.add_column("tokens", justify="right")
    for variant in report["variants"]:
        table.add_column(f"{variant} ms (min/med/max)", justify="right")
    table.add_column("tokens/s (best)", justify="right")
    table.add_column("of limit", justify="right")
    for row in report["steps"]:
        spreads = [" / ".join(f"{x:.2f}" for x in row["ms_min_median_max"][v]) for v in report["variants"]]
        table.add_row(str(row["tokens"]), *spreads, f"{row['tokens_per_s']:.0f}", f"{row['fraction_of_bandwidth_limit']:.0%}")
    return table


def render_kernel_batches_table(report: dict) -> Table:
    """Forwards of several sessions (``bench kernels --sessions``), each way they can run."""
    table = Table(title="batched steps: several sessions, each its own KV cache (context as above)")
    for header in ("variant", "sessions", "tokens each", "how", "ms (min/med/max)", "x sessions x one step"):
        table.add_column(header, justify="left" if header in ("variant", "how") else "right")
    for row in report["batches"]:
        ratio = row["vs_sessions_times_one_step"]
        table.add_row(row["variant"], str(row["sessions"]), str(row["tokens_each"]), row["how"],
                      " / ".join(f"{x:.2f}" for x in row["ms_min_median_max"]),
                      "-" if ratio is None else f"{ratio:.2f}")
    return table


def render_kernel_decode(report: dict) -> Table:
    """AR generation, a token's cost with the round loop (``bench kernels --decode``)."""
    decode = report["decode"]
    table = Table(title=f"AR generation: {decode['rows'][0]['tokens']} tokens after the context, {decode['variant']}, "
                        f"{report['settings']['repeats']} generations")
    for header in ("how", "ms a token (min/med/max)", "tokens/s", "of limit"):
        table.add_column(header, justify="left" if header == "how" else "right")
    for row in decode["rows"]:
        table.add_row(row["how"], " / ".join(f"{x:.2f}" for x in row["ms_min_median_max"]),
                      f"{row['tokens_per_s']:.0f}", f"{row['fraction_of_bandwidth_limit']:.0%}")
    return table


def render_kernel_profile(profile: dict) -> Table:
    """Where an AR step's time goes (``bench kernels --profile``): the kernels that take most of it."""
    table = Table(title=f"where an AR step goes: {profile['variant']}, {profile['steps']} steps profiled, "
                        f"{profile['device_time']}",
                  caption=f"{profile['kernels_per_step']:.0f} {profile['unit']} a step, busy {profile['busy_us_per_step']:.0f} us "
                          f"of {profile['wall_us_per_step']:.0f} us a step ({profile['busy_share_of_wall']:.0%}; "
                          f"{profile['profiled_wall_us_per_step']:.0f} us a step under the profiler); "
                          f"the other {profile['rest']['names']} names: "
                          f"{profile['rest']['calls_per_step']:.0f} calls, {profile['rest']['us_per_step']:.0f} us a step")
    for header in ("kernel", "calls a step", "us a step", "of busy"):
        table.add_column(header, justify="left" if header == "kernel" else "right", overflow="fold")
    for row in profile["top"]:
        table.add_row(row["name"], f"{row['calls_per_step']:.1f}", f"{row['us_per_step']:.1f}", f"{row['share']:.0%}")
    return table


def render_drafters_summary(report: dict) -> Table:
    against = report["against_best_single"]
    modes = [m for m in against if isinstance(against[m], dict)]
    kinds = sorted(against[modes[0]]["per_kind"])
    table = Table(title=f"against the best single drafter ({against['best_single']} overall; per class its best)")
    table.add_column("mode")
    table.add_column("overall", justify="right")
    for kind in kinds:
        table.add_column(kind, justify="right")
    for mode in modes:
        row = against[mode]
        table.add_row(mode, f"{row['overall']:.2f}x", *(f"{row['per_kind'][k]:.2f}x" for k in kinds))
    for key, label in (("ceiling_best_per_class", "ceiling: each class its best single"),
                       ("ceiling_best_per_class_or_ar", "ceiling: ... or ar where faster")):
        if against.get(key) is not None:
            table.add_row(label, f"{against[key]:.2f}x", *("" for _ in kinds), style="dim")
    return table
