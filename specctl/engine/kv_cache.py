"""Per-session KV cache with a shared memory budget.

A session reserves its whole capacity (prompt + max new tokens + speculation slack) when
it opens, so a full budget refuses a new session up front with a clear error instead of
failing one that is already streaming (StarSD's admission rule N_max, in bytes)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable

import torch

from specctl.errors import KVBudgetExceeded

if TYPE_CHECKING:
    from specctl.engine.kv_arena import KVArena


def kv_slot_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, planes: int = 2) -> int:
    """Bytes one cache position takes: a key and a value per layer and KV head (``planes`` 1:
    one vector both read, a latent cache's)."""
    return planes * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


class KVPool:
    """Byte budget shared by the KV caches of one role (None = unlimited)."""

    def __init__(self, budget_bytes: int | None = None) -> None:
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self.sessions = 0
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> None:
        with self._lock:
            if self.budget_bytes is not None and self.used_bytes + nbytes > self.budget_bytes:
                raise KVBudgetExceeded(
                    f"KV cache budget exhausted: {self.used_bytes / 2**20:.1f} MiB of "
                    f"{self.budget_bytes / 2**20:.1f} MiB in use and this session needs {nbytes / 2**20:.1f} MiB; "
                    "retry later, lower max_tokens, or raise kv_budget_mb"
                )
            self.used_bytes += nbytes
            self.sessions += 1

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.used_bytes -= nbytes
            self.sessions -= 1


class KVCache:
    """Keys and values of one session for a range of layers: [layers, 1, kv_heads, slots, head_dim].
    With ``planes`` 1 (a latent cache: engine.latent) ``k`` and ``v`` are one tensor: a value is
    the front of its key, written once.

    ``length`` positions are valid. ``slots`` = capacity + a trash slot, rounded up to 16
    or as given (padded static steps write their padding rows to ``trash`` and attend over
    all slots, masked, so the buffer starts zeroed: stale memory must not hold NaNs; a
    ``spare``'s buffer, left by a released session, holds finite values). A forward writes its n
    new positions at [length, length+n) in every layer and then ``commit(n)``s them;
    ``truncate`` and ``gather`` drop positions. With an ``arena`` (engine.kv_arena) the buffer
    is a range of it, taken at open and given back when the buffer is let go."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        pool: KVPool | None = None,
        slots: int | None = None,
        spare: "KVCache | None" = None,
        arena: "KVArena | None" = None,
        planes: int = 2,
    ) -> None:
        self.released = True  # until the reservation succeeds, there is nothing to give back
        self.recycle: Callable[[KVCache], bool] | None = None  # takes a released cache's buffer for reuse
        # the prefix cache's namespace for this session (vLLM's cache_salt): it restores and stores
        # only among caches of the same salt
        self.salt = ""
        self.slots = spare.slots if spare is not None else slots or -(-(capacity + 1) // 16) * 16
        if capacity + 1 > self.slots:
            raise ValueError(f"a cache of {self.slots} slots holds at most {self.slots - 1} positions, not {capacity}")
        self.trash = self.slots - 1
        self.nbytes = self.slots * kv_slot_bytes(num_layers, num_kv_heads, head_dim, dtype, planes)
        self.pool = pool
        self.arena, self.start = None, 0  # a range of a shared arena (engine.kv_arena), or a buffer of its own
        if pool is not None:
            pool.reserve(self.nbytes)
        if spare is None:
            self.steps: dict = {}  # bucket -> engine.static_step.StepGraph (its CUDA graph bakes in kv's address)
            if arena is None:
                # Keys and values in one buffer [layers, planes, 1, kv_heads, slots, head_dim]: a static
                # step writes both of a layer in one kernel (``k`` and ``v`` are views of it).
                self.kv = torch.zeros((num_layers, planes, 1, num_kv_heads, self.slots, head_dim), dtype=dtype,
                                      device=device)
            else:
                try:
                    self.start = arena.allocate(self.slots)
                except BaseException:
                    if pool is not None:
                        pool.release(self.nbytes)
                    raise
                self.arena, self.kv = arena, arena.view(self.start, self.slots)
                self.kv.zero_()  # a released session's keys must not leak into this one's padded steps
        else:
            # A released session's buffer (or arena range) and the steps captured over it move to
            # this cache; the old object keeps nothing, so a stale holder of it fails as on any
            # released cache.
            self.kv, self.steps, self.arena, self.start = spare.kv, spare.steps, spare.arena, spare.start
            spare.arena = None  # the range is this cache's now: the spare must not give it back
            spare.free_buffer()
            for step in self.steps.values():
                step.cache = self
        self.shared = self.kv.shape[1] == 1  # one plane: the values are the keys (no second write or move)
        self.k, self.v = self.kv[:, 0], self.kv[:, -1]
        self.capacity = capacity
        self.length = 0
        self.released = False

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store [1, Hkv, n, D] new keys/values after the committed ones; return all keys/values."""
        n = k_new.shape[2]
        end = self.length + n
        self.check_room(n)
        self.k[layer, :, :, self.length : end] = k_new
        if not self.shared:
            self.v[layer, :, :, self.length : end] = v_new
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def check_room(self, n: int) -> None:
        if self.length + n > self.capacity:
            raise KVBudgetExceeded(
                f"session KV cache full ({self.capacity} positions): the prompt plus generated tokens "
                "exceed what the session reserved"
            )

    def commit(self, n: int) -> None:
        self.length += n

    def skip(self, n: int) -> None:
        """Take n positions without writing them: rows of a dead pipeline forward, pruned
        before anything attends to them (only their count keeps every stage's cache order)."""
        self.check_room(n)
        self.length += n

    def place(self, start: int, rows: list[int], n: int) -> None:
        """The positions just committed from ``start`` are rows ``rows`` (ascending) of n new
        ones: move them to those rows and take the others unwritten (a pipeline forward's
        dead rows, see ``skip``), so the cache keeps the order of the n."""
        if self.length != start + len(rows) or (rows and not (0 <= rows[0] and rows[-1] < n)):
            raise ValueError(f"cannot place {len(rows)} positions at {start} as rows of {n} (length {self.length})")
        self.check_room(n - len(rows))
        if rows != list(range(len(rows))):
            dst = torch.tensor(rows, dtype=torch.long, device=self.k.device) + start
            end = start + len(rows)
            self.k.index_copy_(3, dst, self.k[:, :, :, start:end].clone())
            if not self.shared:
                self.v.index_copy_(3, dst, self.v[:, :, :, start:end].clone())
        self.length = start + n

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length

    def gather(self, keep: torch.Tensor | list[int]) -> None:
        """Keep only the given positions (ascending), compacted to the front (tree pruning)."""
        keep = torch.as_tensor(keep, dtype=torch.long)
        if keep.numel() and int(keep.max()) >= self.length:
            raise ValueError(f"gather index {int(keep.max())} beyond cache length {self.length}")
        # Positions kept in place at the front need no copy: move only the tail.
        moved = (keep != torch.arange(keep.numel())).nonzero()
        prefix = int(moved[0]) if moved.numel() else keep.numel()
        if prefix < keep.numel():
            src = keep[prefix:].to(self.k.device)
            end = keep.numel()
            self.k[:, :, :, prefix:end] = self.k.index_select(3, src)
            if not self.shared:
                self.v[:, :, :, prefix:end] = self.v.index_select(3, src)
        self.length = keep.numel()

    def release(self) -> None:
        """Give the budget back; the buffer goes to ``recycle`` if it takes it (a static
        decoder keeps buffers with their captured steps for the next session), else is freed.
        A stale position written after this fails: the capacity is 0."""
        if self.released:
            return
        self.released = True
        if self.pool is not None:
            self.pool.release(self.nbytes)
        self.length = self.capacity = 0
        keep, self.recycle = self.recycle, None
        if keep is None or not keep(self):
            self.free_buffer()

    def free_buffer(self) -> None:
        """Let go of the buffer and the steps captured over it (a released cache's, or one
        whose buffer moved to a new cache)."""
        self.steps = {}
        self.kv = self.k = self.v = torch.empty(0)
        arena, self.arena = self.arena, None
        if arena is not None:
            arena.free(self.start, self.slots)

    def __del__(self) -> None:  # a dropped session must give its budget back (its buffer is not kept)
        self.recycle = None
        self.release()
