"""Tree attention on CUDA with flashinfer's custom-mask prefill.

flashinfer takes ragged [tokens, heads, dim] tensors and a flattened boolean mask; we
call the single-request prefill once per batch row (sessions have different lengths).
Every call passes a custom mask, a causal one included: one-token decode would otherwise
go through another kernel (fa3 causal) than verification (fa2 custom mask), and bf16
speculative output then differs from plain decoding."""

from __future__ import annotations

import torch

from specctl_kernels import causal_mask


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    import flashinfer

    batch, _, n, _ = q.shape
    total = k.shape[2]
    out = torch.empty_like(q)
    for b in range(batch):
        qb = q[b].transpose(0, 1).contiguous()  # [n, H, D]
        kb = k[b].transpose(0, 1).contiguous()  # [T, Hkv, D]
        vb = v[b].transpose(0, 1).contiguous()
        mb = causal_mask(n, total, q.device) if mask is None else mask if mask.dim() == 2 else mask[b]
        ob = flashinfer.single_prefill_with_kv_cache(qb, kb, vb, custom_mask=mb.reshape(n, total).contiguous())
        out[b] = ob.transpose(0, 1)
    return out
