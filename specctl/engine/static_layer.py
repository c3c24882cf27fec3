"""A static step's Llama-shaped layer on plain tensors (engine.static): one function up to
attention and one after it, so that one compiled version of each serves every layer and the
residual add runs fused with the next norm."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specctl.engine.norms import rms_norm
from specctl.engine.rope import apply_rope


def before_attention(h, qkv_weight, qkv_bias, cos, sin, heads: int, kv_heads: int, head_dim: int,
                     q_norm_weight=None, k_norm_weight=None, eps: float = 0.0):
    """A static step's layer up to attention, on plain tensors (so one compiled function serves
    every layer), from the normed input h: fused q/k/v projection, Qwen3's per-head q/k norms
    where given, RoPE on q and k together.
    Returns q [1, H, M, D] and kv [2, Hkv, M, D] (keys and values, as the cache stores them)."""
    b, n, _ = h.shape
    qkv = F.linear(h, qkv_weight, qkv_bias)
    qk, v = qkv.split(((heads + kv_heads) * head_dim, kv_heads * head_dim), dim=-1)
    qk = qk.reshape(b, n, heads + kv_heads, head_dim)
    if q_norm_weight is not None:
        q, k = qk.split((heads, kv_heads), dim=2)
        qk = torch.cat((rms_norm(q, q_norm_weight, eps), rms_norm(k, k_norm_weight, eps)), dim=2)
    qk = apply_rope(qk.transpose(1, 2), cos, sin)
    q, k = qk.split((heads, kv_heads), dim=1)
    return q, torch.stack((k[0], v.reshape(n, kv_heads, head_dim).transpose(0, 1)))


def after_attention(x, attn, o_weight, norm_weight, eps: float, gate_up_weight, gate_up_bias, down_weight, down_bias,
                    next_norm_weight):
    """The rest of a static step's layer: output projection, residual, norm, fused gate/up MLP,
    residual; and the next layer's input norm (or the final norm), so that the residual add and
    that norm run as one kernel. Returns (x, next layer's normed input)."""
    b, heads, n, head_dim = attn.shape
    x = x + F.linear(attn.transpose(1, 2).reshape(b, n, heads * head_dim), o_weight)
    gate, up = F.linear(rms_norm(x, norm_weight, eps), gate_up_weight, gate_up_bias).chunk(2, dim=-1)
    x = x + F.linear(F.silu(gate) * up, down_weight, down_bias)
    return x, rms_norm(x, next_norm_weight, eps)
