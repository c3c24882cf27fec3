"""``specctl bench drafters``: single drafters vs routing vs routing + fusion (CoSine)."""

from __future__ import annotations

import json
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from specctl.errors import ConfigError


def drafters(
    target: Optional[str] = typer.Option(None, help="target model (default: the profile's, qwen2.5-coder-1.5b)"),
    drafters: str = typer.Option("qwen2.5-coder-0.5b,ngram", "--drafters",
                                 help="comma-separated drafters: model names, NAME@N (first N layers), ngram"),
    prompts: str = typer.Option("mixed", help="mixed (code, prose, edits, summaries), builtin, heldout or a JSON-lines file"),
    max_tokens: int = typer.Option(64, "--max-tokens", "-n", help="new tokens per prompt"),
    depth: Optional[int] = typer.Option(None, help="chain depth d of every drafter"),
    dtype: Optional[str] = typer.Option(None, help="fp32 | bf16 | fp16"),
    draft_quant: Optional[str] = typer.Option(None, "--draft-quant", help="none | int8: quantize the model drafters"),
    limit: int = typer.Option(0, help="use only the first N prompts (0 = all)"),
    repeats: int = typer.Option(1, help="turns over all prompts (min/median/max reported)"),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads"),
    profile: Optional[str] = typer.Option(None, help="hardware profile"),
    json_out: Optional[str] = typer.Option(None, "--json", help="write the report as JSON to this file"),
) -> None:
    """Each drafter alone, routing among them, routing + fusion: tokens/s against the target alone
    and against the best single drafter, overall and per class of prompt; outputs checked
    against the target alone."""
    from specctl.bench.drafters import run_drafters_bench
    from specctl.bench.prompts import load_prompts
    from specctl.bench.render import render_drafters_summary, render_local_kinds, render_local_table, table_console
    from specctl.config import build_config
    from specctl.spec.factory import apply_threads, load_drafters, load_named

    if max_tokens < 1 or repeats < 1:
        raise ConfigError("--max-tokens and --repeats must be at least 1")
    config = build_config(profile, target=target, mode="multi", drafters=drafters, depth=depth, dtype=dtype,
                          draft_quant=draft_quant, threads=threads, draft_stop=0.0,
                          prefix_cache_mb=0)
    if len(config.drafter_names) < 2:
        raise ConfigError("--drafters needs at least two drafters to route among")
    bench_prompts = load_prompts(prompts)[: limit or None]
    apply_threads(config)
    console = Console(stderr=True)
    target_model = load_named(config.target, config, console, target=True)
    loaded = load_drafters(config, target_model, console)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        report = run_drafters_bench(config, target_model, loaded, bench_prompts, max_tokens, progress, repeats)
    table_console().print(render_local_table(report))
    table_console().print(render_local_kinds(report))
    table_console().print(render_drafters_summary(report))
    if json_out:
        with open(json_out, "w") as f:
            json.dump(report, f, indent=2)
        console.print(f"wrote {json_out}")
