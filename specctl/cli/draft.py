"""``specctl draft``: the shared draft server of the star, optionally pre-speculating."""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional

import typer
from rich.console import Console

from specctl.cli.roles import AUTH_HELP, admission_model, checked
from specctl.config import build_config
from specctl.errors import ConfigError
from specctl.runtime.omp_wait import OMP_WAIT_HELP, apply_omp_wait, is_loopback

SERVER_MODES = ("chain", "tree", "ngram", "suffix")  # ar proposes nothing; multi is a target's routing

DEFAULT_PRESPEC_BUDGET = 8


def prespec_config(enabled: bool, budget: int | None, profile_budget: int, saguaro_c: float, fallback: str, mode: str,
                   trials: bool = True):
    """The pre-speculation settings from the flags (budget: flag > profile > default), or None when off."""
    from specctl.draft.prespec_config import PrespecConfig

    if not enabled:
        if budget is not None or saguaro_c != 1.0 or fallback != "auto" or not trials:
            raise ConfigError("--prespec-budget, --saguaro-c, --fallback and --no-prespec-trials need --prespec")
        return None
    if mode not in ("chain", "tree"):
        raise ConfigError(f"--prespec drafts with the draft model: use --mode chain or tree (not {mode})")
    if mode == "tree" and saguaro_c != 1.0:
        raise ConfigError("--saguaro-c reshapes sampled chain tokens; a tree's candidates are the draft's top-k, "
                          "not sampled: use --mode chain with --saguaro-c")
    budget = budget if budget is not None else (profile_budget or DEFAULT_PRESPEC_BUDGET)
    return checked(PrespecConfig, budget=budget, saguaro_c=saguaro_c, fallback=fallback, trials=trials)


def draft(
    port: int = typer.Option(9000, help="TCP port to listen on (0 = any free port)"),
    host: str = typer.Option("127.0.0.1", help="address to bind (0.0.0.0 for every interface)"),
    model: Optional[str] = typer.Option(None, help="draft model (default: qwen2.5-coder-0.5b)"),
    mode: Optional[str] = typer.Option(None, help="chain | tree | ngram | suffix: the proposals this server makes (suffix: from every target's outputs; ngram and suffix load the model's vocabulary only, no weights)"),
    draft_stop: Optional[float] = typer.Option(None, "--draft-stop", help="adaptive depth: stop drafting once the draft's probability of its path is below this (0 = off)"),
    depth: Optional[int] = typer.Option(None, help="proposal depth d"),
    topk: Optional[int] = typer.Option(None, help="tree top-k"),
    width: Optional[int] = typer.Option(None, help="tree width w"),
    max_sessions: Optional[int] = typer.Option(None, "--max-sessions", help="most open sessions (admission)"),
    max_batch: Optional[int] = typer.Option(None, "--max-batch", help="most requests served per compute pass"),
    prefix_cache_mb: Optional[int] = typer.Option(None, "--prefix-cache-mb", help="MiB of finished sessions' KV kept for prompts that start the same way, so the draft's prefill computes only the rest (default 1024; 0 = off; lossless either way: the draft only proposes)"),
    prefill_chunk: Optional[int] = typer.Option(None, "--prefill-chunk", help="a new session's prompt is fed in jobs "
                                                "of this many tokens before its first proposal, so other sessions' "
                                                "drafting goes on between them; deeper in a long prompt a job holds "
                                                "fewer, costing about as much (default 512 on the CPU, 2048 on CUDA; "
                                                "0 = with the first proposal, whole)"),
    dtype: Optional[str] = typer.Option(None, help="fp32 | bf16 | fp16"),
    draft_quant: Optional[str] = typer.Option(None, "--draft-quant", help="none | int8 (CPU)"),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads"),
    omp_wait: str = typer.Option("auto", "--omp-wait", help=OMP_WAIT_HELP + " (a draft server bound to a loopback "
                                 "--host serves targets on this host)"),
    profile: Optional[str] = typer.Option(None, help="hardware profile"),
    max_messages_per_s: float = typer.Option(5000.0, "--max-messages-per-s", help="per-peer rate limit (0 = off)"),
    admission_plan: Optional[str] = typer.Option(
        None, "--admission-plan", help="TS_MS,TV_MS,TC_MS,BETA: refuse a target beyond StarSD's N_max (with --standalone)"),
    standalone: Optional[float] = typer.Option(None, "--standalone", help="the target's standalone tokens/s (admission)"),
    auth_token: Optional[str] = typer.Option(None, "--auth-token", envvar="SPECCTL_AUTH_TOKEN", help=AUTH_HELP),
    tls_cert: Optional[str] = typer.Option(None, "--tls-cert", help="PEM certificate: serve TLS"),
    tls_key: Optional[str] = typer.Option(None, "--tls-key", help="PEM private key for --tls-cert"),
    prespec: bool = typer.Option(False, "--prespec", help="pre-speculation (SSD/Saguaro): while a target verifies, "
                                 "draft the next proposal for its likely outcomes in leftover compute (chain or tree mode)"),
    prespec_budget: Optional[int] = typer.Option(None, "--prespec-budget", help="most branches (outcomes) drafted ahead "
                                                 "per session and round (default: the profile's, else 8)"),
    saguaro_c: float = typer.Option(1.0, "--saguaro-c", help="Saguaro sampling at T > 0: the top-(F+1) draft "
                                    "probabilities times C in (0, 1] (1 = plain sampling; lower = more hits, less acceptance)"),
    fallback: str = typer.Option("auto", "--fallback", help="on a cache miss: jit (draft now), ngram (the fast backup), "
                                 "or auto (whichever the measured times favour for the sessions that missed together)"),
    prespec_trials: bool = typer.Option(True, "--prespec-trials/--no-prespec-trials",
                                        help="keep pre-speculation only while measured trials find it faster "
                                             "(off: pre-speculate every round)"),
    step_time_ms: float = typer.Option(0.0, "--step-time-ms", help="benchmarks: every draft forward takes at least "
                                       "this long, its compute included (emulates a draft device whose step time does "
                                       "not grow with its rows, as a GPU's; bench prespec --draft-step-ms)"),
    log_level: str = typer.Option("info", "--log-level", help="debug | info | warning"),
) -> None:
    """Run the shared draft server: one draft model serving many target instances (StarSD).

    With --admission-plan and --standalone, a new target instance is refused (its sessions run
    autoregressively, exactly as before) when StarSD predicts it would make every target slower
    than it runs alone: N > N_max. `specctl plan` prints N_max for the same numbers.

    With --prespec, the outcomes of every proposal out for verification are guessed (the
    accepted path ends at some node, then the bonus) and drafted ahead, only while no real request waits; a hit is
    answered at once, a miss as before. Output stays exactly the target's."""
    # first: libgomp reads it once, when torch loads it (build_config's profile detection does)
    # bound to loopback, its targets are on this host (its own address bound says nothing of theirs)
    omp_line = apply_omp_wait(omp_wait, [host] if is_loopback(host) else [], os.environ, "torch" in sys.modules)
    if mode is not None and mode not in SERVER_MODES:  # before the config's own checks, which speak of targets' flags
        raise ConfigError(f"a draft server proposes: --mode must be chain, tree, ngram or suffix, got {mode!r}")
    config = build_config(profile, draft=model, mode=mode, depth=depth, draft_stop=draft_stop, topk=topk, width=width,
                          max_sessions=max_sessions, max_batch=max_batch, dtype=dtype, threads=threads, draft_quant=draft_quant,
                          prefix_cache_mb=prefix_cache_mb, prefill_chunk=prefill_chunk)
    if config.mode not in SERVER_MODES:
        raise ConfigError(f"a draft server proposes: --mode must be chain, tree, ngram or suffix, got {config.mode!r}")
    if step_time_ms < 0:
        raise ConfigError(f"--step-time-ms must be >= 0, got {step_time_ms:g}")
    speculation = prespec_config(prespec, prespec_budget, config.prespec_budget, saguaro_c, fallback, config.mode,
                                 prespec_trials)
    # torch loads only once the flags above are known to be good: a mistake is reported at once
    from specctl.draft.server import DraftServer, DraftServerConfig
    from specctl.runtime.compute import ComputeThread
    from specctl.runtime.loop import run_with_compute, serve, setup_logging
    from specctl.runtime.tls import server_context
    from specctl.spec.factory import apply_threads, load_named, load_vocabulary, make_drafter, needs_draft_model

    ssl = server_context(tls_cert, tls_key)
    server_config = checked(DraftServerConfig, host=host, port=port, max_sessions=config.max_sessions,
                            max_batch=config.max_batch, kv_budget_bytes=config.kv_budget_bytes, auth_token=auth_token,
                            admission_model=admission_model(admission_plan, standalone, config.depth),
                            standalone_tokens_per_s=standalone, max_messages_per_s=max_messages_per_s,
                            prespec=speculation)
    setup_logging(log_level)
    if omp_line:
        logging.getLogger("specctl.draft").info(omp_line)
    apply_threads(config)
    console = Console(stderr=True)
    if needs_draft_model(config.mode):
        loaded = load_named(config.draft, config, console, config.draft_quant)
    else:  # n-gram and suffix proposals come from text: the vocabulary is all they need of the model
        loaded = load_vocabulary(config.draft, console)
    loaded.decoder.step_floor_s = step_time_ms / 1e3
    drafter = make_drafter(config, loaded)

    async def main(compute: ComputeThread) -> None:
        server = DraftServer(loaded, drafter, server_config, ssl, compute=compute.lane(max_batch=config.max_batch))
        # auto, bound to all interfaces, its workers spinning as the environment did not say otherwise
        server.spinning_for_remote_targets = (omp_wait == "auto" and omp_line is None and not is_loopback(host)
                                              and needs_draft_model(config.mode)
                                              and not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ))
        await serve(server, lambda bound: console.print(
            f"draft server [bold]{config.draft}[/] ({config.mode}, d={config.depth}"
            f"{'' if needs_draft_model(config.mode) else ', no weights'}) listening on "
            f"{host}:{bound}{' (TLS)' if ssl else ''}{' (auth)' if auth_token else ''}"
            f"{f' (pre-speculation, budget {speculation.budget})' if speculation else ''}", soft_wrap=True))

    run_with_compute(main, ComputeThread("draft-compute", max_batch=config.max_batch, spawn=False))
