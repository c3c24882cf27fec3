"""``specctl models list | pull NAME | path NAME``."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from specctl.errors import ModelPackageMissing
from specctl.store import PACKAGED_MODELS, model_home, pull
from specctl.store.store import is_converted, part_paths

app = typer.Typer(help="The packaged models: list them, assemble and convert one, print its path.", no_args_is_help=True)


@app.command("list")
def list_models() -> None:
    """List the packaged models, whether their packages are installed and converted."""
    table = Table(title=f"packaged models (store: {model_home()})")
    for column in ("name", "role", "installed", "converted", "description"):
        table.add_column(column)
    for model in PACKAGED_MODELS.values():
        try:
            part_paths(model)
            installed = "yes"
        except ModelPackageMissing:
            installed = "no"
        converted = "yes" if is_converted(model_home() / model.name) else "no"
        table.add_row(model.name, model.role, installed, converted, model.description)
    Console().print(table)


@app.command("pull")
def pull_model(name: str = typer.Argument(..., help="packaged model name, see `specctl models list`")) -> None:
    """Assemble the model's chunks, verify the sha256 and convert it to safetensors (once)."""
    print(pull(name, Console(stderr=True)))


@app.command("path")
def model_path(name: str = typer.Argument(..., help="packaged model name")) -> None:
    """Print the converted model's directory (pulling it first if needed)."""
    print(pull(name, Console(stderr=True)))
