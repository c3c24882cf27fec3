"""Reference tree attention: PyTorch SDPA with a boolean mask (CPU path and test oracle)."""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# cuDNN attention plans per shape: its first call at each new KV length cost 45-56 ms on an
# H100, and a decode step meets a new length every time. Name the kernels SDPA may use.
_CUDA_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _kernels(q: torch.Tensor):
    return sdpa_kernel(_CUDA_KERNELS) if q.is_cuda else contextlib.nullcontext()


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    with _kernels(q):
        return _tree_attention(q, k, v, mask)


def static_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grouped_mask: torch.Tensor,
                     scale: float | None = None, softcap: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over a whole static KV buffer: q [1, H, M, D]; k, v [1, Hkv, S, D];
    grouped_mask [G*M, S] with G = H / Hkv (row g*M + m is query m's mask). The G query heads
    that share a KV head are stacked as rows of that head, so K/V are never copied.

    Written as two batched matmuls and a float32 softmax rather than SDPA: for the few query
    rows of a decode step SDPA's memory-efficient kernel runs one block per KV head (2 on
    Qwen2.5) and took 38 us a layer on an H100, over a third of a 0.5B model's step. The
    matmuls take the inputs' dtype (as transformers' eager attention does: half-precision
    scores, float32 softmax, half-precision probabilities); float32 matmuls over the buffer
    took 29 us a layer there (compiled), these 9.5 (2026-11-25, 1.5B shape, 592 slots).
    ``scale`` (None: D ** -0.5), ``softcap`` and ``sinks``: as ``eager_attention``'s."""
    b, heads, m, d = q.shape
    kv_heads = k.shape[1]
    grouped = q.reshape(b, kv_heads, heads // kv_heads * m, d)
    scores = torch.matmul(grouped, k.transpose(-1, -2)).float() * (d**-0.5 if scale is None else scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~grouped_mask, float("-inf"))
    if sinks is not None:  # row g*M + m of KV head j is query head j*G + g's
        sink_rows = sinks.float().reshape(kv_heads, heads // kv_heads, 1).expand(-1, -1, m).reshape(1, kv_heads, -1, 1)
        probs = torch.cat((scores, sink_rows.expand(b, -1, -1, -1)), dim=-1).softmax(-1)[..., :-1].to(q.dtype)
    else:
        probs = scores.softmax(-1).to(q.dtype)
    return torch.matmul(probs, v).reshape(b, heads, m, v.shape[-1])


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    scale: float | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``tree_attention`` for what SDPA cannot express: Gemma 2's soft-capped scores
    (cap * tanh(scores / cap)) and its own query scaling, gpt-oss's attention sinks. transformers'
    eager attention, step for step (scores in the inputs' dtype, capped, masked, float32 softmax,
    probabilities back in the inputs' dtype); the G query heads sharing a KV head are rows of one
    matmul. ``sinks`` [H]: a logit per head joining each row's softmax as one more column, dropped
    after it (attention a row may give to nothing) — gpt-oss's softmax, as transformers computes
    it: the row's maximum taken away and the softmax in the inputs' dtype."""
    b, heads, n, d = q.shape
    kv_heads, total = k.shape[1], k.shape[2]
    if mask is None:
        rows = torch.arange(n, device=q.device).unsqueeze(1)
        mask = torch.arange(total, device=q.device).unsqueeze(0) <= rows + (total - n)
    scale = d**-0.5 if scale is None else scale
    scores = torch.matmul(q.reshape(b, kv_heads, heads // kv_heads * n, d), k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.reshape(b, kv_heads, heads // kv_heads, n, total)
    visible = (mask if mask.dim() == 3 else mask.unsqueeze(0))[:, None, None]  # [B|1, 1, 1, n, T]
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink_columns = sinks.to(scores.dtype).reshape(1, kv_heads, heads // kv_heads, 1, 1).expand(b, -1, -1, n, -1)
        combined = torch.cat((scores, sink_columns), dim=-1)
        combined = combined - combined.amax(-1, keepdim=True)
        probs = combined.softmax(-1, dtype=combined.dtype)[..., :-1].to(q.dtype)
    else:
        probs = scores.softmax(-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs.reshape(b, kv_heads, heads // kv_heads * n, total), v)
    return out.reshape(b, heads, n, v.shape[-1])  # the values' width (a latent attention's differs from the keys')


def _tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    n, total = q.shape[2], k.shape[2]
    if mask is None:
        if n == 1:
            if rows_in_float32(q):
                return _one_row_in_float32(q, k, v)
            # One new token sees everything cached: no mask needed, fastest SDPA path.
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1])
        rows = torch.arange(n, device=q.device).unsqueeze(1)
        cols = torch.arange(total, device=q.device).unsqueeze(0)
        mask = cols <= rows + (total - n)
    if mask.dim() == 2:
        mask = mask.unsqueeze(0)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), enable_gqa=q.shape[1] != k.shape[1])


# A half-precision query row on the CPU attends over its keys padded with zeros to a multiple
# of this many, the padding masked: a row's bits then depend only on its keys, not on how many
# rows share the matmuls (measured: CPU float32 matmuls give a row the same bits in a product of
# 6 or 384 rows, but a softmax or a product over 300 keys and over 320 round apart).
ROW_BUCKET = 64


def rows_in_float32(q: torch.Tensor) -> bool:
    """Whether q's one-row calls are rows_over_leading_keys: half precision on the CPU."""
    return not q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)


def row_bucket(keys: int) -> int:
    return -(-keys // ROW_BUCKET) * ROW_BUCKET


def _one_row_in_float32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One query row of a half-precision model on the CPU (a decode step; each row of a
    row-exact verification): float32 matmuls over float32 copies of the keys and values.
    CPU SDPA's one-row kernel took 4-8x as long for it (bf16, 12 heads over 150-316 keys:
    0.29-1.08 ms against 0.07-0.14, docs/results/one-row-float32-attention-2026-11-26.txt)
    and is no closer to a float32 reference. The G query
    heads sharing a KV head are rows of one matmul, so nothing is repeated."""
    return rows_over_leading_keys(q, k, v, [k.shape[2]])


def floats_of(k: torch.Tensor, v: torch.Tensor, longest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``longest`` keys and values of k, v [B, Hkv, T, D] in float32, zero-padded to
    their ROW_BUCKET: what a row over them reads."""
    padded = row_bucket(longest)
    # Only the padding is zeroed: filling all of it first cost a decode step 30-40 % more
    # memory traffic for nothing (the copy overwrites it; measured over 1,000-16,000 keys).
    keys = k.new_empty(k.shape[0], k.shape[1], padded, k.shape[-1], dtype=torch.float32)
    values = v.new_empty(v.shape[0], v.shape[1], padded, v.shape[-1], dtype=torch.float32)
    keys[:, :, :longest], values[:, :, :longest] = k[:, :, :longest], v[:, :, :longest]
    keys[:, :, longest:].zero_()
    values[:, :, longest:].zero_()
    return keys, values


def rows_over_leading_keys(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: list[int],
                           floats: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Query rows q [B, H, n, D] of a half-precision model on the CPU, row r over the first
    visible[r] keys of k, v [B, Hkv, T, D] in float32, each row with the bits it gets alone
    (every visible count in one ROW_BUCKET: the keys are padded to it). A decode step is one
    such row; a prefill's or a chain verification's rows of one bucket are one call
    (``specctl_kernels.row_exact``), where each took a call of its own. ``floats``: k and v
    made float32 once for many calls (``floats_of`` over at least the longest row): a row's
    bucket is then padded with the keys after its own rather than zeros — masked, so its bits
    are the same where this CPU's probe (``shared_floats_agree``) says so — and the per-row
    calls of a long prefill no longer copy the keys before them each (1.6-3.4x faster over
    1,000-8,000 keys, measured 2026-12-07)."""
    b, heads, n, d = q.shape
    kv_heads, longest = k.shape[1], max(visible)
    padded = row_bucket(longest)
    keys, values = floats_of(k, v, longest) if floats is None else floats
    keys, values = keys[:, :, :padded], values[:, :, :padded]
    grouped = q.reshape(b, kv_heads, heads // kv_heads * n, d).float()  # row g*n + r: head g's row r
    scores = torch.matmul(grouped, keys.transpose(-1, -2)) * d**-0.5
    hidden = torch.arange(padded, device=q.device) >= torch.tensor(visible, device=q.device).unsqueeze(1)  # [n, padded]
    scores = scores.view(b, kv_heads, heads // kv_heads, n, padded).masked_fill(hidden, float("-inf"))
    probs = scores.softmax(-1).view(b, kv_heads, -1, padded)
    return torch.matmul(probs, values).to(q.dtype).reshape(b, heads, n, v.shape[-1])


# Where a CPU gives a row other bits among more rows (batched_rows_agree says no), a row-exact
# decoder computes every row — a decode step's too — in a call of exactly this many query rows,
# zero rows padding the last: one shape, so a row's bits are the same wherever it sits
# (fixed_blocks_agree), and the rows of a prefill or a verification share calls two by two where
# each took its own. Two: a decode step's call costs 15-30 % more, a row of a verification about
# 35 % less (the 1.5B's shape, 512-8,192 keys, measured 2026-12-07; four rows cost a decode step
# up to twice as much).
ROW_BLOCK = 2


def rows_in_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: list[int], block: int,
                   floats: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``rows_over_leading_keys`` (every visible count in one ROW_BUCKET) in calls of exactly
    ``block`` query rows, the last call's missing rows zeros over the first row's keys."""
    b, heads, n, d = q.shape
    parts = []
    for start in range(0, n, block):
        rows, counts = q[:, :, start : start + block], visible[start : start + block]
        missing = block - rows.shape[2]
        if missing:
            rows = torch.cat((rows, rows.new_zeros(b, heads, missing, d)), dim=2)
            counts = counts + [counts[0]] * missing
        parts.append(rows_over_leading_keys(rows, k, v, counts, floats)[:, :, : block - missing])
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


@functools.cache
def shared_floats_agree(groups: int, head_dim: int, value_dim: int, dtype: torch.dtype) -> bool:
    """Probed once per shape: a row over keys made float32 once for many rows (a view into
    longer buffers, its bucket padded with later keys) gets the bits of its own call, as this
    CPU's float32 matmuls gave where measured (else each row copies the keys before it)."""
    gen = torch.Generator().manual_seed(1)
    for keys, total in ((1, 64), (64, 200), (150, 150), (300, 1000), (1000, 1100)):
        q = torch.randn(1, 2 * groups, 1, head_dim, generator=gen).to(dtype)  # two KV heads: their buffers' stride
        k = torch.randn(1, 2, total, head_dim, generator=gen).to(dtype)
        v = torch.randn(1, 2, total, value_dim, generator=gen).to(dtype)
        alone = rows_over_leading_keys(q, k[:, :, :keys], v[:, :, :keys], [keys])
        if not torch.equal(alone, rows_over_leading_keys(q, k, v, [keys], floats_of(k, v, total))):
            return False
    return True


@functools.cache
def batched_rows_agree(groups: int, head_dim: int, value_dim: int, dtype: torch.dtype) -> bool:
    """Probed once per shape: rows_over_leading_keys gives each of 2-64 rows whose keys end in
    one bucket the bits the row gets alone, as this CPU's float32 matmuls did where measured
    (else row_exact keeps a call per row)."""
    gen = torch.Generator().manual_seed(0)
    for rows, keys in ((2, 64), (7, 192), (33, 128), (64, 192)):  # every row's keys in the last bucket
        q = torch.randn(1, groups, rows, head_dim, generator=gen).to(dtype)
        k = torch.randn(1, 1, keys, head_dim, generator=gen).to(dtype)
        v = torch.randn(1, 1, keys, value_dim, generator=gen).to(dtype)
        visible = [keys - (r * 37) % ROW_BUCKET for r in range(rows)]
        together = rows_over_leading_keys(q, k, v, visible)
        for r in range(rows):
            if not torch.equal(together[:, :, r : r + 1], rows_over_leading_keys(q[:, :, r : r + 1], k, v, [visible[r]])):
                return False
    return True


@functools.cache
def fixed_blocks_agree(groups: int, head_dim: int, value_dim: int, dtype: torch.dtype) -> bool:
    """Probed once per shape: in calls of ROW_BLOCK rows each row gets the bits it gets alone
    in such a call, at any place in the block, over its own keys or a float32 copy of longer
    ones (rows_in_blocks), as this CPU's float32 matmuls did where measured (else row_exact
    keeps a call per row, as the kernel computes one)."""
    gen = torch.Generator().manual_seed(2)
    for keys in (64, 256, 320, 1024, 2048):  # every row's keys in the last bucket
        q = torch.randn(1, 2 * groups, ROW_BLOCK, head_dim, generator=gen).to(dtype)  # two KV heads: their stride
        k = torch.randn(1, 2, keys + 100, head_dim, generator=gen).to(dtype)
        v = torch.randn(1, 2, keys + 100, value_dim, generator=gen).to(dtype)
        visible = [keys - (r * 29) % ROW_BUCKET for r in range(ROW_BLOCK)]
        together = rows_in_blocks(q, k, v, visible, ROW_BLOCK)
        shared = rows_in_blocks(q, k, v, visible, ROW_BLOCK, floats_of(k, v, keys + 100))
        for r, count in enumerate(visible):
            alone = rows_in_blocks(q[:, :, r : r + 1], k[:, :, :count], v[:, :, :count], [count], ROW_BLOCK)
            if not (torch.equal(together[:, :, r : r + 1], alone) and torch.equal(shared[:, :, r : r + 1], alone)):
                return False
    return True
