"""specctl's decoder: a range of layers [a, b) of a Llama-family model, optionally with the
embedding (first stage) and the final norm + LM head (last stage), run over a per-session
KV cache with an explicit (tree) attention mask."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, TypeVar

import torch
from torch import nn

from specctl.engine import decode_step
from specctl.engine.ends import head_logits, scaled_embedding
from specctl.engine.kv_arena import KVArena
from specctl.engine.kv_cache import KVCache, KVPool, kv_slot_bytes
from specctl.engine.layers import DecoderLayer, Segments
from specctl.engine.norms import make_norm
from specctl.engine.prefix_cache import PrefixCache
from specctl.engine.rope import layer_ropes
from specctl.engine.spec import ModelSpec
from specctl.engine.static import CUDA_LOCK, StaticRunner
from specctl.engine.static_step import StaticSegment
from specctl.engine.window import window_cut
from specctl.runtime.emulation import floored
from specctl_kernels.paged import PagedAttention

Out = TypeVar("Out")


class Decoder(nn.Module):
    def __init__(
        self,
        spec: ModelSpec,
        layer_range: tuple[int, int] | None = None,
        embed: bool = True,
        head: bool = True,
        backend: str = "torch",
    ) -> None:
        super().__init__()
        first, last = layer_range or (0, spec.num_layers)
        if not 0 <= first < last <= spec.num_layers:
            raise ValueError(f"layer range [{first}, {last}) outside the model's {spec.num_layers} layers")
        self.spec, self.layer_range, self.has_embed, self.has_head = spec, (first, last), embed, head
        self.attention_backend = backend
        # the table uninitialised (weights are loaded into a decoder, or drawn by bench kernels): a random
        # init on the meta device runs through torch's Python refs, whose first use imports torch._dynamo,
        # about a second of every model load
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size,
                                         _weight=torch.empty(spec.vocab_size, spec.hidden_size)) if embed else None
        self.layers = nn.ModuleList(DecoderLayer(spec, backend, index) for index in range(first, last))
        self.norm = make_norm(spec, spec.hidden_size) if head else None
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=spec.head_bias) if head else None
        inv_freq, self.rope_scaling = spec.inv_freq()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # Gemma 3: its sliding layers' own RoPE (None: every layer rotates with inv_freq)
        local, self.local_rope_scaling = spec.inv_freq("sliding_attention") if spec.local_rope else (None, 1.0)
        self.register_buffer("local_inv_freq", local, persistent=False)
        self.static: StaticRunner | None = None
        # Benchmarks only (`specctl draft --step-time-ms`): every forward (eager or static) takes at least this
        # long, its compute inside — a device whose step time does not grow with its rows, as a
        # GPU's does not up to tens of rows. 0 = off, as always outside an emulated benchmark.
        self.step_floor_s = 0.0
        self.kv_arena: KVArena | None = None  # sessions' caches as ranges of one buffer (use_kv_arena)
        self.paged: PagedAttention | None = None  # batched attention over the arena (use_kv_arena)
        self.prefix_cache: PrefixCache | None = None  # finished sessions' KV, reused by new ones (use_prefix_cache)
        self.prefill_chunk = 0  # a session's prompt prefill in jobs of this many tokens (0 = one job; Config)
        self.prefill_key_cost = 0.0  # deeper jobs hold fewer tokens by this (engine.prefill_jobs; 0: all alike)
        self.decode_step: decode_step.DecodeStep | None = None  # a token a session on the CPU (use_decode_step)

    def use_static_steps(self, graphs: bool = True, compile: bool = False) -> "Decoder":
        """Run single-session steps of up to 64 tokens padded to a size bucket over the whole
        KV buffer, captured as CUDA graphs when on CUDA and ``graphs``; ``compile``: each
        layer's step through torch.compile'd functions (fused projections needed)."""
        if not (self.has_embed and self.has_head):
            raise ValueError("static steps need a full model (embedding and head)")
        if self.static is not None and self.kv_arena is not None:
            self.static.leave_arena(self.kv_arena)
        self.static = StaticRunner(self, graphs, compile)
        if self.kv_arena is not None:
            self.static.adopt_arena(self.kv_arena)
        return self

    def use_decode_step(self) -> "Decoder":
        """Steps of one token a session (one session, or several in one forward) as straight-line
        code (engine.decode_step) where this decoder's shape allows; called once its layers are
        final (quantized, packed, row-exact)."""
        self.decode_step = decode_step.DecodeStep(self) if decode_step.fits(self) else None
        return self

    def use_kv_arena(self, budget_bytes: int, attention: str | None = None) -> "Decoder":
        """Hold every session's KV cache in one arena of ``budget_bytes`` (engine.kv_arena), and
        run an eager forward's attention, of one session or several, as one paged call per layer
        through ``attention`` (``flashinfer``; ``torch``: the reference, for tests; None: the
        arena without paged attention)."""
        s = self.spec
        if attention is not None and (s.window is not None or not s.llama_layers):
            raise ValueError("paged attention over the KV arena runs full, unscaled, uncapped attention: not this "
                             "model's (sliding windows or Gemma's scores); its sessions attend eagerly")
        self.kv_arena = KVArena.for_budget(self.num_layers, s.num_kv_heads, s.head_dim, budget_bytes, self.dtype,
                                           self.device, s.kv_planes)
        self.paged = None if attention is None else PagedAttention(attention, self.kv_arena)
        if self.static is not None:
            self.static.adopt_arena(self.kv_arena)
        return self

    def use_prefix_cache(self, budget_bytes: int) -> "Decoder":
        """Keep finished sessions' KV (``budget_bytes`` of copies) for new sessions whose prompts
        start the same way (engine.prefix_cache); a full model's sessions only."""
        if not (self.has_embed and self.has_head):
            raise ValueError("a prefix cache needs a full model (a pipeline stage's positions are the pipeline's)")
        self.prefix_cache = PrefixCache(budget_bytes)
        return self

    def use_row_exact_attention(self) -> "Decoder":
        """Verification and prefill rows attend exactly as AR decode steps do
        (specctl_kernels.row_exact): a target whose linear layers are row-independent then
        verifies bit-identically to AR, and every position's KV has the same bits however it
        was computed — a whole prompt, chunks, a rest after a restored prefix — so its prefix
        cache never changes an output (a 512-token prefill job of the 1.5B bf16 target cost 40-80 %
        more at the prompt's start on a 2-core EPYC, 2026-12-07; engine.prefill_jobs)."""
        for layer in self.layers:
            layer.self_attn.use_row_exact()
        return self

    @property
    def row_exact(self) -> bool:
        return all(layer.self_attn.row_exact for layer in self.layers)

    def reset_rope(self) -> None:
        """RoPE frequencies computed again in float32 on the CPU, before the decoder moves to its
        device: after a cast of the whole decoder (``.to(dtype)`` casts buffers too, as bench
        kernels' random decoder does). A decoder is built with them so (spec.inv_freq)."""
        self.inv_freq = self.spec.inv_freq()[0]
        if self.spec.local_rope:
            self.local_inv_freq = self.spec.inv_freq("sliding_attention")[0]

    def _ropes(self, positions: torch.Tensor, dtype: torch.dtype):
        local = None if self.local_inv_freq is None else (self.local_inv_freq, self.local_rope_scaling)
        return layer_ropes(self.spec, self.layers, positions, dtype, (self.inv_freq, self.rope_scaling), local)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].first_norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.layers[0].first_norm.weight.device

    @property
    def kv_slot_bytes(self) -> int:
        """Bytes one position of a session's KV cache takes."""
        s = self.spec
        return kv_slot_bytes(self.num_layers, s.num_kv_heads, s.head_dim, self.dtype, s.kv_planes)

    def new_cache(self, capacity: int, pool: KVPool | None = None) -> KVCache:
        if self.static is not None:  # sized for reuse, with the steps captured over it
            return self.static.new_cache(capacity, pool)
        s = self.spec
        return KVCache(self.num_layers, s.num_kv_heads, s.head_dim, capacity, self.dtype, self.device, pool,
                       arena=self.kv_arena, planes=s.kv_planes)

    @torch.inference_mode()
    def forward(
        self,
        inputs: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        mask: torch.Tensor | None = None,
        logits_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run n new tokens (ids [n], or hidden states [n, hidden] without embedding).

        positions [n]: RoPE positions (a tree node's is prefix length + depth).
        mask [n, cache.length + n]: True where a new token may attend; None = causal.
        logits_at: which of the n rows get logits (None = all). Returns float32 logits
        [len(logits_at), vocab] with a head, else hidden states [n, hidden]."""
        with self._device_lock():
            return self._floored(self._one_session, inputs, positions, cache, mask, logits_at)

    def _one_session(self, inputs: torch.Tensor, positions: torch.Tensor, cache: KVCache, mask: torch.Tensor | None,
                     logits_at: torch.Tensor | None) -> torch.Tensor:
        n = inputs.shape[0]
        if self.static is not None and self.static.fits(n, cache):
            return self.static.run(inputs, positions, cache, mask, logits_at)
        if self.static is not None and self.static.fits_in_chunks(n, cache, mask):
            return self.static.run_chunks(inputs, positions, cache, logits_at)
        if n == 1 and mask is None and self._steps_each_token():
            return self.decode_step.run(inputs, positions, [cache], logits_at)
        if mask is not None:
            mask = mask.to(self.device)
        return self._compute(inputs, positions, self._segments([(0, n)], [cache], [mask]), logits_at)

    def _device_lock(self):
        return CUDA_LOCK if self.device.type == "cuda" else contextlib.nullcontext()

    @torch.inference_mode()
    def forward_many(
        self,
        inputs: list[torch.Tensor],
        positions: list[torch.Tensor],
        caches: list[KVCache],
        masks: list[torch.Tensor | None],
        logits_at: list[torch.Tensor],
    ) -> list[torch.Tensor]:
        """Several sessions in one forward (ragged: each its own tokens, cache and mask); on
        CUDA graphs up to ``static.REPLAY_PER_SESSION_UP_TO`` sessions run as one step each instead.
        Returns, per session, the logits at its ``logits_at`` rows."""
        if len(inputs) == 1:
            return [self.forward(inputs[0], positions[0], caches[0], masks[0], logits_at[0])]
        if self.static is not None and self.static.replays_each(len(inputs)):
            sessions = list(zip(inputs, positions, caches, masks, logits_at))
            with self._device_lock():  # one step floor for the batch, as for one forward of it
                return self._floored(lambda: [self._one_session(*one) for one in sessions])
        bounds = ragged_bounds([tokens.shape[0] for tokens in inputs])
        rows = torch.cat([at + lo for at, (lo, _) in zip(logits_at, bounds)])
        out = self.forward_ragged(torch.cat(inputs), torch.cat(positions), bounds, caches, masks, rows)
        sizes = [at.numel() for at in logits_at]
        return list(out.split(sizes))

    @torch.inference_mode()
    def forward_ragged(
        self,
        inputs: torch.Tensor,
        positions: torch.Tensor,
        bounds: list[tuple[int, int]],
        caches: list[KVCache],
        masks: list[torch.Tensor | None],
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``forward_many`` on concatenated inputs: session s owns rows bounds[s]. Returns
        hidden states of every row without a head (a pipeline stage), else logits at ``rows``."""
        a_token_each = bounds and all(hi - lo == 1 for lo, hi in bounds) and all(m is None for m in masks)
        if a_token_each and self._steps_each_token():
            return self._floored(self.decode_step.run, inputs, positions, caches, rows)
        masks = [None if m is None else m.to(self.device) for m in masks]
        with self._device_lock():
            return self._floored(self._compute, inputs, positions, self._segments(bounds, caches, masks), rows)

    def _steps_each_token(self) -> bool:
        """One-token steps go through engine.decode_step (built for this decoder, no paged attention)."""
        return self.decode_step is not None and self.paged is None

    def _segments(self, bounds: list[tuple[int, int]], caches: list[KVCache], masks: list[torch.Tensor | None]):
        """An eager forward's sessions; with paged attention over the arena holding all their
        caches, planned once here for every layer."""
        paged = None
        if self.paged is not None and all(getattr(cache, "arena", None) is self.kv_arena for cache in caches):
            new = [hi - lo for lo, hi in bounds]
            paged = self.paged.plan([cache.start for cache in caches],
                                    [cache.length + n for cache, n in zip(caches, new)], new, masks,
                                    self.spec.num_heads)
        return Segments(bounds, caches, masks, paged)

    def static_forward(self, ids: torch.Tensor, positions: torch.Tensor, segment: StaticSegment) -> torch.Tensor:
        """The padded step (engine.static): float32 logits of all M rows; the caller commits."""
        x = self.embed(ids).unsqueeze(0)
        ropes = self._ropes(positions, x.dtype)
        pieces = self.static.pieces if self.static is not None else None
        if pieces is None:
            for i, (layer, (cos, sin)) in enumerate(zip(self.layers, ropes)):
                x = layer(x, cos, sin, segment, i)
            return self.logits(self.norm(x[0]))
        cos, sin = ropes[0]  # the fused pieces compute Llama-shaped layers: one RoPE
        h = self.layers[0].input_layernorm(x)
        norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for i, (layer, next_norm) in enumerate(zip(self.layers, norms)):
            x, h = layer.static_step(x, h, cos, sin, segment, i, next_norm, *pieces)
        return self.logits(h[0])

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return scaled_embedding(self.spec, self.embed_tokens, ids)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return head_logits(self.spec, self.lm_head, h)

    def _floored(self, compute: Callable[..., Out], *args) -> Out:
        return floored(self.step_floor_s, self.device, compute, *args)

    def _compute(self, inputs: torch.Tensor, positions: torch.Tensor, segments: Segments, logits_at) -> torch.Tensor:
        if self.embed_tokens is not None:
            x = self.embed(inputs.to(self.device)).unsqueeze(0)
        else:
            x = inputs.to(self.device, self.dtype).unsqueeze(0)
        ropes = self._ropes(positions.to(self.device), x.dtype)
        if self.spec.window is not None and segments.paged is None:
            window, chunked = self.spec.window, self.spec.chunked_attention
            segments = dataclasses.replace(segments, windows=[
                window_cut(positions[lo:hi], cache.length + hi - lo, mask, window, chunked)
                for (lo, hi), cache, mask in zip(segments.bounds, segments.caches, segments.masks)])
        for i, (layer, (cos, sin)) in enumerate(zip(self.layers, ropes)):
            x = layer(x, cos, sin, segments, i)
        for (lo, hi), cache in zip(segments.bounds, segments.caches):
            cache.commit(hi - lo)
        x = x[0]
        if self.lm_head is None:
            return x
        if logits_at is not None:
            x = x[logits_at.to(self.device)]
        return self.logits(self.norm(x))


def ragged_bounds(lengths: list[int]) -> list[tuple[int, int]]:
    """[(start, end)) of each session's rows when their tokens are concatenated."""
    bounds, start = [], 0
    for n in lengths:
        bounds.append((start, start + n))
        start += n
    return bounds
