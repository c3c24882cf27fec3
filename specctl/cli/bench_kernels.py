"""``specctl bench kernels``: ms per decode step and per verification of 1..64 tokens, eager
and as CUDA graphs, against the memory-bandwidth limit."""

from __future__ import annotations

import json
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from specctl.errors import ConfigError


def kernels(
    model: str = typer.Option("1.5b", help="with --random-weights a model shape (0.5b, 1.5b, 7b: qwen2.5-NB; 0.6b, "
                              "1.7b, 8b: qwen3-NB) or a checkpoint directory (its config.json), else a model name "
                              "(specctl models list)"),
    random_weights: bool = typer.Option(True, "--random-weights/--real-weights",
                                        help="random weights of the model's shape: no download, same timing"),
    device: str = typer.Option("cuda", help="cuda[:N] or cpu"),
    dtype: str = typer.Option("bf16", help="fp32 | bf16 | fp16"),
    sizes: str = typer.Option("1,2,4,8,16,32,64", help="new tokens per step to time (1 = an AR decode step)"),
    context: int = typer.Option(512, help="tokens already in the KV cache"),
    repeats: int = typer.Option(20, help="timed steps per size (min/median/max reported)"),
    graphs: bool = typer.Option(True, "--graphs/--no-graphs", help="also time the static steps as CUDA graphs "
                                "(CUDA only)"),
    compile: bool = typer.Option(True, "--compile/--no-compile", help="also time CUDA graphs of torch.compile'd "
                                 "layers (CUDA only; compiling takes a minute)"),
    sessions: str = typer.Option("", help="also time forwards of several sessions at once, e.g. 2,4,8 (a draft "
                                 "server's batched step, a target's batched verification); none by default"),
    batch_tokens: str = typer.Option("1,4", help="with --sessions: new tokens of each session (1 = a draft step, "
                                     "d+1 = a chain's verification)"),
    attention: str = typer.Option("torch", help="torch | flashinfer: the eager forwards' attention (flashinfer: the "
                                  "sessions' caches in one KV arena, a batch one paged call a layer; CUDA, bf16/fp16)"),
    profile: int = typer.Option(0, help="also profile this many AR steps of the fastest variant: kernels a step, the "
                                "device's busy time against the wall time, the kernels that take most (0: off)"),
    decode: int = typer.Option(0, help="also time greedy AR generations of this many tokens with the fastest variant: "
                               "ms a token with the round loop's host work, reading each token back and (CUDA "
                               "graphs) running the next step ahead (0: off)"),
    packed_weights: bool = typer.Option(True, "--packed-weights/--no-packed-weights",
                                        help="CPU bf16: linear weights reordered once for oneDNN, as specctl loads "
                                        "models (config packed_weights); off: plain F.linear"),
    json_out: Optional[str] = typer.Option(None, "--json", help="write the report as JSON to this file"),
) -> None:
    """One model's step times on one device: an AR step, verification of up to 64 tokens, their
    tokens/s and the fraction of the bandwidth limit (bytes a step reads / measured copy bandwidth)."""
    import torch

    from specctl.bench.kernel_report import kernels_report
    from specctl.bench.kernels import VERIFY_SIZES, measure_bandwidth_gbps, time_batches, time_steps
    from specctl.bench.shapes import random_decoder, shape_config
    from specctl.bench.kernel_decode import decode_rows, time_decode
    from specctl.bench.kernel_profile import profile_steps
    from specctl.bench.render import render_kernel_batches_table, render_kernel_decode, render_kernel_profile, \
        render_kernels_table, table_console
    from specctl.cli.bench import int_list
    from specctl.config import build_config
    from specctl.engine import packed
    from specctl.engine.fusion import fuse_projections
    from specctl.engine.loader import DTYPES
    from specctl.engine.static import BUCKETS, SLOT_QUANTUM
    from specctl.spec.factory import load_named, warm_up_attention
    from specctl_kernels import select_backend

    steps = int_list(sizes, "--sizes") or VERIFY_SIZES
    if steps[0] < 1 or steps[-1] > BUCKETS[-1]:
        raise ConfigError(f"--sizes must be between 1 and {BUCKETS[-1]}")
    batch_sizes = int_list(sessions, "--sessions") if sessions else ()
    tokens_each = int_list(batch_tokens, "--batch-tokens")
    if batch_sizes and (batch_sizes[0] < 2 or batch_sizes[-1] > 64):
        raise ConfigError("--sessions must be between 2 and 64")
    if batch_sizes and (not tokens_each or tokens_each[0] < 1 or tokens_each[-1] > BUCKETS[-1]):
        raise ConfigError(f"--batch-tokens must be between 1 and {BUCKETS[-1]}")
    if context < 1 or repeats < 1:
        raise ConfigError("--context and --repeats must be >= 1")
    if decode < 0 or decode == 1:
        raise ConfigError(f"--decode must be 0 (off) or at least 2 tokens, got {decode}")
    if profile < 0:
        raise ConfigError(f"--profile must be >= 0 (steps to profile; 0: off), got {profile}")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device here; use --device cpu")
    if attention not in ("torch", "flashinfer"):
        raise ConfigError(f"--attention must be torch or flashinfer, got {attention!r}")
    try:
        select_backend(attention, device, DTYPES[dtype])
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    console = Console(stderr=True)
    with console.status(f"building {model} ({dtype}, {'random weights' if random_weights else 'checkpoint'})"):
        if random_weights:
            try:
                decoder = random_decoder(shape_config(model), DTYPES[dtype], device, attention)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
            if packed_weights and packed.candidate(device, dtype, "none"):
                packed.pack_linears(decoder)
        else:
            config = build_config(None, target=model, device=device, dtype=dtype, cuda_graphs=False,
                                  attention_backend=attention, prefix_cache_mb=0, packed_weights=packed_weights)
            decoder = load_named(model, config, console).decoder
        if decoder.device.type == "cuda":
            fuse_projections(decoder)
        if attention == "flashinfer" and decoder.kv_arena is None:
            # An arena holding every session this run opens: each cache, for its largest step.
            slots = (max(batch_sizes, default=1) + 2) * (context + 2 * BUCKETS[-1] + SLOT_QUANTUM)
            decoder.use_kv_arena(slots * decoder.kv_slot_bytes, attention="flashinfer")
        bandwidth = measure_bandwidth_gbps(device)
    if random_weights:  # a checkpoint was warmed up as it loaded
        warm_up_attention(decoder, console)
    on_cuda = decoder.device.type == "cuda"
    variants = {"eager": None}
    if graphs and on_cuda:
        variants["graphs"] = dict(graphs=True)
    if graphs and compile and on_cuda:
        variants["graphs+compile"] = dict(graphs=True, compile=True)
    timings, batches = {}, {}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("timing steps", total=(len(steps) + len(batch_sizes) * len(tokens_each)) * len(variants))
        for name, static in variants.items():
            progress.update(task, description=f"timing steps: {name}")
            decoder.static = None
            if static is not None:
                decoder.use_static_steps(**static)
            timings[name] = time_steps(decoder, context, steps, repeats, lambda: progress.advance(task))
            if batch_sizes:
                progress.update(task, description=f"timing batches: {name}")
                batches[name] = time_batches(decoder, context, batch_sizes, tokens_each, repeats,
                                             lambda: progress.advance(task))
    settings = {"dtype": dtype, "context": context, "repeats": repeats, "random_weights": random_weights,
                "attention": attention, "packed_weights": packed_weights and packed.candidate(device, dtype, "none")}
    report = kernels_report(model, decoder, timings, bandwidth, context, settings, batches)
    fastest = list(variants)[-1]  # set up last: the decoder runs it now
    if decode:
        with console.status(f"timing {repeats} generations of {decode} tokens ({fastest})"):
            timed = time_decode(decoder, context, decode, repeats)
        report["decode"] = {"variant": fastest, "rows": decode_rows(timed, report["bandwidth_limit_ms"])}
    if profile:
        with console.status(f"profiling {profile} AR steps ({fastest})"):
            report["profile"] = {"variant": fastest, **profile_steps(decoder, context, profile)}
    table_console().print(render_kernels_table(report))
    if batches:
        table_console().print(render_kernel_batches_table(report))
    if decode:
        table_console().print(render_kernel_decode(report))
    if profile:
        table_console().print(render_kernel_profile(report["profile"]))
    if json_out:
        with open(json_out, "w") as f:
            json.dump(report, f, indent=2)
