"""One KV buffer shared by every session of a role, handed out in page-aligned slot ranges.

On CUDA with flashinfer a forward of several sessions is one batched attention call per layer
(``specctl_kernels.paged``) only if their keys and values live in one tensor it can index by
page: this arena, [layers, 2, kv_heads, slots, head_dim]. A session's cache is a contiguous
range of its slots (``KVCache`` views it with the strides of the whole arena), which the
arena's layer, seen as pages of ``PAGE`` slots ("HND": [pages, kv_heads, PAGE, head_dim]),
addresses as the pages start / PAGE .. (start + slots) / PAGE. The arena is allocated once
(the role's KV budget), as vLLM and SGLang allocate theirs: a new session takes no device
allocation, and the budget is memory the process really holds."""

from __future__ import annotations

import bisect
import threading
from typing import Callable

import torch

from specctl.engine.kv_cache import kv_slot_bytes
from specctl.errors import KVBudgetExceeded

PAGE = 16  # slots per page: flashinfer's usual page size, and KVCache's slot quantum


class KVArena:
    """The arena and its free slot ranges (first fit, neighbours merged on free)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, slots: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", planes: int = 2) -> None:
        if slots < PAGE or slots % PAGE:
            raise ValueError(f"an arena holds a positive multiple of {PAGE} slots, not {slots}")
        # Zeroed: padded static steps attend over a session's whole range, masked (no NaNs allowed).
        self.buffer = torch.zeros((num_layers, planes, num_kv_heads, slots, head_dim), dtype=dtype, device=device)
        self.slots, self.page = slots, PAGE
        self.slot_bytes = kv_slot_bytes(num_layers, num_kv_heads, head_dim, dtype, planes)
        self._free: list[tuple[int, int]] = [(0, slots)]  # (start, size), sorted by start
        self._lock = threading.Lock()
        # Called, in turn, when no free range is large enough: each may give ranges back (a static
        # decoder's spare buffers) and says whether it did.
        self.reclaimers: list[Callable[[], bool]] = []

    @classmethod
    def for_budget(cls, num_layers: int, num_kv_heads: int, head_dim: int, budget_bytes: int, dtype: torch.dtype,
                   device: torch.device | str = "cpu", planes: int = 2) -> "KVArena":
        """The largest arena within ``budget_bytes``."""
        slot_bytes = kv_slot_bytes(num_layers, num_kv_heads, head_dim, dtype, planes)
        slots = budget_bytes // slot_bytes // PAGE * PAGE
        if slots < PAGE:
            raise ValueError(f"a KV budget of {budget_bytes} bytes holds fewer than {PAGE} positions of this model "
                             f"({slot_bytes} bytes each); raise kv_budget_mb")
        return cls(num_layers, num_kv_heads, head_dim, slots, dtype, device, planes)

    @property
    def free_slots(self) -> int:
        with self._lock:
            return sum(size for _, size in self._free)

    def allocate(self, slots: int) -> int:
        """The first slot of a free range of ``slots`` (a multiple of PAGE), now taken."""
        if slots <= 0 or slots % PAGE:
            raise ValueError(f"arena ranges are positive multiples of {PAGE} slots, not {slots}")
        start = self._take(slots)
        for reclaim in self.reclaimers:
            if start is not None:
                break
            if reclaim():
                start = self._take(slots)
        if start is None:
            free = self.free_slots
            raise KVBudgetExceeded(
                f"KV arena full: a session needs {slots} contiguous positions and {free} of {self.slots} are free"
                f"{' but not in one range' if free >= slots else ''}; retry later, lower max_tokens, or raise "
                "kv_budget_mb")
        return start

    def _take(self, slots: int) -> int | None:
        with self._lock:
            for i, (start, size) in enumerate(self._free):
                if size >= slots:
                    if size == slots:
                        del self._free[i]
                    else:
                        self._free[i] = (start + slots, size - slots)
                    return start
        return None

    def free(self, start: int, slots: int) -> None:
        """Give a range back, merged with free neighbours."""
        with self._lock:
            i = bisect.bisect_left(self._free, (start, 0))
            before = self._free[i - 1] if i else None
            after = self._free[i] if i < len(self._free) else None
            if (before and before[0] + before[1] > start) or (after and start + slots > after[0]):
                raise ValueError(f"slots {start}..{start + slots} of the arena are already free")
            if before and before[0] + before[1] == start:
                start, slots, i = before[0], before[1] + slots, i - 1
                del self._free[i]
            if after and start + slots == after[0]:
                slots += after[1]
                del self._free[i]
            self._free.insert(i, (start, slots))

    def view(self, start: int, slots: int) -> torch.Tensor:
        """A range as a session's cache holds it: [layers, planes, 1, kv_heads, slots, head_dim]."""
        return self.buffer[:, :, :, start : start + slots].unsqueeze(2)

    def pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of one layer as pages, "HND": [pages, kv_heads, PAGE, head_dim] each
        (views: a page's slots are consecutive in the buffer, its heads ``slots`` apart)."""
        kv_heads, head_dim = self.buffer.shape[2], self.buffer.shape[4]
        return tuple(self.buffer[layer, i].view(kv_heads, self.slots // PAGE, PAGE, head_dim).permute(1, 0, 2, 3)
                     for i in (0, 1))
