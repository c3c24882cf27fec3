"""Released sessions' KV buffers kept for the next session of the same size, with the steps
captured over them (engine.static): a capture (and a compile for a new KV size) per session
cost more host time than a short session won back (issue 11)."""

from __future__ import annotations

import threading

from specctl.engine.kv_cache import KVCache

SPARES_PER_SIZE = 8  # buffers kept per slot count
# Kept buffers are device memory outside the KV budget: all of them together stay under this,
# the longest-kept dropped first (requests of many sizes would otherwise pile up buffers).
SPARE_BYTES = 1 << 30


class SpareCaches:
    """Released caches holding a buffer and its steps, by slot count; thread-safe, since
    caches are released from any thread (a session's close)."""

    def __init__(self, cap_bytes: int = SPARE_BYTES) -> None:
        self.by_slots: dict[int, list[KVCache]] = {}
        self.nbytes, self.cap = 0, cap_bytes
        self._serial = 0  # the order buffers were kept in (the longest-kept goes first)
        self._lock = threading.Lock()

    def take(self, slots: int) -> KVCache | None:
        """A kept cache of ``slots`` slots, no longer kept; None if there is none."""
        with self._lock:
            kept = self.by_slots.get(slots)
            spare = kept.pop() if kept else None
            self.nbytes -= spare.nbytes if spare is not None else 0
            return spare

    def keep(self, cache: KVCache) -> bool:
        """Keep a released cache's buffer (and steps) for reuse; False: not kept (the cache frees it)."""
        with self._lock:
            kept = self.by_slots.setdefault(cache.slots, [])
            if len(kept) >= SPARES_PER_SIZE or cache.nbytes > self.cap:
                return False
            while self.nbytes + cache.nbytes > self.cap:
                self._drop_oldest()
            self._serial += 1
            cache.kept_serial = self._serial
            kept.append(cache)
            self.nbytes += cache.nbytes
            return True

    def drop_all(self) -> bool:
        """Free every kept buffer (an arena's reclaimer: ranges go back); whether there was one."""
        with self._lock:
            dropped = False
            while self.nbytes:
                self._drop_oldest()
                dropped = True
            return dropped

    def _drop_oldest(self) -> None:
        oldest = min((cache for caches in self.by_slots.values() for cache in caches), key=lambda c: c.kept_serial)
        self.by_slots[oldest.slots].remove(oldest)
        self.nbytes -= oldest.nbytes
        oldest.free_buffer()
