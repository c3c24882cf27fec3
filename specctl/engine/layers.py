"""Decoder building blocks of the Llama family, numerically mirroring transformers."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specctl.engine.kv_cache import KVCache
from specctl.engine.moe import ClampedSwiGLUExpert, Routing, SparseMoE
from specctl.engine.norms import RMSNorm, make_norm, unit_rms_norm
from specctl.engine.rope import apply_rope
from specctl.engine.spec import ModelSpec
from specctl.engine.static_layer import after_attention, before_attention
from specctl.engine.static_step import StaticSegment
from specctl.engine.window import WindowCut
from specctl_kernels import eager_attention, get_attention, row_exact, static_attention
from specctl_kernels.paged import PlannedForward


@dataclass(frozen=True, slots=True)
class Segments:
    """The sessions whose new tokens share one forward: token ranges, caches, masks."""

    bounds: list[tuple[int, int]]
    caches: list[KVCache]
    masks: list[torch.Tensor | None]
    paged: PlannedForward | None = None  # one batched attention call per layer over the KV arena
    windows: list[WindowCut | None] | None = None  # per session, what its sliding layers see (engine.window)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, backend: str, window: int | None = None) -> None:
        super().__init__()
        self.window = window  # a sliding layer's window (engine.window), None: it sees every key
        h, kv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, d
        self.q_proj = nn.Linear(spec.hidden_size, h * d, bias=spec.attention_bias)
        self.k_proj = nn.Linear(spec.hidden_size, kv * d, bias=spec.attention_bias)
        self.v_proj = nn.Linear(spec.hidden_size, kv * d, bias=spec.attention_bias)
        self.o_proj = nn.Linear(h * d, spec.hidden_size, bias=spec.output_bias)
        self.qkv_proj: nn.Module | None = None  # int8 models fuse q/k/v into one projection
        self.qkv_sizes = (h * d, kv * d, kv * d)
        # Qwen3 normalises each head's queries and keys (over the head dim) before RoPE; OLMo all
        # heads' together (over the whole projection)
        self.qk_norm_across_heads = spec.qk_norm_across_heads
        self.rope_interleaved = spec.rope_interleaved
        self.rotation_in_float32 = spec.rotation_in_float32
        self.qk_norm_after_rope = spec.qk_norm_after_rope
        self.qk_l2_eps = spec.rms_eps if spec.qk_l2_norm else None  # Llama 4: rotated q and k RMS-normed, no weight
        q_width, k_width = ((h * d, kv * d) if spec.qk_norm_across_heads
                            else ((h, d), (kv, d)) if spec.qk_norm_weights_per_head else (d, d))
        self.q_norm = RMSNorm(q_width, spec.rms_eps, **spec.norm_style) if spec.qk_norm else None
        self.k_norm = RMSNorm(k_width, spec.rms_eps, **spec.norm_style) if spec.qk_norm else None
        self.scale, self.softcap = spec.attn_scale, spec.attn_softcap
        # gpt-oss: a learned logit per head that joins each query's softmax (attention given to nothing)
        self.sinks = nn.Parameter(torch.zeros(h)) if spec.attention_sinks else None
        if self.sinks is not None:
            get_attention(backend, sinks=self.sinks)  # refuses a backend that has no sinks
            self.attend, self.static_attend = self._attend_with_sinks, self._static_attend_with_sinks
        else:
            self.attend = get_attention(backend, spec.attn_scale, spec.attn_softcap)
            scaled = spec.attn_scale is not None or spec.attn_softcap is not None
            self.static_attend = (functools.partial(static_attention, scale=spec.attn_scale, softcap=spec.attn_softcap)
                                  if scaled else static_attention)
        self.row_exact = False

    def _attend_with_sinks(self, q, k, v, mask):
        # reads self.sinks at each call: the decoder is built on "meta" and its parameters assigned at load
        return eager_attention(q, k, v, mask, self.scale, self.softcap, self.sinks)

    def _static_attend_with_sinks(self, q, k, v, grouped_mask):
        return static_attention(q, k, v, grouped_mask, self.scale, self.softcap, self.sinks)

    def use_row_exact(self) -> None:
        """Every row — a verification's, a prefill's — attends as a one-token decode step
        would (specctl_kernels.row_exact)."""
        if not self.row_exact:
            self.attend, self.row_exact = row_exact(self.attend, prefill=True), True

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv_proj is not None:
            return self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x, cos, sin, segments: "Segments", layer: int) -> torch.Tensor:
        b, n, _ = x.shape
        out = self.attend_sessions(*self.rotated_qkv(x, cos, sin), segments, layer)
        return self.o_proj(self.heads_out(out).transpose(1, 2).reshape(b, n, -1))

    def heads_out(self, out: torch.Tensor) -> torch.Tensor:
        """Attention's output [B, H, n, D] as o_proj reads each head's (a latent attention's: its values' width)."""
        return out

    def rotated_qkv(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, H, n, D], k and v [B, Hkv, n, D] of x [B, n, hidden]: projected, normed, rotated."""
        b, n, _ = x.shape
        q, k, v = self.project(x)
        if self.qk_norm_across_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(b, n, self.num_heads, self.head_dim)
        k = k.reshape(b, n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not (self.qk_norm_across_heads or self.qk_norm_after_rope):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.reshape(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if cos is not None:  # None: a NoPE layer (SmolLM3's every 4th)
            if self.rotation_in_float32:  # Cohere: q and k in float32, cos/sin as they are
                q, k = q.float(), k.float()
            # cast back: OLMo rotates in float32 (its cos/sin are; rope.layer_ropes), a no-op otherwise
            pairs = self.rope_interleaved
            q, k = apply_rope(q, cos, sin, pairs).to(v.dtype), apply_rope(k, cos, sin, pairs).to(v.dtype)
            if self.qk_l2_eps is not None:
                q, k = unit_rms_norm(q, self.qk_l2_eps), unit_rms_norm(k, self.qk_l2_eps)
        elif sin is not None:  # Llama 4's NoPE layer: its queries times their positions' temperatures
            q = (q * sin[:, None]).to(v.dtype)
        if self.qk_norm_after_rope:  # Hunyuan
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def attend_sessions(self, q, k, v, segments: "Segments", layer: int) -> torch.Tensor:
        """The new keys and values written to each session's cache, and q's attention over it: [B, H, n, D]."""
        if isinstance(segments, StaticSegment):
            out = segments.attend(layer, q, torch.stack((k[0], v[0])), self.static_attend, self.window is not None)
        elif segments.paged is not None:
            for (start, end), cache in zip(segments.bounds, segments.caches):
                cache.write(layer, k[:, :, start:end], v[:, :, start:end])
            out = segments.paged.attend(layer, q)
        else:
            # Several sessions in one forward: the projections above ran once over all their
            # tokens (the weights are read once); attention runs per session on its own cache.
            windows = segments.windows if self.window is not None and segments.windows else [None] * len(segments.caches)
            parts = []
            for (start, end), cache, mask, cut in zip(segments.bounds, segments.caches, segments.masks, windows):
                keys, values = cache.write(layer, k[:, :, start:end], v[:, :, start:end])
                if cut is not None:
                    keys, values, mask = keys[:, :, cut.start:], values[:, :, cut.start:], cut.mask
                parts.append(self.attend(q[:, :, start:end], keys, values, mask))
            out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
        return out


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, intermediate_size: int | None = None) -> None:
        super().__init__()
        inner = intermediate_size or spec.intermediate_size
        # Llama's SiLU as F.silu (what the fused pieces call); another (Gemma's GELU) as transformers names it
        if spec.activation == "silu":
            self.act = F.silu
        else:
            from transformers.activations import ACT2FN

            self.act = ACT2FN[spec.activation]
        self.gate_proj = nn.Linear(spec.hidden_size, inner, bias=spec.mlp_bias)
        self.up_proj = nn.Linear(spec.hidden_size, inner, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(inner, spec.hidden_size, bias=spec.mlp_bias)
        self.gate_up_proj: nn.Module | None = None  # int8 models fuse gate/up into one projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate) * up)


class PlainMLP(nn.Module):
    """An MLP without gate, c_fc -> activation -> c_proj: StarCoder2's (GELU), Arcee's (ReLU^2,
    its checkpoint's up_proj / down_proj)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        self.act = ACT2FN[spec.activation]
        self.c_fc = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=spec.mlp_bias)
        self.c_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, backend: str, index: int = 0) -> None:
        super().__init__()
        window = spec.layer_windows[index] if spec.layer_windows else None
        if spec.latent_attention is not None:  # DeepSeek-V3's (its module builds on Attention: imported here)
            from specctl.engine.latent import LatentAttention

            self.self_attn = LatentAttention(spec, backend, window)
        else:
            self.self_attn = Attention(spec, backend, window)
        if spec.sparse_layers and spec.sparse_layers[index]:
            shared = spec.shared_expert_intermediate_size
            expert = (functools.partial(ClampedSwiGLUExpert, spec.hidden_size, spec.expert_intermediate_size,
                                        *spec.clamped_swiglu) if spec.clamped_swiglu
                      else functools.partial(MLP, spec, spec.expert_intermediate_size))
            routing = Routing(spec.routing, spec.normalize_expert_weights, *spec.expert_groups, spec.routed_scale)
            self.mlp = SparseMoE(spec.hidden_size, spec.num_experts, spec.experts_per_token, routing, expert,
                                 functools.partial(MLP, spec, shared) if shared else None, spec.gated_shared_expert)
        else:
            self.mlp = MLP(spec) if spec.gated_mlp else PlainMLP(spec)
        norm = functools.partial(make_norm, spec, spec.hidden_size)
        self.post_norms = spec.post_norms  # OLMo 2/3: the sub-layers' outputs normed, not their inputs
        self.parallel = spec.parallel_residual  # Cohere 2: one norm, attention and MLP side by side
        self.branches_first = spec.parallel_branches_first  # Phi: (attention + MLP) + x, not (x + attention) + MLP
        self.parallel_two_norms = spec.parallel_two_norms  # GPT-NeoX: side by side from two norms
        if not self.post_norms:
            self.input_layernorm = norm()
        # Llama's: the MLP's input norm; Gemma 2's (sandwich) and OLMo's: the attention output's norm
        if not self.parallel:
            self.post_attention_layernorm = norm()
        self.sandwich = spec.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
        if self.sandwich or self.post_norms:
            self.post_feedforward_layernorm = norm()
        self.llama_shaped = spec.llama_layers
        self.residual_scale = spec.residual_scale  # Granite: each branch's output scaled before it is added
        # Gemma 3's sliding layers rotate with their own RoPE (rope.layer_ropes); SmolLM3's NoPE ones not at all
        self.rotates_locally = spec.local_rope and spec.hf_config.layer_types[index] == "sliding_attention"
        self.rotates = spec.rope_layers[index] if spec.rope_layers else True

    @property
    def first_norm(self) -> nn.Module:
        """A norm every kind of layer has (its weight tells the decoder's dtype and device)."""
        return self.post_attention_layernorm if self.post_norms else self.input_layernorm

    def forward(self, x, cos, sin, segments: "Segments", layer: int) -> torch.Tensor:
        if self.parallel:
            h = self.input_layernorm(x)
            if self.branches_first:
                return self.self_attn(h, cos, sin, segments, layer) + self.mlp(h) + x
            return x + self.self_attn(h, cos, sin, segments, layer) + self.mlp(h)
        if self.parallel_two_norms:
            attention = self.self_attn(self.input_layernorm(x), cos, sin, segments, layer)
            return self.mlp(self.post_attention_layernorm(x)) + attention + x
        if self.post_norms:
            x = x + self.post_attention_layernorm(self.self_attn(x, cos, sin, segments, layer))
            return x + self.post_feedforward_layernorm(self.mlp(x))
        if self.sandwich:
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, segments, layer))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        if self.residual_scale is not None:
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, segments, layer) * self.residual_scale
            return x + self.mlp(self.post_attention_layernorm(x)) * self.residual_scale
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, segments, layer)
        return x + self.mlp(self.post_attention_layernorm(x))

    def static_step(self, x, h, cos, sin, segment: StaticSegment, layer: int, next_norm: RMSNorm,
                    before=before_attention, attend=static_attention, after=after_attention):
        """The layer on a static step through three functions of plain tensors (each may be its
        torch.compile'd version), from x and its normed h; needs fused projections. Returns
        (x, h) for the next layer, h normed by ``next_norm`` (the next layer's, or the final one)."""
        attn, mlp = self.self_attn, self.mlp
        norms = () if attn.q_norm is None else (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps)
        q, kv = before(h, attn.qkv_proj.weight, attn.qkv_proj.bias, cos, sin, attn.num_heads, attn.num_kv_heads,
                       attn.head_dim, *norms)
        out = segment.attend(layer, q, kv, attend, attn.window is not None)
        return after(x, out, attn.o_proj.weight, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps,
                     mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, mlp.down_proj.weight, mlp.down_proj.bias,
                     next_norm.weight)

    @property
    def fused(self) -> bool:
        """A Llama-shaped layer with both projections fused into plain nn.Linear layers
        (static_step's pieces compute it)."""
        return (self.llama_shaped and type(self.self_attn.qkv_proj) is nn.Linear
                and type(self.mlp.gate_up_proj) is nn.Linear)  # llama_shaped: a dense MLP
