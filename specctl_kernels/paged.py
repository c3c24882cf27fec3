"""Batched attention over a paged KV arena: every session of a forward in one call per layer.

A forward's sessions each hold a range of one arena (``specctl.engine.kv_arena``); their
new tokens' queries are concatenated (``qo_indptr``), and each session's keys are the first
``kv_len`` slots of its range, listed as pages (``kv_indptr``, ``kv_indices``,
``last_page_len``: flashinfer's page table). The plan is made once per forward, from the
sessions' ranges, lengths and masks, and serves every layer (the lengths do not change
between layers: a forward commits its positions after the last one).

Two backends: ``flashinfer`` (``BatchPrefillWithPagedKVCacheWrapper``, planned once, run per
layer) and ``torch``, which reads the same page table with SDPA one session at a time: the
reference the CPU tests check the page table with, and the oracle of the GPU tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specctl_kernels import causal_mask, torch_backend
from specctl_kernels.flashinfer_backend import rows_per_call  # pure: imports no flashinfer

PAGED_BACKENDS = ("torch", "flashinfer")


@dataclass(frozen=True, slots=True)
class PagePlan:
    """The page table of one forward (int32, on the host; see the module's docstring)."""

    qo_indptr: torch.Tensor  # [B + 1]: session b's queries are rows qo_indptr[b]..qo_indptr[b + 1]
    kv_indptr: torch.Tensor  # [B + 1]: its pages are kv_indices[kv_indptr[b]..kv_indptr[b + 1]]
    kv_indices: torch.Tensor  # [pages]
    last_page_len: torch.Tensor  # [B]: slots used in its last page, 1..page
    kv_lens: tuple[int, ...]
    masks: tuple[torch.Tensor | None, ...]  # [n_b, kv_len_b] each; None = causal
    page: int

    def flat_mask(self, device: torch.device | str) -> torch.Tensor:
        """Every session's mask, causal ones written out, flattened and concatenated (flashinfer's
        ``custom_mask``: one kernel for decode and verification alike, see flashinfer_backend)."""
        n = (self.qo_indptr[1:] - self.qo_indptr[:-1]).tolist()
        return torch.cat([(causal_mask(rows, kv_len, device) if mask is None else mask.to(device)).reshape(-1)
                          for rows, kv_len, mask in zip(n, self.kv_lens, self.masks)])


def plan_pages(starts: list[int], kv_lens: list[int], new_tokens: list[int], masks: list[torch.Tensor | None],
               page: int, rows_per_request: list[int] | None = None) -> PagePlan:
    """The page table of sessions whose ranges begin at slot ``starts`` (multiples of ``page``),
    attending over their first ``kv_lens`` slots with ``new_tokens`` queries each. With
    ``rows_per_request``, session b's queries become requests of at most that many rows over the
    same pages, each with its rows of the mask (a causal one written out): the same rows in the
    same order, in requests flashinfer gives the decode step's query tile (see
    flashinfer_backend.rows_per_call)."""
    if any(start % page for start in starts):
        raise ValueError(f"session ranges must begin on a page ({page} slots): {starts}")
    if any(n < 1 or kv_len < n for n, kv_len in zip(new_tokens, kv_lens)):
        raise ValueError(f"each session needs 1 <= new tokens <= keys: {new_tokens} over {kv_lens}")
    shaped = []
    for n, kv_len, mask in zip(new_tokens, kv_lens, masks):
        if mask is not None and mask.numel() != n * kv_len:
            raise ValueError(f"a mask of shape {tuple(mask.shape)} for {n} queries over {kv_len} keys")
        shaped.append(None if mask is None else mask.reshape(n, kv_len))
    requests = []  # (start, kv_len, rows, mask)
    for b, (start, kv_len, n, mask) in enumerate(zip(starts, kv_lens, new_tokens, shaped)):
        step = n if rows_per_request is None else rows_per_request[b]
        if step >= n:
            requests.append((start, kv_len, n, mask))
            continue
        full = causal_mask(n, kv_len) if mask is None else mask
        requests += [(start, kv_len, min(step, n - lo), full[lo : lo + step]) for lo in range(0, n, step)]
    counts = [-(-kv_len // page) for _, kv_len, _, _ in requests]
    indices = [torch.arange(start // page, start // page + count, dtype=torch.int32)
               for (start, _, _, _), count in zip(requests, counts)]
    return PagePlan(
        qo_indptr=_indptr([rows for _, _, rows, _ in requests]), kv_indptr=_indptr(counts),
        kv_indices=torch.cat(indices),
        last_page_len=torch.tensor([kv_len - (count - 1) * page for (_, kv_len, _, _), count in zip(requests, counts)],
                                   dtype=torch.int32),
        kv_lens=tuple(kv_len for _, kv_len, _, _ in requests), masks=tuple(mask for *_, mask in requests), page=page)


def _indptr(sizes: list[int]) -> torch.Tensor:
    return torch.tensor([0, *sizes], dtype=torch.int32).cumsum(0, dtype=torch.int32)


def paged_reference(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, plan: PagePlan) -> torch.Tensor:
    """q [N, H, D] (sessions' queries concatenated); k_pages, v_pages [pages, Hkv, page, D].
    Returns [N, H, D]: each session's queries attending over its pages with its mask."""
    out = torch.empty_like(q)
    kv_heads, dim = k_pages.shape[1], k_pages.shape[3]
    for b, (kv_len, mask) in enumerate(zip(plan.kv_lens, plan.masks)):
        lo, hi = plan.qo_indptr[b : b + 2].tolist()
        first, last = plan.kv_indptr[b : b + 2].tolist()
        pages = plan.kv_indices[first:last].to(k_pages.device)

        def slots(cache: torch.Tensor) -> torch.Tensor:  # [1, Hkv, kv_len, D]
            return cache.index_select(0, pages).transpose(0, 1).reshape(kv_heads, -1, dim)[None, :, :kv_len]

        rows = q[lo:hi].transpose(0, 1)[None]  # [1, H, n, D]
        # A causal session cut into requests carries its rows of a mask built on the host.
        mask = None if mask is None else mask.to(q.device)
        out[lo:hi] = torch_backend.tree_attention(rows, slots(k_pages), slots(v_pages), mask)[0].transpose(0, 1)
    return out


class PagedAttention:
    """A decoder's batched attention over its arena (``buffer`` [layers, 2, Hkv, slots, D],
    ``page``, ``pages(layer)``): ``plan`` once per forward, then ``attend`` per layer. One per
    decoder (flashinfer's wrapper holds a plan's state)."""

    def __init__(self, backend: str, arena) -> None:
        if backend not in PAGED_BACKENDS:
            raise ValueError(f"unknown paged attention backend {backend!r}: one of {', '.join(PAGED_BACKENDS)}")
        self.backend, self.arena = backend, arena
        self._batch = None
        if backend == "flashinfer":
            from specctl_kernels.flashinfer_backend import BatchPaged

            self._batch = BatchPaged(arena.buffer.device)
        self.plans = 0  # forwards planned, for the tests

    def plan(self, starts: list[int], kv_lens: list[int], new_tokens: list[int], masks: list[torch.Tensor | None],
             num_heads: int) -> "PlannedForward":
        self.plans += 1
        return self._plan(starts, kv_lens, new_tokens, masks, num_heads)

    def _plan(self, starts: list[int], kv_lens: list[int], new_tokens: list[int], masks: list[torch.Tensor | None],
              num_heads: int) -> "PlannedForward":
        buffer = self.arena.buffer
        steps = None
        if self._batch is not None:
            steps = [rows_per_call(n, num_heads // buffer.shape[2]) for n in new_tokens]
        page_plan = plan_pages(starts, kv_lens, new_tokens, masks, self.arena.page, steps)
        if self._batch is not None:
            self._batch.plan(page_plan, num_heads, buffer.shape[2], buffer.shape[4], buffer.dtype)
        return PlannedForward(self, page_plan)

    def attend(self, layer: int, q: torch.Tensor, plan: PagePlan) -> torch.Tensor:
        """q [1, H, N, D] (every session's new rows, in order) -> [1, H, N, D], ``plan`` being the
        one made last (flashinfer's wrapper holds it)."""
        rows = q[0].transpose(0, 1).contiguous()  # [N, H, D]: a small copy
        k_pages, v_pages = self.arena.pages(layer)
        if self._batch is not None:
            out = self._batch.run(rows, k_pages, v_pages)
        else:
            out = paged_reference(rows, k_pages, v_pages, plan)
        return out.transpose(0, 1)[None]

    def warm_up(self, num_heads: int) -> None:
        """One batched call at the model's shapes: flashinfer compiles its batch kernels on
        first use (see specctl_kernels.warm_up). It reads the arena's first page, writes nothing."""
        buffer = self.arena.buffer
        q = torch.zeros(1, num_heads, 2, buffer.shape[4], dtype=buffer.dtype, device=buffer.device)
        self._plan([0], [2], [2], [None], num_heads).attend(0, q)  # not a forward: not counted


@dataclass(frozen=True, slots=True)
class PlannedForward:
    """One forward's plan, as the layers use it (``Segments.paged``)."""

    owner: PagedAttention
    plan: PagePlan

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        return self.owner.attend(layer, q, self.plan)
