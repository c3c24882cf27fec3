"""``specctl chat``: talk to a gateway, or to an embedded cluster started on the spot."""

from __future__ import annotations

import signal
from typing import Optional

import typer
from rich.console import Console


def chat(
    gateway: Optional[str] = typer.Option(None, help="gateway URL (default: start an embedded cluster here)"),
    temperature: Optional[float] = typer.Option(None, help="0 (default) = greedy: exactly the target's own output; "
                                                "/temp changes it"),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", "-n", help="most tokens per reply (default 256); "
                                             "/max changes it"),
    system: Optional[str] = typer.Option(None, "--system", help="system prompt sent before the conversation; /system "
                                         "changes it"),
    reasoning_effort: Optional[str] = typer.Option(None, "--reasoning-effort", help="none | minimal | low | medium | "
                                                   "high | xhigh, sent as OpenAI's reasoning_effort (default: not "
                                                   "sent, the model's own); /effort changes it"),
    load: Optional[str] = typer.Option(None, "--load", help="go on with a conversation /save wrote (its system prompt "
                                       "and settings too, unless the flags above give them)"),
    draft: Optional[str] = typer.Option(None, help="embedded cluster: draft model"),
    target: Optional[str] = typer.Option(None, help="embedded cluster: target model"),
    mode: Optional[str] = typer.Option(None, help="embedded cluster: chain | tree"),
    dtype: Optional[str] = typer.Option(None, help="embedded cluster: fp32 | bf16"),
    draft_quant: Optional[str] = typer.Option(None, "--draft-quant", help="embedded cluster: none | int8"),
    threads: Optional[int] = typer.Option(None, help="embedded cluster: torch CPU threads"),
    profile: Optional[str] = typer.Option(None, help="embedded cluster: hardware profile"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SPECCTL_API_KEY", help="the gateway's API key"),
    reasoning_parser: Optional[str] = typer.Option(None, "--reasoning-parser", help="embedded cluster: qwen3 | "
                                                   "deepseek_r1 | openai_gptoss, the model's thinking shown dimmed "
                                                   "apart from its answer"),
) -> None:
    """Chat interactively; replies stream as the target accepts tokens."""
    from specctl.chat import transcript
    from specctl.chat.commands import ChatState
    from specctl.chat.repl import Replies, repl
    from specctl.errors import ConfigError
    from specctl.spec.params import SamplingParams

    from specctl.gateway.reasoning import check_parser
    from specctl.gateway.translate import REASONING_EFFORTS

    try:
        check_parser(reasoning_parser)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if reasoning_effort is not None and reasoning_effort not in REASONING_EFFORTS:
        raise ConfigError(f"--reasoning-effort must be one of {', '.join(REASONING_EFFORTS)}, not {reasoning_effort!r}")
    state = ChatState()
    if load:  # before any model loads: a bad file is a one-line error
        try:
            saved = transcript.load(load)
        except (OSError, transcript.TranscriptError) as exc:
            raise ConfigError(f"cannot load {load}: {getattr(exc, 'strerror', None) or exc}") from None
        state = ChatState(**saved)
    state.temperature = state.temperature if temperature is None else temperature
    state.max_tokens = state.max_tokens if max_tokens is None else max_tokens
    state.system = state.system if system is None else system
    state.reasoning_effort = state.reasoning_effort if reasoning_effort is None else reasoning_effort
    try:
        SamplingParams(temperature=state.temperature, max_tokens=state.max_tokens)
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(str(exc)) from None
    console = Console()
    if load:
        console.print(f"[dim]{len(state.messages)} messages loaded from {load}[/]")
    if gateway:
        from specctl.chat.repl import greeting
        from specctl.cli.roles import gateway_url

        gateway = gateway_url(gateway)
        console.print(greeting(gateway, api_key))
        repl(gateway, console, state, api_key)
        return
    import logging

    from specctl.cli.gateway import cluster_config
    from specctl.cluster.embedded import ClusterConfig, ClusterThread
    from specctl.runtime.compute import ComputeThread
    from specctl.runtime.loop import compute_in_main_thread
    from specctl.spec.factory import apply_threads

    config = cluster_config(profile, draft, target, mode, dtype, draft_quant, threads)
    apply_threads(config)
    logging.basicConfig(level=logging.WARNING)
    console.print(f"[bold]no --gateway given: starting an embedded cluster[/] (draft {config.draft}, target "
                  f"{config.target}, {config.mode} d={config.depth}, {config.dtype}) on loopback…", soft_wrap=True)
    # Torch runs fastest from the main thread: it serves compute, the REPL and the cluster's
    # asyncio loop run beside it, and Ctrl-C is forwarded to the reply being streamed.
    compute = ComputeThread("cpu-compute", max_batch=config.max_batch, spawn=False)
    cluster = ClusterThread(config, ClusterConfig(targets=1, gateway_port=0, default_max_tokens=state.max_tokens,
                                                  reasoning_parser=reasoning_parser),
                            Console(stderr=True), compute=compute)
    replies = Replies()

    def on_sigint() -> None:
        if not replies.interrupt():
            console.print("\n[dim](Ctrl-D or /quit to leave)[/]")

    def front() -> None:
        try:
            urls = cluster.start()
            console.print(f"[dim]embedded cluster ready: gateway {urls['gateway']}/v1, draft {urls['draft']}, "
                          f"target {urls['targets'][0]}[/]", soft_wrap=True)
            repl(urls["gateway"], console, state, replies=replies)
        finally:
            cluster.stop()

    compute_in_main_thread(front, compute, on_signal=on_sigint, signals=(signal.SIGINT,))
