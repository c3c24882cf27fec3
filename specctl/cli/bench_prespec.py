"""``specctl bench prespec``: plain remote speculation vs pre-speculation on the star."""

from __future__ import annotations

import json
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from specctl.config import QUANTS
from specctl.errors import ConfigError


DEFAULT_DELAY_MS = 60.0


def emulated_delay_ms(delay_ms: float | None, floor_ms: float) -> float:
    """The delay added to every verification: as given, else the default unless a floor
    (--verify-time-ms) is given — the two emulations are alternatives, and a user who asks for
    a 150 ms verification means 150 ms, not 60 ms more."""
    if delay_ms is not None:
        return delay_ms
    return 0.0 if floor_ms > 0 else DEFAULT_DELAY_MS


def prespec(
    draft: str = typer.Option("qwen2.5-coder-0.5b", help="draft model for both draft servers (NAME@N: first N layers)"),
    target: str = typer.Option("qwen2.5-coder-1.5b", help="target model for every target instance"),
    mode: str = typer.Option("chain", help="chain | tree: the proposals both draft servers make (a tree: the "
                             "profile's top-k and width)"),
    depth: int = typer.Option(4, help="proposal depth d"),
    budget: int = typer.Option(8, help="pre-speculation budget: branches per session and round"),
    fallback: str = typer.Option("jit", "--fallback", help="jit | ngram | auto: how the prespec server drafts a miss"),
    max_targets: int = typer.Option(4, "--max-targets", help="the most target processes per draft server: N = 1, 2, "
                                     "N_full and N_full + 1 are measured as far as it allows (1: N = 1 only)"),
    max_tokens: int = typer.Option(48, "--max-tokens", "-n", help="new tokens per session"),
    sessions: int = typer.Option(2, "--sessions", help="sessions per target, N and repeat (the same prompts for all)"),
    verify_delay_ms: Optional[float] = typer.Option(None, "--verify-delay-ms", help="added to every verification "
                                                    "(emulation): choose it so that Z is about S (default: 60, or 0 "
                                                    "with --verify-time-ms)"),
    verify_time_ms: float = typer.Option(0.0, "--verify-time-ms", help="every verification takes at least this long, "
                                         "its compute included (emulation of target devices: what the draft's "
                                         "background work costs this machine's shared cores stays inside it)"),
    draft_step_ms: float = typer.Option(0.0, "--draft-step-ms", help="every draft forward takes at least this long, "
                                        "its compute included (emulation of a draft device whose step time does not "
                                        "grow with its rows, as a GPU's: what SSD assumes of the draft)"),
    repeats: int = typer.Option(3, help="measurements of each N and mode (min/median/max reported)"),
    trials: bool = typer.Option(True, "--trials/--no-trials", help="the prespec server keeps pre-speculation only "
                                "while its trials find it faster (as by default); --no-trials: in every round"),
    dtype: str = typer.Option("fp32", help="fp32 | bf16 | fp16"),
    draft_quant: str = typer.Option("int8", "--draft-quant", help="none | int8"),
    target_quant: str = typer.Option("int8", "--target-quant", help="none | int8 (targets share this machine's cores)"),
    prompts: str = typer.Option("heldout", help="builtin, heldout or a JSON-lines file"),
    json_out: Optional[str] = typer.Option(None, "--json", help="write the report as JSON to this file"),
) -> None:
    """Two draft servers, one plain and one with --prespec, each with its own target processes on
    loopback: tokens/s at N = 1, 2, N_full and N_full + 1, hit rate, and SSD's predicted gain beside the measured.

    The targets run at nice 10: they stand for other machines, and on this box the draft's
    pre-speculation would otherwise take their cores (a cost a real star does not have)."""
    from transformers import AutoTokenizer

    from specctl.bench.prespec import PrespecBenchSettings, run_prespec_bench
    from specctl.bench.prompts import load_prompts
    from specctl.bench.render import render_prespec_table, table_console
    from specctl.bench.star import StarBenchSettings
    from specctl.draft.speculation import PrespecConfig
    from specctl.spec.factory import split_model_name
    from specctl.store import resolve_model

    verify_delay_ms = emulated_delay_ms(verify_delay_ms, verify_time_ms)
    for name, value in (("--draft-quant", draft_quant), ("--target-quant", target_quant)):
        if value not in QUANTS:
            raise ConfigError(f"{name} must be one of {', '.join(QUANTS)}, got {value!r}")
    if mode not in ("chain", "tree"):
        raise ConfigError(f"--mode must be chain or tree (what pre-speculation drafts), got {mode!r}")
    if (min(verify_delay_ms, verify_time_ms, draft_step_ms) < 0 or min(depth, max_tokens, sessions, repeats) < 1
            or not 1 <= max_targets <= 32):
        raise ConfigError("--verify-delay-ms, --verify-time-ms and --draft-step-ms must be >= 0, --depth, --max-tokens, "
                          "--sessions and --repeats >= 1, --max-targets in [1, 32]")
    try:
        PrespecConfig(budget=budget, fallback=fallback)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    console = Console(stderr=True)
    path = resolve_model(split_model_name(target)[0], console)
    resolve_model(split_model_name(draft)[0], console)
    tok = AutoTokenizer.from_pretrained(path)
    encoded = [tok.encode(p.prompt) for p in load_prompts(prompts)]
    star = StarBenchSettings(draft, target, tuple(range(1, max_targets + 1)), depth, max_tokens, verify_delay_ms, dtype,
                             mode=mode, max_batches=(8,), sessions=sessions, draft_quant=draft_quant, target_quant=target_quant,
                             nice_unemulated=True, verify_time_ms=verify_time_ms, draft_step_ms=draft_step_ms)
    settings = PrespecBenchSettings(star, budget, fallback, repeats, trials)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(f"plain vs prespec, 2 draft + {2 * max_targets} target processes",
                                 total=min(2, max_targets) * repeats)

        def advance(added: int = 0) -> None:  # N_full and N_full + 1 join once N=1 has been measured
            if added:
                progress.update(task, total=progress.tasks[0].total + added)
            else:
                progress.advance(task)

        report = run_prespec_bench(settings, encoded, advance)
    table_console().print(render_prespec_table(report))
    if json_out:
        with open(json_out, "w") as f:
            json.dump(report, f, indent=2)
        console.print(f"wrote {json_out}")
