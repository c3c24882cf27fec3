"""Tree attention on CUDA with flashinfer's custom-mask prefill.

flashinfer takes [tokens, heads, dim] queries and a bit-packed boolean mask; we call the
single-request prefill once per batch row (sessions have different lengths). Every call
passes a custom mask, a causal one included: one-token decode would otherwise go through
another kernel (fa3 causal) than verification (fa2 custom mask), and bf16 speculative
output then differs from plain decoding.

The same kernel is not enough: flashinfer picks its query tile (CTA_TILE_Q, and with it how
the keys are split among a block's warps) from the packed query rows, rows x the GQA group:
16 up to 16, 64 up to 64, 128 beyond. A decode step packs one row (a group, 2-8 for the
usual models), so a verification forward whose packed rows pass 16 took the 64-row tile and
summed its keys in another order: measured on an H100 (2026-11-27), a 10-node tree (group 2)
gave other greedy tokens than AR on a 70-token prompt, while a 6-node chain (12 packed rows)
gave logits equal to AR's bit for bit. So a verification's rows go to the kernel in calls
of at most 16 packed rows (``rows_per_call``), each the tile a decode step takes.

Keys and values are read where the KV cache holds them: its [kv_heads, positions, dim]
views are flashinfer's "HND" layout, whose strides the kernel takes, so nothing is copied
(a `.contiguous()` of the whole K/V per layer and row cost more than the attention). The
mask is packed once per forward, not once per layer: every layer of a forward passes the
same mask tensor (or, causal, the same shape)."""

from __future__ import annotations

import threading

import torch

from specctl_kernels import causal_mask

_BIT_WEIGHTS = tuple(1 << i for i in range(8))
DECODE_TILE_ROWS = 16  # flashinfer's smallest query tile, in packed rows (query rows x GQA group)
VERIFY_ROWS = 64  # forwards of at most this many rows are verifications (a tree's budget); more: a prefill


def rows_per_call(rows: int, group: int) -> int:
    """How many query rows one kernel call gets so that each call takes the decode step's query
    tile: a verification (up to VERIFY_ROWS rows) is cut into calls of at most 16 packed rows
    (one row a call where a group alone passes 16, as a decode step then has too); a prefill
    stays one call, since nothing compares its rows with a decode step's."""
    if rows < 1 or group < 1:
        raise ValueError(f"rows and the GQA group must be >= 1, got {rows} and {group}")
    if rows > VERIFY_ROWS:
        return rows
    return max(1, DECODE_TILE_ROWS // group)


def pack_mask_bits(mask: torch.Tensor) -> torch.Tensor:
    """A boolean mask as flashinfer's packed custom mask: its flattened bits, eight to a byte,
    the first in the lowest bit (``numpy.packbits(..., bitorder="little")``)."""
    flat = mask.reshape(-1).to(torch.uint8)
    pad = -flat.numel() % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=mask.device)
    return (flat.view(-1, 8) * weights).sum(-1, dtype=torch.uint8)


class PackedMasks:
    """The packed masks of the forward in progress. A forward's layers pass the same mask
    tensor, so the first layer packs it and the others reuse it; a causal forward is known by
    its shape. Holding the last mask keeps its id and memory from going to another tensor
    while it is remembered; a tensor written in place since is told by its version counter
    (inference tensors keep none: the engine builds every forward's mask anew)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: tuple | None = None
        self._mask: torch.Tensor | None = None
        self._rows: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}  # (batch row, step) -> pieces
        self.packs = 0  # masks packed, for the tests

    def rows(self, mask: torch.Tensor | None, b: int, n: int, total: int, device: torch.device,
             step: int | None = None) -> tuple[torch.Tensor, ...]:
        """Batch row ``b``'s mask, [n, total], packed in pieces of ``step`` query rows (all n
        rows in one when None): one piece a kernel call."""
        step = n if step is None else step
        key = (("causal", n, total, str(device)) if mask is None
               else ("mask", id(mask), mask.data_ptr(), None if mask.is_inference() else mask._version,
                     tuple(mask.shape), str(mask.device)))
        with self._lock:
            if key != self._key:
                self._key, self._mask, self._rows = key, mask, {}
            packed = self._rows.get((b, step))
            if packed is None:
                rows = causal_mask(n, total, device) if mask is None else mask if mask.dim() == 2 else mask[b]
                rows = rows.reshape(n, total)
                packed = self._rows[(b, step)] = tuple(pack_mask_bits(rows[lo : lo + step]) for lo in range(0, n, step))
                self.packs += 1
            return packed


PACKED = PackedMasks()


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    import flashinfer

    batch, heads, n, _ = q.shape
    total = k.shape[2]
    step = rows_per_call(n, heads // k.shape[1])
    out = torch.empty_like(q)
    for b in range(batch):
        rows = q[b].transpose(0, 1).contiguous()  # [n, H, D]: n rows, a small copy
        for lo, packed in zip(range(0, n, step), PACKED.rows(mask, b, n, total, q.device, step)):
            piece = flashinfer.single_prefill_with_kv_cache(
                rows[lo : lo + step],
                k[b], v[b],  # [Hkv, T, D] views of the cache ("HND"), strides passed to the kernel
                kv_layout="HND",
                packed_custom_mask=packed,
            )
            out[b, :, lo : lo + step] = piece.transpose(0, 1)
    return out


WORKSPACE_BYTES = 128 << 20  # flashinfer's recommended split-k workspace


class BatchPaged:
    """Several sessions' attention over a paged arena in one flashinfer call per layer:
    ``BatchPrefillWithPagedKVCacheWrapper`` planned once per forward (``paged.PagePlan``) and run
    for each layer on the arena's pages, read in place ("HND" views: the kernel takes their
    strides, the same for keys and values). Every plan passes a custom mask (causal written out)
    so a decode step and a verification run the same kernel, as ``tree_attention`` does, and a
    verification's rows are requests of at most 16 packed rows each (``paged.plan_pages``'s
    ``rows_per_request``), so the batch's mean, from which flashinfer picks its query tile,
    stays the decode step's; split-KV is off so a session's result does not depend on the batch
    it came in."""

    def __init__(self, device: torch.device) -> None:
        import flashinfer

        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        # fa2: the kernel family of the custom-mask single prefill (``tree_attention``), named
        # rather than left to ``auto``'s choice by device.
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, kv_layout="HND", backend="fa2")
        self.device = device

    def plan(self, plan, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        # The page table stays on the host: plan() reads it there (its scheduler) and copies it
        # to the device itself; the mask goes to the device, packed there.
        self.wrapper.plan(
            plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.last_page_len, num_heads, num_kv_heads, head_dim,
            plan.page, custom_mask=plan.flat_mask(self.device), q_data_type=dtype, kv_data_type=dtype,
            disable_split_kv=True)

    def run(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> torch.Tensor:
        """q [N, H, D] -> [N, H, D]."""
        return self.wrapper.run(q, (k_pages, v_pages))
