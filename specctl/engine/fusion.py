"""Fused projections: q/k/v and gate/up read the same input, so each group can be one GEMM
(on a GPU a decode step is launch- and tail-bound). The static steps (engine.static) and
torch.compile paths need them fused."""

from __future__ import annotations

import torch
from torch import nn

from specctl.engine.layers import MLP
from specctl.engine.moe import mlps


def fused_linear(linears: list[nn.Linear]) -> nn.Linear:
    """One nn.Linear computing the concatenated outputs of ``linears`` (same input)."""
    weight = torch.cat([linear.weight.detach() for linear in linears])
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=linears[0].bias is not None,
                      device=weight.device, dtype=weight.dtype)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if fused.bias is not None:
        fused.bias = nn.Parameter(torch.cat([linear.bias.detach() for linear in linears]), requires_grad=False)
    return fused


def fuse_projections(decoder: nn.Module) -> nn.Module:
    """q/k/v and gate/up read the same input: one GEMM each instead of three and two (on a GPU a
    decode step is launch- and tail-bound). In place; a layer already fused is left alone."""
    for layer in decoder.layers:
        attn = layer.self_attn
        if attn.qkv_proj is None and attn.k_proj is not None:  # (a latent attention has no q/k/v to fuse)
            attn.qkv_proj = fused_linear([attn.q_proj, attn.k_proj, attn.v_proj])
            attn.q_proj = attn.k_proj = attn.v_proj = None
        for mlp in mlps(layer.mlp):  # a sparse layer's experts each (a plain MLP has nothing to fuse)
            if isinstance(mlp, MLP) and mlp.gate_up_proj is None:
                mlp.gate_up_proj = fused_linear([mlp.gate_proj, mlp.up_proj])
                mlp.gate_proj = mlp.up_proj = None
    return decoder
