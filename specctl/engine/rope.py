"""Rotary position embeddings: cos/sin tables and their application, in the halves layout
(Llama's) or with neighbouring dims paired (GLM-4's, Cohere's), over all or the first part of
each head (partial rotary)."""

from __future__ import annotations

from typing import Any, Sequence

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


def layer_ropes(spec: Any, layers: Sequence[Any], positions: torch.Tensor, dtype: torch.dtype,
                full: tuple[torch.Tensor, float], local: tuple[torch.Tensor, float] | None) -> list:
    """(cos, sin) of ``positions`` for each of a decoder's ``layers``: one pair shared, or Gemma
    3's two (``full`` and its sliding layers' ``local`` frequencies and scaling); in float32 where
    the model rotates in float32 (OLMo); (None, None) for a layer that does not rotate
    (SmolLM3's NoPE layers) — Llama 4's: (None, its queries' temperature scales)."""
    dtype = torch.float32 if spec.rope_in_float32 else dtype
    pairs = spec.rope_interleaved
    full_pair = rope_cos_sin(*full, positions, dtype, pairs)
    local_pair = None if local is None else rope_cos_sin(*local, positions, dtype, pairs)
    if local_pair is None and all(layer.rotates for layer in layers):
        return [full_pair] * len(layers)
    unrotated = (None, None)
    if spec.query_temperature is not None:
        # log1p(floor((p + 1) / floor_scale)) * scale + 1 in float32, as transformers tunes a NoPE layer's queries
        scale, floor_scale = spec.query_temperature
        unrotated = (None, torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * scale + 1.0)
    return [unrotated if not layer.rotates else local_pair if layer.rotates_locally else full_pair for layer in layers]
