"""``specctl bench ...``: benchmarks that print tables and write JSON."""

from __future__ import annotations

import typer

app = typer.Typer(help="Benchmarks: ratios against baselines measured in the same run.", no_args_is_help=True)


@app.command("local")
def local(
    target: str = typer.Option(None, help="target model"),
) -> None:
    """Every mode on the same prompts in one process."""
    raise NotImplementedError
