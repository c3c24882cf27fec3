"""Attention kernels for specctl: one entry point, ``tree_attention``, two backends.

- ``torch``: SDPA with a boolean mask. Runs everywhere; the CPU path and the test oracle.
- ``flashinfer``: custom-mask prefill on CUDA (``pip install specctl[cuda]``).

The backend is chosen once from the device and what is installed (``select_backend``),
or forced by the profile's ``attention_backend``."""

from __future__ import annotations

import functools
import logging
from typing import Callable

import torch

from specctl_kernels import torch_backend
from specctl_kernels.torch_backend import eager_attention, static_attention

BACKENDS = ("auto", "torch", "flashinfer")

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def flashinfer_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
FLASHINFER_HEAD_DIMS = (64, 128, 256)
log = logging.getLogger("specctl.kernels")


def select_backend(requested: str, device: torch.device | str, dtype: torch.dtype | None = None,
                   head_dim: int | None = None, softcap: float | None = None, window: int | None = None,
                   sinks: bool = False) -> str:
    """Resolve ``auto`` to a concrete backend; refuse one that cannot run here. flashinfer has
    kernels for fp16/bf16 and head dims 64/128/256 only, and specctl calls it without a score
    cap (``softcap``: Gemma 2's), a sliding ``window`` or attention ``sinks`` (gpt-oss's): ``auto``
    then falls back to torch."""
    if requested not in BACKENDS:
        raise ValueError(f"unknown attention backend {requested!r}: one of {', '.join(BACKENDS)}")
    is_cuda = torch.device(device).type == "cuda"
    unsupported = None
    if dtype is not None and dtype not in FLASHINFER_DTYPES:
        unsupported = f"{str(dtype).removeprefix('torch.')} (it has fp16/bf16 kernels only)"
    elif head_dim is not None and head_dim not in FLASHINFER_HEAD_DIMS:
        unsupported = f"head dim {head_dim} (it has {', '.join(map(str, FLASHINFER_HEAD_DIMS))})"
    elif softcap is not None:
        unsupported = "soft-capped attention scores (Gemma 2; specctl passes it no cap)"
    elif window is not None:
        unsupported = "sliding-window layers (specctl passes it no window)"
    elif sinks:
        unsupported = "attention sinks (gpt-oss; specctl passes it none)"
    if requested == "auto":
        if not (is_cuda and flashinfer_available()):
            return "torch"
        if unsupported:
            log.info("attention: torch SDPA, since flashinfer has no kernels for %s", unsupported)
            return "torch"
        return "flashinfer"
    if requested == "flashinfer":
        if not (is_cuda and flashinfer_available()):
            raise ValueError("attention backend 'flashinfer' needs a CUDA device and `pip install flashinfer-python`")
        if unsupported:
            raise ValueError(f"attention backend 'flashinfer' has no kernels for {unsupported}; use attention_backend "
                             "= 'auto' or 'torch'")
    return requested


def get_attention(backend: str, scale: float | None = None, softcap: float | None = None,
                  sinks: torch.Tensor | None = None) -> AttentionFn:
    """``backend``'s attention; with a query ``scale`` (None: head_dim ** -0.5), a score
    ``softcap`` or attention ``sinks`` (a logit per head), the eager attention that applies them
    (torch only)."""
    if scale is not None or softcap is not None or sinks is not None:
        if backend != "torch":
            raise ValueError(f"attention backend {backend!r} takes no score scale, cap or sinks: use 'torch'")
        return functools.partial(torch_backend.eager_attention, scale=scale, softcap=softcap, sinks=sinks)
    if backend == "torch":
        return torch_backend.tree_attention
    if backend == "flashinfer":
        from specctl_kernels import flashinfer_backend

        return flashinfer_backend.tree_attention
    raise ValueError(f"no concrete attention backend {backend!r}")


def warm_up(backend: str, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
            device: torch.device | str) -> bool:
    """Run ``backend``'s attention once at a model's shapes, so that a backend that compiles its
    kernels on first use (flashinfer's JIT: minutes the first time on a machine, cached after)
    does it while the model loads rather than in the first request. Returns whether it ran:
    only flashinfer needs it."""
    if backend != "flashinfer":
        return False
    q = torch.zeros(1, num_heads, 2, head_dim, dtype=dtype, device=device)
    kv = torch.zeros(1, num_kv_heads, 4, head_dim, dtype=dtype, device=device)
    get_attention(backend)(q, kv, kv, None)  # every call takes the custom-mask kernel: this one
    torch.cuda.synchronize(device)
    return True


def row_exact(attend: AttentionFn, prefill: bool = False) -> AttentionFn:
    """``attend`` with every masked query row computed exactly as a one-token decode step
    computes it: ``attend`` of that row alone over just its visible keys, in cache order
    (for a chain the cache's first keys, a view; for a tree node the prefix, its ancestors
    and itself, gathered). Unmasked calls (a prefill, a decode step) pass straight through,
    unless ``prefill``: then a prefill's rows too (each over the keys before it and its own),
    so every position's keys and values are what AR decoding computes whatever computed
    them — a prefill of the whole text, of a chunk after a restored prefix, decode steps or
    verifications — which is what makes a restored prefix exact (engine.prefix_cache).

    Why: an attention kernel's result for one row depends, in the last bits, on how many
    rows share the call (CPU SDPA: 1 vs 7 query rows differ by ~4e-7). Where the linear
    layers are row-independent (bf16, fp16, row-scaled int8 on CPU) that is the only thing
    that made a verified token's hidden state differ from the one AR decoding computes, and
    bf16 rounding or int8 quantization amplified it until greedy outputs diverged. With this
    a verification forward reproduces AR bit for bit. It costs one kernel call per row and
    layer (chain of 7 over 300 keys on one core: 1.1 ms a layer vs 0.45 ms masked) — except
    for torch attention in half precision on the CPU, where a one-row call is
    ``torch_backend.rows_over_leading_keys``: there the rows over a leading run of keys in one
    64-key bucket (a prefill's, a chain's) share a call, each with its bits alone where this
    CPU's probe (``batched_rows_agree``) says so (a 512-token prefill of the 1.5B 2.7 -> 1.9 s);
    where it does not, every row — a decode step's too — is computed in a call of exactly
    ``torch_backend.ROW_BLOCK`` rows where calls of that one shape give a row its bits anywhere
    in it (``fixed_blocks_agree``; ``rows_in_blocks``: the 1.5B's 11-token verification 324 ->
    293 ms, a 1,024-token prefill 12.9 -> 10.9 s on such a host, medians), else each row keeps a call but
    all of them read one float32 copy of the keys (``shared_floats_agree``; a 1,500-token
    prefill of the 1.5B 25-26 -> 19 s on such a host)."""

    # torch attention's one-row calls in half precision on the CPU are rows_over_leading_keys,
    # so the rows over a leading run of keys in one bucket can share a call
    batchable = attend is torch_backend.tree_attention or attend is tree_attention

    def sharing(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[bool, int, bool]:
        """How this CPU lets half-precision rows share work (False, 0, False elsewhere), probed
        per shape: rows of one key bucket in one call (batched_rows_agree); where that fails,
        every row — a decode step's too — in calls of ROW_BLOCK rows (fixed_blocks_agree, else
        0: a call a row); one float32 copy of the keys read by many calls (shared_floats_agree)."""
        if not (batchable and torch_backend.rows_in_float32(q)):
            return False, 0, False
        shape = (q.shape[1] // k.shape[1], q.shape[-1], v.shape[-1], q.dtype)
        batched = torch_backend.batched_rows_agree(*shape)
        block = torch_backend.ROW_BLOCK if not batched and torch_backend.fixed_blocks_agree(*shape) else 0
        return batched, block, torch_backend.shared_floats_agree(*shape)

    def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        batched, block, shared_floats = sharing(q, k, v)
        if mask is None:
            if block and q.shape[2] == 1:  # a decode step: its row in a block, as every other row
                return torch_backend.rows_in_blocks(q, k, v, [k.shape[2]], block)
            if not prefill or q.shape[2] == 1:
                return attend(q, k, v, None)
            mask = causal_mask(q.shape[2], k.shape[2], q.device)
        if mask.dim() == 3:
            if mask.shape[0] > 1:
                return torch.cat([attend_rows(q[b : b + 1], k[b : b + 1], v[b : b + 1], mask[b])
                                  for b in range(mask.shape[0])])
            mask = mask[0]
        visible = mask.sum(1).tolist()
        leading = mask.long().cumprod(1).sum(1).tolist()  # each row's run of the cache's first keys
        # Rows that see more than their leading run (tree nodes: the prefix, then their
        # ancestors) read a scratch buffer: the run all of them share is copied once, and
        # each row writes only its few keys after it (gathering every row's keys whole
        # copied the prefix once per row and layer: most of row-exact attention's cost).
        scattered = [i for i, (count, run) in enumerate(zip(visible, leading)) if run != count]
        shared = min((leading[i] for i in scattered), default=0)
        # Where a row's bits do not change with what pads its bucket (shared_floats_agree), the
        # scratch is float32 and each row's call reads it as it is: each made a float32 copy of
        # the whole prefix before.
        scratch = None
        if scattered and shared_floats:
            scratch = torch_backend.floats_of(k, v, max(visible[i] for i in scattered))
        elif scattered:
            longest = max(visible[i] for i in scattered)
            k_rows = k.new_empty(k.shape[0], k.shape[1], longest, k.shape[3])
            v_rows = v.new_empty(v.shape[0], v.shape[1], longest, v.shape[3])
            k_rows[:, :, :shared], v_rows[:, :, :shared] = k[:, :, :shared], v[:, :, :shared]
        rows: list[torch.Tensor | None] = [None] * q.shape[2]
        runs: dict[int, list[int]] = {}  # rows reading the cache's first keys, by key bucket
        if batched or block:
            for i, count in enumerate(visible):
                if leading[i] == count:
                    runs.setdefault(torch_backend.row_bucket(count), []).append(i)
        # several blocks read one float32 copy of the keys (the block probe tried it), not one each
        floats = None
        if block and sum(-(-len(batch) // block) for batch in runs.values()) > 1:
            floats = torch_backend.floats_of(k, v, max(visible[i] for batch in runs.values() for i in batch))
        for batch in runs.values():  # a bucket's rows in one call (or blocks), each with its bits alone
            index = torch.tensor(batch, device=q.device)
            counts = [visible[i] for i in batch]
            together = (torch_backend.rows_in_blocks(q.index_select(2, index), k, v, counts, block, floats) if block
                        else torch_backend.rows_over_leading_keys(q.index_select(2, index), k, v, counts))
            for j, i in enumerate(batch):
                rows[i] = together[:, :, j : j + 1]
        # The other rows over the cache's first keys (a prefill's where the probe above said
        # no): over keys made float32 once for all of them, where this CPU's probe agrees.
        lone = [count for count, run, row in zip(visible, leading, rows) if run == count and row is None]
        if lone and shared_floats:
            floats = torch_backend.floats_of(k, v, max(lone))
        for i, count in enumerate(visible):
            if rows[i] is not None:
                continue
            if leading[i] == count and floats is not None:
                rows[i] = torch_backend.rows_over_leading_keys(q[:, :, i : i + 1], k, v, [count], floats)
                continue
            if leading[i] == count:  # the cache's first keys: a view, as AR reads them
                keys, values = k[:, :, :count], v[:, :, :count]
            else:
                after = mask[i, shared:].nonzero().squeeze(1) + shared
                if scratch is not None:  # its keys after the shared run, written over the last row's
                    scratch[0][:, :, shared:count], scratch[1][:, :, shared:count] = k[:, :, after], v[:, :, after]
                    rows[i] = (torch_backend.rows_in_blocks(q[:, :, i : i + 1], k, v, [count], block, scratch)
                               if block else
                               torch_backend.rows_over_leading_keys(q[:, :, i : i + 1], k, v, [count], scratch))
                    continue
                k_rows[:, :, shared:count] = k.index_select(2, after)
                v_rows[:, :, shared:count] = v.index_select(2, after)
                keys, values = k_rows[:, :, :count], v_rows[:, :, :count]
            rows[i] = (torch_backend.rows_in_blocks(q[:, :, i : i + 1], keys, values, [count], block) if block
                       else attend(q[:, :, i : i + 1], keys, values, None))
        return torch.cat(rows, dim=2)

    attend_rows.__wrapped__ = attend  # what it wraps, as functools.wraps records it
    return attend_rows


def tree_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, backend: str = "torch"
) -> torch.Tensor:
    """Attention of n new queries over T keys with an arbitrary boolean mask.

    q: [B, H, n, D]; k, v: [B, Hkv, T, D] (H a multiple of Hkv: grouped-query attention);
    mask: [n, T] or [B, n, T], True where query i may attend to key j; None = causal over
    the last n keys (the first T-n keys are the cached prefix). Returns [B, H, n, D]."""
    return get_attention(backend)(q, k, v, mask)


def causal_mask(n: int, total: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean mask of n new tokens appended after total-n cached ones (causal)."""
    past = total - n
    rows = torch.arange(n, device=device).unsqueeze(1)
    cols = torch.arange(total, device=device).unsqueeze(0)
    return cols <= rows + past


__all__ = ["BACKENDS", "causal_mask", "eager_attention", "flashinfer_available", "get_attention", "row_exact", "select_backend",
           "static_attention", "tree_attention", "warm_up"]
