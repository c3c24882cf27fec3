"""``specctl verify``: a target instance, or one stage of a pipelined target."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from typing import Optional

import typer
from rich.console import Console

from specctl.cli.roles import (
    AUTH_HELP, PREFIX_CACHE_HELP, SPEC_DEPTH_HELP, SPEC_MAX_SESSIONS_HELP, checked,
)
from specctl.config import LOOKUP_DRAFTERS, build_config, repeated
from specctl.errors import ConfigError
from specctl.runtime.omp_wait import OMP_WAIT_HELP, apply_omp_wait
from specctl.spec.routing import RoutingPolicy  # pure: no torch at start-up


def parse_stage(text: str) -> tuple[int, int]:
    """``i/n`` with 1 <= i <= n: this process's stage of an n-stage pipeline."""
    index, sep, count = text.partition("/")
    if not sep or not index.strip().isdigit() or not count.strip().isdigit() or not 1 <= int(index) <= int(count):
        raise ConfigError(f"--stage must be i/n with 1 <= i <= n (e.g. 1/1 or 3/8), got {text!r}")
    return int(index), int(count)


def peer_hosts(drafts: list[str], stages: list[tuple[str, int]], index: int) -> list[str]:
    """The addresses of a target's (or stage's) peers: its draft servers and the other stages."""
    return ([address for address in drafts if address not in LOOKUP_DRAFTERS]
            + [host for number, (host, _) in enumerate(stages, 1) if number != index])


def verify(
    model: Optional[str] = typer.Option(None, help="target model (default: qwen2.5-coder-1.5b)"),
    draft: Optional[list[str]] = typer.Option(None, "--draft", help="draft server HOST:PORT (none: autoregressive "
                                              "only); stage 1 only. Repeat it, and add 'ngram' (the local n-gram "
                                              "lookup) or 'suffix' (local suffix decoding), for several drafters "
                                              "routed and fused per session (CoSine)"),
    draft_deadline_ms: float = typer.Option(500.0, "--draft-deadline-ms", help="several drafters: one that has not "
                                            "answered by then is skipped for the round"),
    draft_timeout: float = typer.Option(30.0, "--draft-timeout", help="seconds a draft server may take to answer "
                                        "before it counts as hung: its link is dropped, sessions decode "
                                        "autoregressively meanwhile (a first proposal waits longer, by its prompt)"),
    fusion_budget: int = typer.Option(16, "--fusion-budget", help="several drafters: most nodes of the fused tree"),
    plain_rounds: bool = typer.Option(True, "--plain-rounds/--no-plain-rounds", help="several drafters: a session "
                                      "routes to no drafter (plain decoding) while its plain rounds commit tokens "
                                      "faster than its speculative ones, as measured on it"),
    lead_by_rate: bool = typer.Option(True, "--lead-by-rate/--lead-by-score", help="several drafters: each round "
                                      "is led by the drafter whose rounds commit tokens fastest for the session, as "
                                      "measured on it (--lead-by-score: by the routing score alone, CoSine)"),
    pooled_rates: bool = typer.Option(True, "--pooled-rates/--own-rates", help="several drafters: a new session "
                                      "starts from the rates this target's sessions measured, so it does not try "
                                      "every drafter anew (--own-rates: each session measures every arm itself)"),
    port: Optional[int] = typer.Option(None, help="TCP port (default 9100; 0 = any free port); with --pipeline "
                                       "each stage listens on its own entry's port"),
    host: str = typer.Option("127.0.0.1", help="address to bind"),
    stage: str = typer.Option("1/1", help="pipeline stage i/n of this process: stage 1 serves clients and talks to "
                              "the draft server, stage n holds the LM head"),
    pipeline: Optional[str] = typer.Option(None, "--pipeline", help="HOST:PORT of every stage in order, comma-"
                                           "separated (the same on every box; the first is stage 1's client address)"),
    layers: Optional[str] = typer.Option(None, "--layers", help="this stage's layers [a, b), written a:b "
                                         "(default: a balanced split)"),
    specpipe_draft: Optional[str] = typer.Option(None, "--specpipe-draft", help="stage 1 of n > 1: decode with "
                                                 "SpecPipe (one tree level per pipeline step), drafting with this "
                                                 "model in this process (instead of --draft); a request's "
                                                 "prediction is grafted onto the tree as chains"),
    specpipe: bool = typer.Option(False, "--specpipe", help="stage 1 of n > 1: decode with SpecPipe, the tree "
                                  "levels drafted by the draft server at --draft (one; without it: plain PP); a "
                                  "request's prediction is grafted onto the tree as chains"),
    width: int = typer.Option(4, "--width", help="SpecPipe: nodes per tree level"),
    topk: int = typer.Option(2, "--topk", help="SpecPipe: children considered per node"),
    spread: str = typer.Option("likeliest", "--spread", help="SpecPipe: a level's nodes are the w likeliest paths "
                               "(likeliest), or every node's likeliest child first (every-node)"),
    refill: Optional[int] = typer.Option(None, "--refill", help="SpecPipe: after a miss, this many levels drafted "
                                         "under the verified token go with it, so their output decides several "
                                         "tokens at once (default: stages - 1; 0 = the token alone)"),
    max_sessions: Optional[int] = typer.Option(None, "--max-sessions", help="most concurrent sessions"),
    max_batch: Optional[int] = typer.Option(None, "--max-batch", help="most sessions verified in one target forward"),
    spec_max_sessions: Optional[int] = typer.Option(None, "--spec-max-sessions", help=SPEC_MAX_SESSIONS_HELP),
    spec_depth_by_load: Optional[str] = typer.Option(None, "--spec-depth-by-load", help=SPEC_DEPTH_HELP),
    prefix_cache_mb: Optional[int] = typer.Option(None, "--prefix-cache-mb", help=PREFIX_CACHE_HELP),
    prefill_chunk: Optional[int] = typer.Option(None, "--prefill-chunk", help="a prompt's prefill runs in jobs of "
                                                "this many tokens, so running sessions keep decoding between them; "
                                                "deeper in a long prompt a job holds fewer, costing about as much "
                                                "(default 512 on the CPU, 2048 on CUDA; 0 = the whole prompt at once)"),
    dtype: Optional[str] = typer.Option(None, help="fp32 | bf16 | fp16"),
    quant: Optional[str] = typer.Option(None, "--quant", help="none | int8 (CPU): serve the int8 model as the target"),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads"),
    omp_wait: str = typer.Option("auto", "--omp-wait", help=OMP_WAIT_HELP + " (peers: the draft servers and the "
                                 "other stages)"),
    profile: Optional[str] = typer.Option(None, help="hardware profile"),
    verify_delay_ms: float = typer.Option(0.0, "--verify-delay-ms", help="add a delay to every verification (emulation)"),
    verify_time_ms: float = typer.Option(0.0, "--verify-time-ms", help="every verification takes at least this long, "
                                         "its compute included (emulates a target device of that speed)"),
    stage_delay_ms: float = typer.Option(0.0, "--stage-delay-ms", help="stages 2..n: every forward takes at least "
                                         "this long, its compute included (emulates a slower device per stage)"),
    max_messages_per_s: float = typer.Option(5000.0, "--max-messages-per-s", help="per-peer rate limit (0 = off)"),
    auth_token: Optional[str] = typer.Option(None, "--auth-token", envvar="SPECCTL_AUTH_TOKEN", help=AUTH_HELP),
    tls_cert: Optional[str] = typer.Option(None, "--tls-cert", help="PEM certificate: serve clients (and the "
                                           "previous stage) over TLS"),
    tls_key: Optional[str] = typer.Option(None, "--tls-key", help="PEM private key for --tls-cert"),
    tls_ca: Optional[str] = typer.Option(None, "--tls-ca", help="CA file: talk TLS to the draft server and the "
                                         "next stage"),
    log_level: str = typer.Option("info", "--log-level", help="debug | info | warning"),
) -> None:
    """Run a target instance (or one stage of a pipelined one): verifies proposals from the
    draft server and serves generation requests.

    A target split over n boxes runs the same command on each, differing only in --stage:
    specctl verify --stage 2/3 --pipeline a:9100,b:9101,c:9102 --model M"""
    from specctl.pipeline.split import parse_pipeline
    from specctl.runtime.loop import parse_hostport, setup_logging
    from specctl.runtime.tls import client_context, server_context

    index, count = parse_stage(stage)
    if verify_delay_ms < 0 or verify_time_ms < 0 or stage_delay_ms < 0:
        raise ConfigError("--verify-delay-ms, --verify-time-ms and --stage-delay-ms must be >= 0")
    if pipeline and count == 1:
        raise ConfigError("--pipeline needs --stage i/n with n > 1")
    stages = parse_pipeline(pipeline, index, count)
    if draft and index > 1:
        raise ConfigError(f"--draft goes to stage 1 only (this is stage {index}/{count})")
    if draft and len(draft) > 1 and (draft_deadline_ms <= 0 or fusion_budget < 1):
        raise ConfigError("--draft-deadline-ms must be > 0 and --fusion-budget >= 1")
    if not draft_timeout > 0:
        raise ConfigError(f"--draft-timeout must be > 0 seconds, got {draft_timeout:g}")
    named = [name if name in LOOKUP_DRAFTERS else "%s:%d" % parse_hostport(name) for name in draft or []]
    if (twice := repeated(named)) is not None:
        raise ConfigError(f"--draft names {twice} twice: each drafter once")
    if specpipe_draft and (index != 1 or count == 1 or draft):
        raise ConfigError("--specpipe-draft goes to stage 1 of a pipeline (--stage 1/n, n > 1), without --draft")
    if specpipe and (index != 1 or count == 1 or specpipe_draft or len(draft or []) != 1
                     or draft[0] in LOOKUP_DRAFTERS):
        raise ConfigError("--specpipe goes to stage 1 of a pipeline (--stage 1/n, n > 1) with one --draft HOST:PORT "
                          "(or use --specpipe-draft M for a draft in this process)")
    # before build_config: libgomp reads it once, when torch loads it (the profile's detection does)
    omp_line = apply_omp_wait(omp_wait, peer_hosts(draft or [], stages, index), os.environ, "torch" in sys.modules)
    shape = _specpipe_shape(count, width, topk, spread, refill) if specpipe_draft or specpipe else None
    config = build_config(profile, target=model, max_sessions=max_sessions, max_batch=max_batch, dtype=dtype,
                          threads=threads, target_quant=quant, prefix_cache_mb=prefix_cache_mb,
                          prefill_chunk=prefill_chunk, spec_max_sessions=spec_max_sessions,
                          spec_depth_by_load=spec_depth_by_load)
    # torch loads only once the flags are known to be good: a mistake is reported at once
    from specctl.pipeline.launch import load_stage, stage_plan
    from specctl.spec.factory import apply_threads

    console = Console(stderr=True)
    plan = stage_plan(config, index, count, pipeline, layers, console)
    if pipeline:
        port = plan.listen[1] if plan.listen else parse_hostport(pipeline.split(",")[0].strip())[1]
    port = 9100 if port is None else port
    ssl_server, ssl_client = server_context(tls_cert, tls_key), client_context(tls_ca)
    setup_logging(log_level)
    if omp_line:
        logging.getLogger("specctl.verify").info(omp_line)
    apply_threads(config)
    if index > 1:
        _serve_stage(config, plan, console, host=host, port=port, auth_token=auth_token, ssl_server=ssl_server,
                     ssl_client=ssl_client, delay_s=stage_delay_ms / 1e3, max_messages_per_s=max_messages_per_s)
        return
    levels = None
    if specpipe_draft:
        from specctl.engine.loader import check_same_vocab
        from specctl.pipeline.serve import SpecPipeDraft
        from specctl.spec.factory import load_named

        stage_one = load_stage(config, plan, console)
        local_draft = load_named(specpipe_draft, config, console, config.draft_quant)
        check_same_vocab(stage_one, local_draft)
        levels = SpecPipeDraft.local(local_draft.decoder, shape, specpipe_draft)
    else:
        stage_one = load_stage(config, plan, console)
    _serve_target(config, plan, console, stage_one, host=host, port=port, draft=list(draft or []),
                  fusion_settings=(draft_deadline_ms / 1e3, fusion_budget,
                                   RoutingPolicy(plain_arm=plain_rounds, by_rate=lead_by_rate,
                                                 pooled=pooled_rates)),
                  auth_token=auth_token, ssl_server=ssl_server, ssl_client=ssl_client,
                  verify_delay_s=verify_delay_ms / 1e3, verify_floor_s=verify_time_ms / 1e3,
                  max_messages_per_s=max_messages_per_s, specpipe=levels,
                  remote_specpipe=shape if specpipe else None, draft_timeout_s=draft_timeout)


def _specpipe_shape(stages: int, width: int, topk: int, spread: str, refill: int | None = None):
    """SpecPipe's TreeShape from the flags, refused with the reason before anything loads."""
    from specctl.pipeline.token_source import MAX_TREE_NODES, TreeShape, max_tree_nodes

    if not (1 <= width <= 16 and 1 <= topk <= 16):
        raise ConfigError("--width and --topk must be in 1..16")
    try:
        shape = TreeShape(width, topk, spread, refill)
    except ValueError as exc:  # the shape checks itself (the spread's name, the refill depth)
        raise ConfigError(str(exc)) from None
    nodes = max_tree_nodes(stages, shape)
    if nodes > MAX_TREE_NODES:
        raise ConfigError(f"SpecPipe over {stages} stages at --width {width} keeps up to {nodes} tree nodes per "
                          f"session; the most is {MAX_TREE_NODES}: lower --width or --refill")
    return shape


def _serve_stage(config, plan, console: Console, *, host: str, port: int, auth_token, ssl_server, ssl_client,
                 delay_s: float, max_messages_per_s: float) -> None:
    from specctl.pipeline.launch import load_stage
    from specctl.pipeline.stage import StageServer, StageServerConfig
    from specctl.runtime.compute import ComputeThread
    from specctl.runtime.loop import run_with_compute, serve

    stage_config = checked(StageServerConfig, host=host, port=port, max_sessions=config.max_sessions,
                           kv_budget_bytes=config.kv_budget_bytes, auth_token=auth_token, index=plan.index,
                           count=plan.count, next_address=plan.next, delay_s=delay_s,
                           max_messages_per_s=max_messages_per_s)
    loaded = load_stage(config, plan, console)
    first, last = plan.layers
    then = f"next {plan.next[0]}:{plan.next[1]}" if plan.next else "LM head here"

    async def main(compute: ComputeThread) -> None:
        await serve(StageServer(loaded, stage_config, ssl_server, ssl_client, compute=compute.lane()),
                    lambda bound: console.print(
                        f"pipeline stage {plan.index}/{plan.count} of [bold]{config.target}[/] (layers {first}:{last}) "
                        f"listening on {host}:{bound}{' (TLS)' if ssl_server else ''}{' (auth)' if auth_token else ''}, "
                        f"{then}", soft_wrap=True))

    run_with_compute(main, ComputeThread(f"stage{plan.index}-compute", spawn=False))


def _serve_target(config, plan, console: Console, loaded, *, host: str, port: int, draft: list[str], auth_token,
                  ssl_server, ssl_client, verify_delay_s: float, max_messages_per_s: float, specpipe=None,
                  verify_floor_s: float = 0.0,
                  remote_specpipe=None,  # a TreeShape: SpecPipe with the levels from the draft server
                  draft_timeout_s: float = 30.0,
                  fusion_settings: tuple[float, int, RoutingPolicy | None] = (0.5, 16, None)) -> None:
    from specctl.pipeline.launch import pipelined_target
    from specctl.runtime.compute import ComputeThread
    from specctl.runtime.loop import parse_hostport, run_with_compute, serve
    from specctl.verify.draft_client import DraftClient
    from specctl.verify.server import TargetServer, TargetServerConfig

    several = len(draft) > 1 or draft[:1] in ([name] for name in LOOKUP_DRAFTERS)  # a lone local one: Fusion too
    addresses = {name: parse_hostport(name) for name in draft if name not in LOOKUP_DRAFTERS}
    server_config = checked(TargetServerConfig, host=host, port=port, max_sessions=config.max_sessions,
                            kv_budget_bytes=config.kv_budget_bytes, auth_token=auth_token,
                            verify_delay_s=verify_delay_s, verify_floor_s=verify_floor_s, max_batch=config.max_batch,
                            max_messages_per_s=max_messages_per_s, **config.load_plan)
    chain = None
    if plan.next is not None:
        loaded, chain = pipelined_target(loaded, plan.next, stages=plan.count, auth_token=auth_token, ssl=ssl_client)

    async def main(compute: ComputeThread) -> None:
        nonlocal specpipe
        client = None
        links = []
        if chain is not None:
            first = asyncio.get_running_loop().create_future()
            links.append(asyncio.create_task(chain.run(first)))
            if not await first:
                console.print(f"[yellow]pipeline not whole yet ({chain.last_error}); retrying in the background[/]",
                              soft_wrap=True)
        clients = {}
        for name, address in addresses.items():
            clients[name] = DraftClient(*address, model=loaded.name, fingerprint=loaded.vocab_fingerprint,
                                        auth_token=auth_token, ssl=ssl_client, timeout_s=draft_timeout_s)
            first = asyncio.get_running_loop().create_future()
            links.append(asyncio.create_task(clients[name].run(first)))
            if not await first:  # a refusal (vocabulary, auth) raises here and stops start-up
                console.print(f"[yellow]draft server {name} unreachable ({clients[name].last_error}); decoding "
                              "without it and reconnecting in the background[/]")
        fusion = None
        if several:
            from specctl.spec.factory import suffix_drafter
            from specctl.verify.fused import Fusion

            deadline_s, budget, policy = fusion_settings
            fusion = Fusion(clients, ngram_depth=config.depth if "ngram" in draft else 0, budget=budget,
                            suffix=suffix_drafter(config) if "suffix" in draft else None,
                            deadline_s=deadline_s, policy=policy or RoutingPolicy())
        else:
            client = next(iter(clients.values()), None)
        if remote_specpipe is not None:  # the levels come from the one draft server
            from specctl.pipeline.serve import SpecPipeDraft
            specpipe = SpecPipeDraft.remote(client, asyncio.get_running_loop(), remote_specpipe, draft[0])
        stages = f" stage 1/{plan.count} (layers {plan.layers[0]}:{plan.layers[1]})" if chain else ""
        if specpipe is not None:
            stages += f", SpecPipe w={specpipe.shape.width} drafting with {specpipe.name}"
        try:
            await serve(TargetServer(loaded, server_config, client, ssl_server, compute=compute.lane(max_batch=config.max_batch),
                                     pipeline=chain, specpipe=specpipe, fusion=fusion),
                        lambda bound: console.print(
                            f"target instance [bold]{config.target}[/]{stages} listening on {host}:{bound}"
                            f"{' (TLS)' if ssl_server else ''}{' (auth)' if auth_token else ''}, "
                            f"draft {', '.join(draft) or 'none'}"
                            f"{' (routed and fused)' if several else ''}", soft_wrap=True))
        finally:
            for link in links:
                link.cancel()

    run_with_compute(main, ComputeThread("target-compute", max_batch=config.max_batch, spawn=False))
