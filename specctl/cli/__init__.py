"""The ``specctl`` command: one typer sub-app or command per role."""

from __future__ import annotations

import inspect
import platform
import sys
from importlib import metadata

import typer

import specctl

from specctl.cli import bench, chat, draft, gateway, generate, models, monitor, plan, verify
from specctl.errors import SpecctlError

app = typer.Typer(
    name="specctl",
    help="Distributed speculative decoding: a small draft model proposes, a large target verifies, "
    "and the output is exactly the target's own.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def version_line() -> str:
    """specctl's version with the libraries a bug report needs (read without importing them)."""
    def installed(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"
    return (f"specctl {specctl.__version__} (Python {platform.python_version()}, torch {installed('torch')}, "
            f"transformers {installed('transformers')})")


def _print_version(asked: bool) -> None:
    if asked:
        print(version_line())
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", "-V", callback=_print_version, is_eager=True,
                                          help="print the version (with Python's, torch's and transformers') and "
                                               "exit")) -> None:
    pass


app.add_typer(models.app, name="models")
app.add_typer(bench.app, name="bench")
app.command("generate")(generate.generate)
app.command("draft")(draft.draft)
app.command("verify")(verify.verify)
app.command("plan")(plan.plan)
app.command("gateway")(gateway.gateway)
app.command("up")(gateway.up)
app.command("chat")(chat.chat)
app.command("monitor")(monitor.monitor)


def _one_line_summaries(*apps: typer.Typer) -> None:
    """Command lists show each command's first docstring paragraph; typer's rich mode keeps its
    line breaks there, so the wrapped source lines would break mid-sentence: join them."""
    for sub in apps:
        for info in sub.registered_commands:
            if info.short_help is None and info.callback is not None and info.callback.__doc__:
                info.short_help = " ".join(inspect.cleandoc(info.callback.__doc__).split("\n\n")[0].split())


_one_line_summaries(app, bench.app, models.app)


def main() -> None:
    """Entry point. Usage errors (unknown command or option, a value of the wrong type, a
    missing option) print typer's usage message and exit 2; errors a user causes otherwise
    print one ``error:`` line and exit 2; neither prints a traceback."""
    try:
        app()  # standalone: typer reports its own usage errors and exits
    except SpecctlError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
