"""Reference tree attention: PyTorch SDPA with a boolean mask (CPU path and test oracle)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    n, total = q.shape[2], k.shape[2]
    if mask is None:
        if n == 1:
            # One new token sees everything cached: no mask needed, fastest SDPA path.
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1])
        rows = torch.arange(n, device=q.device).unsqueeze(1)
        cols = torch.arange(total, device=q.device).unsqueeze(0)
        mask = cols <= rows + (total - n)
    if mask.dim() == 2:
        mask = mask.unsqueeze(0)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), enable_gqa=q.shape[1] != k.shape[1])
