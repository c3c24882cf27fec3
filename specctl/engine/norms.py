"""The decoder's norms, numerically mirroring each family's transformers code: Llama's RMSNorm
(normalised in float32, cast, then scaled), Gemma's and OLMo's (scaled in float32, then cast),
Cohere's LayerNorm without bias (centred), and StarCoder2's torch LayerNorm."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from specctl.engine.spec import ModelSpec


class RMSNorm(nn.Module):
    def __init__(self, dim: int | tuple[int, int], eps: float, unit_offset: bool = False, scale_in_float32: bool = False,
                 centered: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset  # Gemma's: weights stored as offsets from 1
        self.centered = centered  # Cohere's LayerNorm without bias: the mean taken away first
        # Gemma's, OLMo's and Cohere's: scaled before the cast
        self.scale_in_float32 = scale_in_float32 or unit_offset or centered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale_in_float32:
            return float_scaled_rms_norm(x, self.weight, self.eps, 1.0 if self.unit_offset else 0.0, self.centered)
        return rms_norm(x, self.weight, self.eps)


def make_norm(spec: ModelSpec, dim: int) -> nn.Module:
    """A norm of the model's kind over ``dim`` features: RMSNorm (in its style), or StarCoder2's
    LayerNorm with a bias."""
    if spec.layer_norm:
        return nn.LayerNorm(dim, eps=spec.rms_eps)
    return RMSNorm(dim, spec.rms_eps, **spec.norm_style)


def float_scaled_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                          centered: bool = False) -> torch.Tensor:
    """Gemma's RMSNorm (offset 1: scaled by 1 + weight) and OLMo's (offset 0): scaled in float32,
    then cast back (Llama casts first); ``centered``: Cohere's LayerNorm without bias (the mean
    taken away before the variance)."""
    h = x.float()
    if centered:
        h = h - h.mean(-1, keepdim=True)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (offset + weight.float())).to(x.dtype)


def unit_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """An RMS norm without weight, in float32, cast back (Llama 4's L2 norm of queries and keys)."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalised in float32, cast back, then scaled."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)
