"""Tree attention on CUDA with flashinfer's custom-mask prefill.

flashinfer takes ragged [tokens, heads, dim] tensors and a flattened boolean mask; we
call the single-request prefill once per batch row (sessions have different lengths)."""

from __future__ import annotations

import torch


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    import flashinfer

    batch, _, n, _ = q.shape
    total = k.shape[2]
    out = torch.empty_like(q)
    for b in range(batch):
        qb = q[b].transpose(0, 1).contiguous()  # [n, H, D]
        kb = k[b].transpose(0, 1).contiguous()  # [T, Hkv, D]
        vb = v[b].transpose(0, 1).contiguous()
        if mask is None:
            ob = flashinfer.single_prefill_with_kv_cache(qb, kb, vb, causal=True)
        else:
            mb = mask if mask.dim() == 2 else mask[b]
            ob = flashinfer.single_prefill_with_kv_cache(qb, kb, vb, custom_mask=mb.reshape(n, total).contiguous())
        out[b] = ob.transpose(0, 1)
    return out
