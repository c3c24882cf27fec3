"""Build models and drafters from a Config: the one place that knows how names map to
loaded weights ("NAME@N" = the first N layers of NAME, an early-exit self-draft)."""

from __future__ import annotations

import re

import torch
from rich.console import Console

from specctl.config import LOOKUP_DRAFTERS, Config
from specctl.engine.loader import DTYPES, LoadedModel, check_same_vocab, load_model
from specctl.engine.fusion import fuse_projections
from specctl.engine.model import Decoder
from specctl.engine import packed, rows
from specctl.engine.quant import quantize_decoder
from specctl.engine.prefill_jobs import key_cost
from specctl.spec.drafters import Drafter, ModelChainDrafter, ModelTreeDrafter, NgramDrafter, NoDrafter
from specctl.spec.suffix import SuffixDrafter
from specctl.spec.multi import MultiDrafter
from specctl.store import resolve_model
from specctl_kernels import select_backend, warm_up

_LAYERS_SUFFIX = re.compile(r"^(?P<name>.+)@(?P<layers>\d+)$")


def split_model_name(name: str) -> tuple[str, int | None]:
    match = _LAYERS_SUFFIX.match(name)
    if match:
        return match["name"], int(match["layers"])
    return name, None


def apply_threads(config: Config) -> None:
    if config.threads:
        torch.set_num_threads(config.threads)


def load_named(name: str, config: Config, console: Console | None = None, quant: str = "none",
               stage: tuple[tuple[int, int], bool, bool] | None = None, target: bool = False) -> LoadedModel:
    """A model by name; ``stage`` = (layer range, embedding?, head?) loads one pipeline stage's part;
    ``target``: it verifies, so it attends row-exactly where that makes it reproduce AR."""
    base, layers = split_model_name(name)
    path = resolve_model(base, console)
    console = console or Console(stderr=True)
    dtype = "fp32" if quant == "int8" else config.dtype  # what it computes in
    if config.attention_backend != "auto":
        select_backend(config.attention_backend, config.device, DTYPES[dtype])  # refuse early, before a download
    what = "" if stage is None else f" layers {stage[0][0]}:{stage[0][1]}"
    with console.status(f"loading {name}{what} ({quant if quant != 'none' else config.dtype})"):
        # int8: loaded as stored (bf16), each linear widened only while it is quantized.
        model = load_model(name, path, "stored" if quant == "int8" else dtype, num_layers=layers,
                           device=config.device, backend=config.attention_backend, stage=stage,
                           latent_cache=config.mla_cache == "latent")
        model.decoder = quantize_decoder(model.decoder, quant)
        if config.packed_weights and packed.candidate(config.device, dtype, quant):
            packed.pack_linears(model.decoder)  # before the row probe, which probes these products
        if target and config.row_exact_attention and rows.candidate(config.device, dtype, quant):
            rows.make_row_exact(model.decoder, quant)
        if model.decoder.device.type == "cuda":
            fuse_projections(model.decoder)
            if stage is None and config.cuda_graphs:
                model.decoder.use_static_steps(graphs=True, compile=config.torch_compile)
        use_arena_for_flashinfer(model.decoder, config)
        prefix_mb = prefix_cache_mb(config.prefix_cache_mb, dtype, target, model.decoder.row_exact)
        if stage is None and prefix_mb and model.decoder.prefix_cache is None:
            model.decoder.use_prefix_cache(prefix_mb << 20)
        if stage is None:
            model.decoder.prefill_chunk = prefill_chunk(config.prefill_chunk, model.decoder.device)
            model.decoder.prefill_key_cost = key_cost(model.decoder.spec, model.decoder.device.type,
                                                      model.decoder.row_exact)
        if stage is None and config.decode_step:
            model.decoder.use_decode_step()  # last: it looks up the layers as quantized, packed, row-exact
    warm_up_attention(model.decoder, console)
    return model


def load_vocabulary(name: str, console: Console | None = None) -> LoadedModel:
    """A model's tokenizer, end tokens and shape, no weights: a lookup drafter (n-gram, suffix
    decoding) proposes from text alone, and its draft server needs only the vocabulary the
    targets' must match."""
    path = resolve_model(split_model_name(name)[0], console)
    with (console or Console(stderr=True)).status(f"loading {name}'s vocabulary (no weights: it drafts by lookup)"):
        return load_model(name, path, weights=False)


# 1 GiB: the 1.5B target's KV of 37k tokens in bf16 (28 KiB a token), past its 32k context: a Claude
# Code prompt (19k tokens, 539 MB) fits whole, where 512 MiB kept none of it
AUTO_PREFIX_CACHE_MB = 1024


def prefix_cache_mb(configured: int, dtype: str, target: bool, row_exact: bool = False) -> int:
    """The prefix cache a model gets (MiB; 0 = none). Auto (-1): a draft's always (it only
    proposes: its KV never changes an output), an fp32 target's (a restored prefix differs
    from a fresh prefill by ~1e-5, as a verification's rows differ from AR's) and a row-exact
    target's (its prefills then attend row by row: a restored prefix is bit-identical to a
    fresh prefill, Decoder.use_row_exact_attention); none for another bf16/fp16 target (a CUDA
    one), whose restored prefixes differ from a fresh prefill by bf16 rounding and so change
    some greedy outputs (measured: 2 of 4 chat turns) — there it is the user's choice."""
    if configured >= 0:
        return configured
    return AUTO_PREFIX_CACHE_MB if not target or dtype == "fp32" or row_exact else 0


AUTO_PREFILL_CHUNK = {"cuda": 2048, "cpu": 512}


def prefill_chunk(configured: int, device: torch.device) -> int:
    """Tokens a prefill job computes (0 = the whole prompt). Auto (-1): 2048 on CUDA (vLLM's
    token budget a step; each chunk reads the weights once more), 512 on the CPU, where 512
    tokens of the 1.5B target are seconds of compute already."""
    return configured if configured >= 0 else AUTO_PREFILL_CHUNK.get(device.type, 512)


def use_arena_for_flashinfer(decoder: Decoder, config: Config) -> None:
    """On flashinfer, sessions' caches live in one arena of the KV budget, so that an eager
    forward of one session or several is one batched flashinfer call a layer (issue 11)."""
    if decoder.attention_backend == "flashinfer" and decoder.kv_arena is None:
        decoder.use_kv_arena(config.kv_budget_bytes, attention="flashinfer")


def warm_up_attention(decoder: Decoder, console: Console) -> None:
    """flashinfer compiles its attention kernels on first use: at load, with a line saying so."""
    spec = decoder.spec
    if decoder.attention_backend == "flashinfer":
        with console.status(f"compiling flashinfer's attention kernels ({str(decoder.dtype).removeprefix('torch.')}, "
                            f"head dim {spec.head_dim}; minutes on a machine's first start, cached after)"):
            warm_up("flashinfer", decoder.dtype, spec.num_heads, spec.num_kv_heads, spec.head_dim, decoder.device)
            if decoder.paged is not None:
                decoder.paged.warm_up(spec.num_heads)


def needs_draft_model(mode: str) -> bool:
    return mode in ("chain", "tree")


def load_pair(config: Config, console: Console | None = None) -> tuple[LoadedModel, LoadedModel | None]:
    target = load_named(config.target, config, console, config.target_quant, target=True)
    draft = None
    if needs_draft_model(config.mode):
        same = config.draft == config.target and config.draft_quant == config.target_quant
        draft = target if same else load_named(config.draft, config, console, config.draft_quant)
        check_same_vocab(target, draft)
    return target, draft


def load_draft_models(config: Config, target: LoadedModel, console: Console | None = None) -> dict[str, LoadedModel]:
    """The model drafters of ``config.drafters`` (every name but ngram), vocabularies checked."""
    models = {}
    for name in config.drafter_names:
        if name not in LOOKUP_DRAFTERS:
            same = name == config.target and config.draft_quant == config.target_quant
            models[name] = target if same else load_named(name, config, console, config.draft_quant)
            check_same_vocab(target, models[name])
    return models


def load_drafters(config: Config, target: LoadedModel, console: Console | None = None) -> dict[str, Drafter]:
    """Every drafter of ``config.drafters`` (a model name, NAME@N, or ngram) as a chain of depth d."""
    models = load_draft_models(config, target, console)
    lookups = {"ngram": lambda: NgramDrafter(config.depth), "suffix": lambda: suffix_drafter(config)}
    return {name: lookups[name]() if name in lookups
            else ModelChainDrafter(models[name].decoder, config.depth, config.draft_stop)
            for name in config.drafter_names}


def suffix_drafter(config: Config) -> SuffixDrafter:
    """Suffix decoding with ``config``'s depth and suffix_* options."""
    return SuffixDrafter(config.depth, max_depth=config.suffix_max_depth, max_spec_factor=config.suffix_max_spec_factor,
                         min_token_prob=config.suffix_min_token_prob, max_cached=config.suffix_max_cached)


def make_multi_drafter(config: Config, target: LoadedModel, console: Console | None = None) -> MultiDrafter:
    """Mode multi: the drafters of ``config.drafters``, routed and fused per session."""
    return MultiDrafter(load_drafters(config, target, console))


def make_drafter(config: Config, draft: LoadedModel | None) -> Drafter:
    if config.mode == "ar":
        return NoDrafter()
    if config.mode == "ngram":
        return NgramDrafter(config.depth)
    if config.mode == "suffix":
        return suffix_drafter(config)
    if config.mode == "multi":
        raise ValueError("mode multi loads several drafters: use make_multi_drafter")
    assert draft is not None, "chain and tree modes need a draft model"
    if config.mode == "chain":
        return ModelChainDrafter(draft.decoder, config.depth, config.draft_stop)
    return ModelTreeDrafter(draft.decoder, config.depth, config.topk, config.width, config.draft_stop)
