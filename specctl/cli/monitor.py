"""``specctl monitor``: a live view of the star (rich Live over pure render functions)."""

from __future__ import annotations

import asyncio
import time
from typing import List, Optional

import typer
from rich.console import Console

from specctl.cli.roles import gateway_url


def monitor(
    gateway: Optional[str] = typer.Option(None, help="gateway URL whose /v1/stats feed to show (default http://127.0.0.1:8000)"),
    draft: List[str] = typer.Option([], "--draft", help="draft server HOST:PORT to probe directly (repeatable)"),
    target: List[str] = typer.Option([], "--target", help="target instance HOST:PORT to probe directly (repeatable)"),
    interval: float = typer.Option(0.5, help="seconds between polls"),
    once: bool = typer.Option(False, "--once", help="print one frame and exit (scripts, logs); exit 1 when nothing answered"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SPECCTL_API_KEY", help="the gateway's API key"),
    auth_token: Optional[str] = typer.Option(None, "--auth-token", envvar="SPECCTL_AUTH_TOKEN",
                                             help="auth token of the roles probed directly"),
    tls_ca: Optional[str] = typer.Option(None, "--tls-ca", help="CA file: talk TLS to the roles probed directly"),
) -> None:
    """Watch draft load, queueing, idle time and acceptance live; roles that go away show as down."""
    import aiohttp
    from rich.live import Live

    from specctl.errors import ConfigError
    from specctl.monitor.render import dashboard
    from specctl.monitor.source import gateway_feed, roles_feed
    from specctl.monitor.view import MonitorState, advance, poll_error
    from specctl.runtime.loop import run, wait_for_shutdown
    from specctl.runtime.tls import client_context

    if interval < 0.05:
        raise ConfigError("--interval must be at least 0.05 seconds")
    direct = bool(draft or target)
    if direct and gateway:
        raise ConfigError("give either --gateway or --draft/--target, not both")
    if tls_ca and not direct:
        raise ConfigError("--tls-ca is for the roles probed directly (--draft/--target); a gateway is reached by its URL")
    ssl = client_context(tls_ca)
    url = gateway_url(gateway) if gateway else "http://127.0.0.1:8000"
    source = ", ".join(draft + target) if direct else url
    console = Console()
    current = [MonitorState(source)]

    async def poll(session: aiohttp.ClientSession) -> None:
        try:
            feed = await (roles_feed(draft, target, auth_token, ssl) if direct else gateway_feed(session, url, api_key))
            current[0] = advance(current[0], feed, time.time())
        except Exception as exc:  # noqa: BLE001 - the gateway being away is something to show, not to die of
            current[0] = advance(current[0], None, time.time(), poll_error(url if not direct else source, exc))

    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            if once:
                await poll(session)
                console.print(dashboard(current[0]))
                if current[0].error:
                    raise typer.Exit(1)  # scripts must see that nothing answered
                return

            async def loop() -> None:
                while True:
                    await poll(session)
                    await asyncio.sleep(interval)

            with Live(get_renderable=lambda: dashboard(current[0]), console=console, refresh_per_second=4,
                      redirect_stderr=False):
                poller = asyncio.create_task(loop())
                try:
                    await wait_for_shutdown()
                finally:
                    poller.cancel()
                    await asyncio.gather(poller, return_exceptions=True)

    run(main())
