"""``specctl bench serve``: concurrent streaming clients through a gateway — the target alone
vs speculation, one session a forward vs batched verification, all in one run on the same
loaded models; or, with ``--gateway URL``, a gateway that is already running."""

from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from specctl.bench.render import render_serve_table, table_console
from specctl.cli.roles import gateway_url
from specctl.config import build_config
from specctl.errors import ConfigError


def serve(
    target: Optional[str] = typer.Option(None, help="target model (default: the profile's, qwen2.5-coder-1.5b)"),
    draft: Optional[str] = typer.Option(None, help="draft model (default: qwen2.5-coder-0.5b)"),
    mode: Optional[str] = typer.Option(None, help="chain | tree"),
    depth: Optional[int] = typer.Option(None, help="proposal depth d"),
    dtype: Optional[str] = typer.Option(None, help="fp32 | bf16 | fp16"),
    draft_quant: Optional[str] = typer.Option(None, "--draft-quant", help="none | int8"),
    concurrency: str = typer.Option("1,4", help="numbers of concurrent clients to measure"),
    prompts: str = typer.Option("builtin", "--prompts", help="builtin (8 prompts), heldout (20 never tuned on), mixed "
                                "(16: code, prose, edits, summaries) or a JSON-lines file; client i sends prompts iR, "
                                "iR + 1, ... (R: --requests-per-client)"),
    requests: int = typer.Option(2, "--requests-per-client", help="requests each client sends, one after another"),
    max_tokens: int = typer.Option(64, "--max-tokens", "-n", help="new tokens per request (ignore_eos)"),
    max_batch: int = typer.Option(8, "--max-batch", help="most sessions verified together in the batched variants"),
    variants: str = typer.Option("ar,ar batched,spec,spec batched", help="comma-separated variants to run (also "
                                 "'spec by load': batched, plain rounds past --spec-max-sessions sessions and "
                                 "shorter proposals by --spec-depth-by-load; 'spec auto': batched, each load's "
                                 "depth or plain rounds learnt by the target from its own rounds)"),
    spec_max_sessions: Optional[int] = typer.Option(None, "--spec-max-sessions", help="the 'spec by load' variant "
                                                    "speculates while a target runs at most this many sessions "
                                                    "(default: the profile's)"),
    spec_depth_by_load: Optional[str] = typer.Option(None, "--spec-depth-by-load", help="the 'spec by load' "
                                                     "variant's SESSIONS:DEPTH,... (default: the profile's)"),
    repeats: int = typer.Option(1, "--repeats", help="go over the variants (or, with --gateway, the levels) this "
                                "many times, the variants' order rotating; ratios then show their min-max over "
                                "the repeats"),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads"),
    profile: Optional[str] = typer.Option(None, help="hardware profile"),
    json_out: Optional[str] = typer.Option(None, "--json", help="write the report as JSON to this file"),
    gateway: Optional[str] = typer.Option(None, "--gateway", help="measure a gateway that is already running "
                                          "(URL, as vLLM's bench serve --base-url) instead of the variants here"),
) -> None:
    """Concurrent streaming clients through the gateway: target alone vs speculation, one session
    per forward vs batched verification, all in the same run (or, with --gateway, a running one)."""
    from specctl.bench.prompts import load_prompts
    from specctl.bench.serve import BY_LOAD, VARIANTS, ServeBenchSettings, run_serve_bench
    from specctl.cli.bench import int_list
    from specctl.runtime.compute import ComputeThread
    from specctl.runtime.loop import run_job_with_compute
    from specctl.spec.factory import apply_threads, load_pair

    levels = int_list(concurrency, "--concurrency")
    chosen = tuple(v.strip() for v in variants.split(",") if v.strip())
    if not levels or levels[0] < 1 or levels[-1] > 64:
        raise ConfigError("--concurrency must be between 1 and 64")
    if not chosen or any(v not in VARIANTS for v in chosen):
        raise ConfigError(f"--variants: choose from {', '.join(VARIANTS)}")
    if requests < 1 or max_tokens < 1 or max_batch < 1 or repeats < 1:
        raise ConfigError("--requests-per-client, --max-tokens, --max-batch and --repeats must be at least 1")
    bench_prompts = load_prompts(prompts)  # a bad file is a one-line error before anything loads
    if gateway is not None:
        return _serve_gateway(gateway_url(gateway), levels, max_tokens, requests, max_batch, repeats, json_out,
                              bench_prompts, prompts)
    config = build_config(profile, target=target, draft=draft, mode=mode, depth=depth, dtype=dtype,
                          draft_quant=draft_quant, threads=threads, max_sessions=max(64, levels[-1]),
                          prefix_cache_mb=0, spec_max_sessions=spec_max_sessions,
                          spec_depth_by_load=spec_depth_by_load)
    if config.mode not in ("chain", "tree"):
        raise ConfigError("--mode must be chain or tree")
    if BY_LOAD in chosen and not config.spec_max_sessions and not config.depth_schedule and not config.depth_auto:
        raise ConfigError(f"the '{BY_LOAD}' variant needs --spec-max-sessions N (N >= 1) or --spec-depth-by-load "
                          f"SESSIONS:DEPTH (the profile gives neither)")
    apply_threads(config)
    console = Console(stderr=True)
    models = load_pair(config, console)
    settings = ServeBenchSettings(levels, max_tokens, requests, max_batch, chosen, repeats, config.spec_max_sessions,
                                  config.spec_depth_by_load)
    with _progress(console, "variants x concurrency levels x repeats", len(chosen) * len(levels) * repeats) as advance:
        holder: dict = {}

        async def main(compute: ComputeThread) -> None:  # compute served from the main thread, as in `up`
            holder["report"] = await run_serve_bench(config, models, bench_prompts, settings, advance,
                                                     compute)

        run_job_with_compute(main, ComputeThread("cpu-compute", max_batch=max_batch, spawn=False))
        report = holder["report"]
    report["settings"].update(target=config.target, draft=config.draft, mode=config.mode, depth=config.depth,
                              dtype=config.dtype, draft_quant=config.draft_quant, prompts=prompts)
    _show(report, f"bench serve: {config.target} / {config.draft} ({config.mode} d={config.depth}, {config.dtype}), "
                  f"{requests} x {max_tokens} tokens per client{_of(prompts)}{_times(repeats)}", json_out, console)


def _times(repeats: int) -> str:
    return f", {repeats} repeats" if repeats > 1 else ""


def _of(prompts: str) -> str:
    return "" if prompts == "builtin" else f", {prompts} prompts"


def _serve_gateway(url: str, levels: tuple[int, ...], max_tokens: int, requests: int, max_batch: int, repeats: int,
                   json_out: str | None, bench_prompts: list, prompts: str) -> None:
    import asyncio

    import aiohttp

    from specctl.bench.serve import ServeBenchSettings, run_gateway_bench
    from specctl.errors import unreachable_reason

    console = Console(stderr=True)
    settings = ServeBenchSettings(levels, max_tokens, requests, max_batch, ("gateway",), repeats)
    with _progress(console, "concurrency levels x repeats", len(levels) * repeats) as advance:
        try:
            report = asyncio.run(run_gateway_bench(url, bench_prompts, settings, advance))
        except (aiohttp.ClientError, OSError, RuntimeError) as exc:
            reason = unreachable_reason(exc)
            raise ConfigError(f"cannot reach the gateway at {url} ({reason}): start one or check --gateway" if reason
                              else f"the gateway at {url} failed: {exc}") from None
    report["settings"]["prompts"] = prompts
    _show(report, f"bench serve: the gateway at {url}, {requests} x {max_tokens} tokens per client{_of(prompts)}"
                  f"{_times(repeats)}", json_out, console)


@contextmanager
def _progress(console: Console, what: str, total: int) -> Iterator[Callable[[], None]]:
    """A progress bar over ``total`` steps; yields what advances it by one."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(what, total=total)
        yield lambda: progress.advance(task)


def _show(report: dict, title: str, json_out: str | None, console: Console) -> None:
    table_console().print(render_serve_table(report, title))
    if json_out:
        with open(json_out, "w") as f:
            json.dump(report, f, indent=2)
        console.print(f"wrote {json_out}")


