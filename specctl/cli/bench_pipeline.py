"""``specctl bench pipeline``: plain pipeline parallelism vs pipeline + chain speculation vs
SpecPipe, over 1..n stages with an emulated per-stage time."""

from __future__ import annotations

import asyncio
import json
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from specctl.config import build_config
from specctl.errors import ConfigError


def pipeline(
    target: str = typer.Option("smollm2-135m", help="target model, split over the stages"),
    draft: str = typer.Option("smollm2-135m@12", help="draft model (NAME@N: the target's first N layers)"),
    stages: str = typer.Option("1,2,4", help="stage counts to measure"),
    stage_delay_ms: float = typer.Option(50.0, "--stage-delay-ms", help="emulated device time of one stage's "
                                         "step, its real compute running inside it (a device per stage; this "
                                         "machine's cores are shared)"),
    max_tokens: int = typer.Option(48, "--max-tokens", "-n", help="new tokens per prompt"),
    prompts: str = typer.Option("heldout", help="builtin, heldout, edits, ... or a JSON-lines file; prompts with "
                                "a prediction (edits, long-edits) add PP + chain + prediction rows"),
    limit: int = typer.Option(4, help="use only the first N prompts (0 = all)"),
    depth: int = typer.Option(4, help="PP+chain proposal depth"),
    width: int = typer.Option(4, help="SpecPipe level width w"),
    topk: int = typer.Option(2, help="SpecPipe children considered per node"),
    spread: str = typer.Option("likeliest", help="SpecPipe: a level's nodes are the w likeliest paths (likeliest), "
                               "or every node's likeliest child first (every-node)"),
    refill: Optional[int] = typer.Option(None, "--refill", help="SpecPipe: levels sent with the token after a miss "
                                         "(default: stages - 1; 0 = the token alone). Where it is not 0, SpecPipe "
                                         "without it runs too (the 'specpipe r=0' row)"),
    repeats: int = typer.Option(1, help="turns over all prompts (min/median/max reported)"),
    sessions: int = typer.Option(8, help="batch rows: this many sessions at once through the stages (0 = none)"),
    dtype: str = typer.Option("fp32", help="fp32 | bf16 | fp16"),
    in_process: bool = typer.Option(False, "--in-process", help="run stages 2..n as threads of this process "
                                    "(default: a process per stage, as a box per stage would)"),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads"),
    json_out: Optional[str] = typer.Option(None, "--json", help="write the report as JSON to this file"),
) -> None:
    """Time between tokens of plain PP, PP + chain speculation and SpecPipe at each stage
    count, outputs checked against the target alone, SpecPipe's E(T) prediction beside it."""
    from specctl.bench.pipeline import PipelineBench, pipeline_modes, run_pipeline_bench
    from specctl.bench.local import prompt_ids
    from specctl.bench.prompts import load_prompts
    from specctl.bench.render import render_pipeline_table, table_console
    from specctl.cli.bench import int_list
    from specctl.engine.loader import check_same_vocab
    from specctl.pipeline.token_source import TreeShape
    from specctl.spec.factory import apply_threads, load_named

    counts = int_list(stages, "--stages")
    if not counts or counts[0] < 1:
        raise ConfigError("--stages must be positive integers, e.g. 1,2,4")
    if stage_delay_ms < 0 or max_tokens < 2 or repeats < 1 or depth < 1:
        raise ConfigError("--stage-delay-ms must be >= 0, --max-tokens >= 2, --repeats and --depth >= 1")
    try:
        shape = TreeShape(width, topk, spread, refill)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    config = build_config(None, target=target, draft=draft, dtype=dtype, threads=threads, draft_quant="none",
                          target_quant="none", prefix_cache_mb=0)
    apply_threads(config)
    console = Console(stderr=True)
    target_model = load_named(config.target, config, console, target=True)
    draft_model = load_named(config.draft, config, console)
    check_same_vocab(target_model, draft_model)
    if counts[-1] > target_model.spec.num_layers:
        raise ConfigError(f"{target} has {target_model.spec.num_layers} layers: at most that many stages")
    chosen = load_prompts(prompts)[: limit or None]
    encoded, _ = prompt_ids(target_model, chosen)  # chat prompts in the target's chat template
    predictions = [tuple(target_model.tokenizer.encode(p.prediction, add_special_tokens=False)) if p.prediction
                   else () for p in chosen]
    if sessions < 0:
        raise ConfigError("--sessions must be >= 0")
    bench = PipelineBench(counts, max_tokens, stage_delay_ms / 1e3, depth, shape, repeats, sessions,
                          model=None if in_process else target, dtype=dtype)
    total = sum(len(pipeline_modes(n, shape, any(predictions))) for n in counts) * len(encoded) * repeats
    total += sum(2 for n in counts if n > 1) if sessions else 0
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("bench pipeline", total=total)
        report = asyncio.run(run_pipeline_bench(target_model, draft_model, encoded, bench,
                                                lambda what: progress.update(task, advance=1, description=what),
                                                predictions))
    report["settings"].update(target=target, draft=draft, dtype=dtype)
    table_console().print(render_pipeline_table(report))
    if json_out:
        with open(json_out, "w") as f:
            json.dump(report, f, indent=2)
        console.print(f"wrote {json_out}")
