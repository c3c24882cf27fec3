"""``specctl bench ...``: benchmarks that print tables and write JSON."""

from __future__ import annotations

import functools
import json
import signal
import sys
import threading
from typing import Callable, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from specctl.config import QUANTS, build_config
from specctl.bench.render import (
    render_local_kinds, render_local_table, render_star_summary, render_star_table, table_console,
)
from specctl.cli.bench_drafters import drafters
from specctl.cli.bench_kernels import kernels
from specctl.cli.bench_pipeline import pipeline
from specctl.cli.bench_prespec import prespec
from specctl.cli.bench_serve import serve
from specctl.errors import ConfigError

app = typer.Typer(help="Benchmarks: ratios against baselines measured in the same run.", no_args_is_help=True)


def int_list(text: str, flag: str) -> tuple[int, ...]:
    """Comma-separated integers, sorted and without repeats."""
    try:
        return tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise ConfigError(f"{flag} must be comma-separated integers, got {text!r}") from None


@app.command("local")
def local(
    target: Optional[str] = typer.Option(None, help="target model (default: the profile's, qwen2.5-coder-1.5b)"),
    draft: Optional[str] = typer.Option(None, help="draft model (default: qwen2.5-coder-0.5b); NAME@N = first N layers"),
    prompts: str = typer.Option("builtin", help="builtin (8 prompts), heldout (20 never tuned on), mixed (16: code, prose, edits, summaries), infill (12 code infills: fill in the middle), edits (8 code edits with their predictions), long-edits (6 edits of 40-50 lines) or a JSON-lines file of {\"prompt\", \"chat\", \"kind\", \"suffix\", \"prediction\"}"),
    max_tokens: int = typer.Option(128, "--max-tokens", "-n", help="new tokens per prompt"),
    modes: str = typer.Option("ar,chain,tree,ngram,hf-assisted", help="comma-separated modes to compare; "
                              "MODE+prediction (e.g. chain+prediction) runs MODE with each prompt's prediction"),
    dtype: Optional[str] = typer.Option(None, help="fp32 | bf16 | fp16"),
    draft_quant: Optional[str] = typer.Option(None, "--draft-quant", help="none | int8: quantize the draft for chain/tree"),
    draft_stop: Optional[float] = typer.Option(None, "--draft-stop", help="adaptive depth: stop drafting once the draft's probability of its path is below this (0 = off)"),
    depth: Optional[int] = typer.Option(None, help="proposal depth d"),
    width: Optional[int] = typer.Option(None, help="tree width w"),
    topk: Optional[int] = typer.Option(None, help="tree top-k"),
    limit: int = typer.Option(0, help="use only the first N prompts (0 = all)"),
    repeats: int = typer.Option(1, help="turns over all prompts; each gives one ratio per mode (min/median/max reported)"),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads"),
    profile: Optional[str] = typer.Option(None, help="hardware profile"),
    json_out: Optional[str] = typer.Option(None, "--json", help="write the report as JSON to this file"),
) -> None:
    """Compare ar, chain, tree, ngram, suffix and transformers' assisted generation on the same prompts."""
    from specctl.bench.local import MODES, PREDICTED, known_mode, run_local_bench
    from specctl.bench.prompts import load_prompts
    from specctl.spec.factory import apply_threads, load_named

    wanted = [m.strip() for m in modes.split(",") if m.strip()]
    unknown = [m for m in wanted if not known_mode(m)]
    if unknown or not wanted:
        raise ConfigError(f"unknown modes {', '.join(unknown) or '(none)'}: choose from {', '.join(MODES)} (MODE"
                          f"{PREDICTED}: with each prompt's prediction)")
    if "ar" in wanted:  # the baseline runs first
        wanted = ["ar"] + [m for m in wanted if m != "ar"]
    if max_tokens < 1 or repeats < 1:
        raise ConfigError("--max-tokens and --repeats must be at least 1")
    config = build_config(profile, target=target, draft=draft, dtype=dtype, depth=depth, width=width, topk=topk, threads=threads,
                          draft_stop=draft_stop,
                          draft_quant=draft_quant, prefix_cache_mb=0)  # modes prefill the same prompts
    bench_prompts = load_prompts(prompts)
    if limit:
        bench_prompts = bench_prompts[:limit]
    apply_threads(config)
    console = Console(stderr=True)
    target_model = load_named(config.target, config, console, target=True)
    draft_model = None
    if any(m.removesuffix(PREDICTED) in ("chain", "tree", "hf-assisted") for m in wanted):
        from specctl.engine.loader import check_same_vocab

        draft_model = load_named(config.draft, config, console, config.draft_quant)
        check_same_vocab(target_model, draft_model)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        report = run_local_bench(config, target_model, draft_model, bench_prompts, wanted, max_tokens, progress, repeats)
    table_console().print(render_local_table(report))
    table_console().print(render_local_kinds(report))
    if json_out:
        with open(json_out, "w") as f:
            json.dump(report, f, indent=2)
        console.print(f"wrote {json_out}")


@app.command("star")
def star(
    draft: str = typer.Option("smollm2-135m@25", help="draft model for the draft server (NAME@N: first N layers)"),
    target: str = typer.Option("smollm2-135m", help="target model for every target instance"),
    targets: str = typer.Option("1,2,3,4,6,8", help="numbers of target instances to measure"),
    depth: int = typer.Option(4, help="chain depth d"),
    max_tokens: int = typer.Option(64, "--max-tokens", "-n", help="new tokens per session (each target runs one after another)"),
    sessions: int = typer.Option(4, "--sessions", help="sessions per target and N (the same prompts for all)"),
    verify_delay_ms: float = typer.Option(0.0, "--verify-delay-ms", help="add to every verification (emulation)"),
    dtype: str = typer.Option("fp32", help="fp32 | bf16 | fp16"),
    max_batch: str = typer.Option("1,4", "--max-batch",
                                  help="draft batching limits, one sweep each (1 = StarSD's one request at a time)"),
    draft_quant: str = typer.Option("int8", "--draft-quant", help="none | int8"),
    target_quant: str = typer.Option("none", "--target-quant",
                                     help="none | int8: int8 targets cost a quarter of the CPU (emulated runs share cores)"),
    repeats: int = typer.Option(1, help="sweeps over N with the same processes (the scaling figures' "
                                "min/median/max reported)"),
    json_out: Optional[str] = typer.Option(None, "--json", help="write the report as JSON to this file"),
) -> None:
    """One draft server, N target processes on loopback: StarSD's Table 1 next to the model's prediction,
    for each draft batching limit."""
    from transformers import AutoTokenizer

    from specctl.bench.prompts import load_prompts
    from specctl.bench.star import StarBenchSettings, run_star_bench
    from specctl.spec.factory import split_model_name
    from specctl.store import resolve_model

    counts, batches = int_list(targets, "--targets"), int_list(max_batch, "--max-batch")
    if not counts or counts[0] != 1 or counts[-1] > 32:
        raise ConfigError("--targets must start at 1 (the model is fitted to N=1's times) and stay <= 32")
    if not batches or batches[0] < 1:
        raise ConfigError("--max-batch values must be >= 1")
    for name, value in (("--draft-quant", draft_quant), ("--target-quant", target_quant)):
        if value not in QUANTS:
            raise ConfigError(f"{name} must be one of {', '.join(QUANTS)}, got {value!r}")
    if verify_delay_ms < 0 or depth < 1 or max_tokens < 1 or sessions < 1 or repeats < 1:
        raise ConfigError("--verify-delay-ms must be >= 0, --depth, --max-tokens, --sessions and --repeats >= 1")
    console = Console(stderr=True)
    path = resolve_model(split_model_name(target)[0], console)
    resolve_model(split_model_name(draft)[0], console)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok.encode(p.prompt) for p in load_prompts("builtin")]
    settings = StarBenchSettings(draft, target, counts, depth, max_tokens, verify_delay_ms, dtype, max_batches=batches, sessions=sessions,
                                 draft_quant=draft_quant, target_quant=target_quant, repeats=repeats)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(f"{len(batches)} interleaved sweeps, each 1 draft + {counts[-1]} target processes",
                                 total=len(counts) * len(batches) * repeats)
        def advance(added: int = 0) -> None:  # a sweep adds N_full when --targets lacks it
            if added:
                progress.update(task, total=progress.tasks[0].total + added)
            else:
                progress.advance(task)

        report = run_star_bench(settings, prompts, advance)
    out = table_console()
    out.print(render_star_table(report))
    out.print(render_star_summary(report["summary"]))
    if json_out:
        with open(json_out, "w") as f:
            json.dump(report, f, indent=2)
        console.print(f"wrote {json_out}")


@app.command("net")
def net(
    target: str = typer.Option("smollm2-135m", help="target model for the overhead comparison"),
    draft: str = typer.Option("smollm2-135m@25", help="draft model for the overhead comparison"),
    max_tokens: int = typer.Option(64, "--max-tokens", "-n", help="new tokens per prompt"),
    depth: int = typer.Option(4, help="chain depth d"),
    dtype: str = typer.Option("fp32", help="fp32 | bf16 | fp16"),
    limit: int = typer.Option(4, help="builtin prompts to use"),
    threads: int = typer.Option(1, help="torch threads of the one process and of each separate process "
                                        "(two pools of 2 threads contend on a 2-core machine)"),
    repeats: int = typer.Option(3, help="turns over the prompts, each prompt run in one process and in separate processes, "
                                         "alternating which goes first; the ratio is of the totals"),
    json_out: Optional[str] = typer.Option(None, "--json", help="write the report as JSON to this file"),
) -> None:
    """Protocol round trip of a 64-node proposal, and one process vs separate processes."""
    import asyncio

    from specctl.bench.net import overhead, round_trip_ms
    from specctl.bench.prompts import load_prompts
    from specctl.config import build_config
    from specctl.spec.factory import load_named

    import torch

    if threads < 1 or repeats < 1:
        raise ConfigError("--threads and --repeats must be >= 1")
    torch.set_num_threads(threads)  # the separate processes get the same count (overhead reads it)
    console = Console(stderr=True)
    rt = asyncio.run(round_trip_ms())
    config = build_config(None, target=target, draft=draft, dtype=dtype, prefix_cache_mb=0)
    target_model = load_named(target, config, console, target=True)
    draft_model = load_named(draft, config, console)
    prompts = [target_model.tokenizer.encode(p.prompt) for p in load_prompts("builtin")[:limit]]
    with console.status("one process and separate processes, prompt by prompt"):
        ov = overhead(target_model, draft_model, target, draft, prompts, max_tokens, depth, dtype, repeats)
    table = Table(title="bench net")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row(f"round trip, {rt['nodes']}-node proposal, p50", f"{rt['p50_ms']:.3f} ms")
    table.add_row(f"round trip, {rt['nodes']}-node proposal, p99", f"{rt['p99_ms']:.3f} ms")
    table.add_row("one process", f"{ov['one_process_tokens_per_s']:.2f} tok/s")
    table.add_row("separate processes (loopback)", f"{ov['separate_processes_tokens_per_s']:.2f} tok/s")
    table.add_row("ratio", f"{ov['ratio']:.3f}x")
    table.add_row("ratio in each turn", "  ".join(f"{r:.3f}x" for r in ov["ratio_per_turn"]))
    table.add_row("outputs identical", str(ov["outputs_identical"]))
    table.add_row("draft compute per round: one process", f"{ov['one_process_draft_ms_per_round']:.1f} ms")
    table.add_row("draft compute per round: draft server", f"{ov['draft_compute_ms_per_round']:.1f} ms")
    table.add_row("proposal wait beyond it per round", f"{ov['proposal_wait_beyond_draft_compute_ms_per_round']:.2f} ms")
    table_console().print(table)
    if json_out:
        with open(json_out, "w") as f:
            json.dump({"round_trip": rt, "overhead": ov}, f, indent=2)
        console.print(f"wrote {json_out}")


app.command("serve")(serve)
app.command("pipeline")(pipeline)
app.command("prespec")(prespec)
app.command("kernels")(kernels)
app.command("drafters")(drafters)


def says_when_interrupted(command: Callable) -> Callable:
    """A benchmark stopped by Ctrl-C or SIGTERM (``kill``; a shell's background job ignores
    Ctrl-C) says so and that it wrote no report (typer turns a KeyboardInterrupt into a silent
    exit 130, and SIGTERM's default kills at once, which reads like a crash or a hang). What it
    started is closed by then: its own ``finally`` blocks ran on the way out. Exit 130 for
    Ctrl-C, 143 for SIGTERM, as a shell reports them."""
    @functools.wraps(command)
    def noted(*args, **kwargs):
        terminated = []

        def interrupt(signum, frame):
            terminated.append(signum)
            raise KeyboardInterrupt

        # an event loop's own handlers (run_job_with_compute) take SIGTERM while it runs
        previous = signal.signal(signal.SIGTERM, interrupt) \
            if threading.current_thread() is threading.main_thread() else None
        try:
            return command(*args, **kwargs)
        except KeyboardInterrupt:
            print("interrupted: no report written (the models and processes it started are closed)", file=sys.stderr)
            if terminated:
                raise SystemExit(128 + signal.SIGTERM) from None
            raise
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
    return noted


for _info in app.registered_commands:
    _info.callback = says_when_interrupted(_info.callback)
