"""The ``specctl`` command: one typer sub-app or command per role."""

from __future__ import annotations

import sys

import typer

from specctl.cli import bench, chat, gateway, generate, models, monitor, plan, roles
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
app.command("draft")(roles.draft)
app.command("verify")(roles.verify)
app.command("plan")(plan.plan)
app.command("gateway")(gateway.gateway)
app.command("up")(gateway.up)
app.command("chat")(chat.chat)
app.command("monitor")(monitor.monitor)


def main() -> None:
    """Entry point: user errors become one line on stderr and exit code 2, no traceback."""
    try:
        app(standalone_mode=False)
    except SpecctlError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        print("aborted", file=sys.stderr)
        sys.exit(1)
    except Exception as exc:  # click usage errors and the like
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        raise
