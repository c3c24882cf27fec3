"""Multi-head latent attention (DeepSeek-V3, Kimi K2, Moonlight; transformers' modeling_deepseek_v3):
queries through a low-rank bottleneck (q_a_proj, its RMSNorm, q_b_proj; or one q_proj), keys
and values from one compressed latent per token (kv_a_proj_with_mqa, its RMSNorm, kv_b_proj)
plus a rotary key part every head shares; each head's query and key are a part without RoPE and
a rotated part.

The cache holds, by default (``ModelSpec.latent_cache``), each token's normed latent and rotated
key part and nothing else — kv_lora_rank + rope values a layer (576 for V3: 70 KB a token in
bf16, against 6.0 MB expanded) — as vLLM's MLA does. Attention then absorbs kv_b_proj: each
head's query without RoPE goes through its key up-projection into the latent's space, so one
cached vector of the latent and the rotated part serves every head as its key (a single KV head,
grouped-query attention), the latent alone as its value (a view: keys and values are one cache
plane); each head's output, a mix of latents, goes through its value up-projection. The same
attention by associativity, not the same rounding: bf16 logits are near transformers', not its
bits. Expanded (``latent_cache`` False: keys and values per head, values zero-padded to the keys'
width and read at theirs, a view) the engine computes as transformers does, to the bit."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specctl.engine.layers import Attention
from specctl.engine.norms import RMSNorm
from specctl.engine.rope import apply_rope, apply_rope_deinterleaved
from specctl.engine.spec import ModelSpec


class LatentAttention(Attention):
    def __init__(self, spec: ModelSpec, backend: str, window: int | None = None) -> None:
        super().__init__(spec, backend, window)
        q_rank, kv_rank, self.nope_dim, self.rope_dim, self.value_dim = spec.latent_attention
        self.qk_dim = self.nope_dim + self.rope_dim  # a head's query and key (head_dim is the cache's)
        self.absorbed = spec.latent_cache
        h, hidden, bias = spec.num_heads, spec.hidden_size, spec.attention_bias
        self.q_proj = self.k_proj = self.v_proj = None
        if q_rank is None:
            self.q_proj = nn.Linear(hidden, h * self.qk_dim, bias=False)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_a_proj = nn.Linear(hidden, q_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_rank, spec.rms_eps)
            self.q_b_proj = nn.Linear(q_rank, h * self.qk_dim, bias=False)
        self.kv_rank = kv_rank
        self.kv_a_proj_with_mqa = nn.Linear(hidden, kv_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_rank, spec.rms_eps)
        self.kv_b_proj = nn.Linear(kv_rank, h * (self.nope_dim + self.value_dim), bias=False)
        self.o_proj = nn.Linear(h * self.value_dim, hidden, bias=bias)
        # V3: pairs rotated and put out as halves (rope_interleave, its default); V2: pairs rotated as
        # complex numbers in float32 and left in place (spec.rope_interleaved: cos/sin in that layout)
        self.deinterleave = not spec.rope_interleaved and bool(getattr(spec.hf_config, "rope_interleave", True))
        self.pairs = spec.rope_interleaved
        # attention reads the values' own width (a view of the cache: the latent part of a latent
        # cache's vector; an expanded cache's unpadded values: padded, a bf16 kernel rounds
        # otherwise than transformers' over the values as they are)
        width, attend, static_attend = kv_rank if self.absorbed else self.value_dim, self.attend, self.static_attend
        self.attend = lambda q, k, v, mask: attend(q, k, v[..., :width], mask)
        self.static_attend = lambda q, k, v, mask: static_attend(q, k, v[..., :width], mask)

    def rotated_qkv(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, n, _ = x.shape
        h = self.num_heads
        q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_pass, q_rot = q.view(b, n, h, self.qk_dim).transpose(1, 2).split((self.nope_dim, self.rope_dim), dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split((self.kv_rank, self.rope_dim), dim=-1)
        k_rot = k_rot.view(b, 1, n, self.rope_dim)
        if self.pairs:
            q_rot, k_rot = (apply_rope(t.float(), cos, sin, interleaved=True).to(x.dtype) for t in (q_rot, k_rot))
        else:
            rotate = apply_rope_deinterleaved if self.deinterleave else apply_rope
            q_rot, k_rot = rotate(q_rot, cos, sin), rotate(k_rot, cos, sin)
        latent = self.kv_a_layernorm(latent)
        if self.absorbed:
            # each head's query without RoPE in the latent's space: q_pass W_uk (its key up-projection)
            key = torch.cat((latent.view(b, 1, n, self.kv_rank), k_rot), dim=-1)
            return torch.cat((_absorbed(q_pass, self._up_projections()[0]), q_rot), dim=-1), key, key
        kv = self.kv_b_proj(latent).view(b, n, h, -1).transpose(1, 2)
        k_pass, v = kv.split((self.nope_dim, self.value_dim), dim=-1)
        q = torch.cat((q_pass, q_rot), dim=-1)
        k = torch.cat((k_pass, k_rot.expand(-1, h, -1, -1)), dim=-1)
        return q, k, F.pad(v, (0, self.head_dim - self.value_dim))

    def heads_out(self, out: torch.Tensor) -> torch.Tensor:
        if self.absorbed:  # each head's mix of latents [.., kv_rank] through its value up-projection
            return _absorbed(out, self._up_projections()[1])
        return out[..., : self.value_dim]  # (a no-op where attention read the values' width)

    def _up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's weight per head: the keys' [H, nope, kv_rank] and the values' transposed
        [H, kv_rank, v] (views; read at each call: the weights are assigned at load)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.value_dim, self.kv_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :].transpose(1, 2)


def _absorbed(x: torch.Tensor, per_head: torch.Tensor) -> torch.Tensor:
    """x [B, H, n, a] times each head's [H, a, b]. On the CPU in float64, cast back: a product's
    rows then get the same bits alone or together (a decode step's as its verification's, one
    session's as a batch's), as the int8 and padded bf16 projections give them (engine.rows);
    CUDA targets are not row-exact, and keep the model's dtype."""
    if x.device.type != "cpu":
        return torch.matmul(x, per_head.to(x.dtype))
    return torch.matmul(x.double(), per_head.double()).to(x.dtype)
