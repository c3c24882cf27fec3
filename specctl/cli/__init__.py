"""The ``specctl`` command: one typer sub-app or command per role."""

from __future__ import annotations

import inspect
import sys

import typer

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
