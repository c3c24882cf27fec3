"""Rotary position embeddings: cos/sin tables and their application, in the halves layout
(Llama's) or with neighbouring dims paired (GLM-4's, Cohere's), over all or the first part of
each head (partial rotary)."""

from __future__ import annotations

import torch


def rope_cos_sin(inv_freq: torch.Tensor, scaling: float, positions: torch.Tensor, dtype: torch.dtype,
                 interleaved: bool = False):
    """cos/sin for positions [n], shaped [1, 1, n, D] to broadcast over [B, H, n, D]; each
    frequency twice in a row where neighbouring dims pair (GLM-4's layout), else its halves'."""
    freqs = positions.float().unsqueeze(-1) * inv_freq.unsqueeze(0)
    emb = freqs.repeat_interleave(2, dim=-1) if interleaved else torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype)[None, None], (emb.sin() * scaling).to(dtype)[None, None]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """rotate_half for neighbouring pairs: (x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """RoPE over the first cos.shape[-1] dims of each head; the rest pass unrotated (partial
    rotary: Phi-4-mini's 0.75, GLM-4's 0.5), as transformers' Phi-3 applies it; ``interleaved``:
    neighbouring dims rotate together (GLM-4), with cos/sin in that layout (rope_cos_sin)."""
    rotate = rotate_pairs if interleaved else rotate_half
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return x * cos + rotate(x) * sin
    rotated, passed = x[..., :rotary], x[..., rotary:]
    return torch.cat((rotated * cos + rotate(rotated) * sin, passed), dim=-1)


def apply_rope_deinterleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's RoPE (rope_interleave): neighbouring dims pair, and the rotated pairs come out as
    halves, [x0 cos - x1 sin, x2 cos - x3 sin, ..., x1 cos + x0 sin, ...] (transformers'
    apply_rotary_pos_emb_interleave), with cos/sin in the halves layout (rope_cos_sin)."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
