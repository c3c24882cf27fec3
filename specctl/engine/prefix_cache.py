"""Automatic prefix caching: the KV of finished sessions' text, reused by a new session whose
prompt starts the same way (a chat's next turn, a shared system prompt, a request's n
choices), so its prefill computes only the rest — what vLLM and SGLang do automatically.

Entries are copies, not shared pages: a session's cache is one contiguous range that its
rounds gather and truncate in place, so sharing would need copy-on-write everywhere; copying
a prefix costs one pass over its bytes, against a forward of the whole model per position.
The store is least-recently-used within a byte budget; a lookup scans the entries for the
longest common prefix (a radix tree pays at thousands of entries, not at the tens a budget
of a few hundred MiB holds).

The prefix's keys and values are the ones the cached session computed (in its prefill, or
in a verification or decode step); a fresh prefill computes the same values up to rounding —
as a prefill of the same text in other chunks does: on the CPU with the 1.5B target, fp32 keys
differ by up to 4e-5 and the next token's logits by 8e-6, bf16 keys by one unit in the last
place (tests: fp32 logits within 1e-5 and every output the target alone's).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from specctl.engine.kv_cache import KVCache

MIN_REUSE = 16  # positions: a shorter prefix is not worth the lookup and the copy


@dataclass(slots=True)
class _Entry:
    tokens: np.ndarray  # [L] int64: the text whose KV is kept
    salt: str  # the namespace it was stored in (KVCache.salt): only a cache of the same salt restores it
    k: torch.Tensor  # [layers, 1, kv_heads, L, head_dim]
    v: torch.Tensor | None  # None: a latent cache's (its values are its keys)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + (self.v.nbytes if self.v is not None else 0) + self.tokens.nbytes


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # sessions that looked
    hits: int = 0  # ... and reused a prefix
    query_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # ... and not computed
    stored: int = 0  # entries kept
    evicted: int = 0  # entries dropped for room

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens two texts share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


class PrefixCache:
    """One decoder's store of prefixes (its compute thread restores and stores; the lock
    keeps a stats reader on the event loop consistent)."""

    def __init__(self, budget_bytes: int, min_reuse: int = MIN_REUSE) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"a prefix cache needs a positive budget, not {budget_bytes} bytes")
        self.budget_bytes, self.min_reuse = budget_bytes, max(1, min_reuse)
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # oldest first
        self._next_key = 0
        self.used_bytes = 0
        self.stats = PrefixCacheStats()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def restore(self, prompt: list[int], cache: KVCache) -> int:
        """Copy into the empty ``cache`` the KV of the longest cached prefix of the prompt, all
        but its last token (the prefill computes at least that one: its logits are the first
        token's); the positions restored are committed. Returns how many (0: none)."""
        if cache.length:
            raise ValueError(f"a prefix is restored into an empty cache, not one of length {cache.length}")
        with self._lock:
            self.stats.queries += 1
            self.stats.query_tokens += len(prompt)
            best, best_len = self._longest(prompt, cache.salt)
            if best is None:
                return 0
            entry = self._entries[best]
            self._entries.move_to_end(best)
            self.stats.hits += 1
            self.stats.hit_tokens += best_len
        cache.check_room(best_len)
        cache.k[:, :, :, :best_len].copy_(entry.k[:, :, :, :best_len])
        if entry.v is not None:
            cache.v[:, :, :, :best_len].copy_(entry.v[:, :, :, :best_len])
        cache.commit(best_len)
        return best_len

    def held(self, prompt: list[int], salt: str = "") -> int:
        """How many of the prompt's positions a restore into a cache salted ``salt`` would copy
        now (0: none); counts nothing."""
        with self._lock:
            return self._longest(prompt, salt)[1]

    def _longest(self, prompt: list[int], salt: str) -> tuple[int | None, int]:
        """(the entry of ``salt`` sharing the longest start with all but the prompt's last token,
        how much), or (None, 0) below ``min_reuse``; under the lock."""
        tokens = np.asarray(prompt[:-1], dtype=np.int64)
        best, best_len = None, 0
        for key, entry in self._entries.items():
            n = common_prefix(entry.tokens, tokens) if entry.salt == salt else 0
            if n > best_len:
                best, best_len = key, n
        return (best, best_len) if best_len >= self.min_reuse else (None, 0)

    def store(self, text: list[int], cache: KVCache) -> None:
        """Keep a copy of the KV of ``text``, which the cache's first positions hold (a
        finished session's committed text; positions past it, if any, are not kept). An entry
        that is a prefix of this one goes (this one serves whatever it served); a text that
        an entry already holds is not kept twice — both within the cache's salt."""
        length = min(len(text), cache.length)
        if length < self.min_reuse:
            return
        tokens = np.asarray(text[:length], dtype=np.int64)
        planes = 1 if cache.shared else 2
        nbytes = planes * cache.k[:, :, :, :length].numel() * cache.k.element_size() + tokens.nbytes
        if nbytes > self.budget_bytes:
            return
        with self._lock:
            for key, entry in list(self._entries.items()):
                if entry.salt != cache.salt:
                    continue
                shared = common_prefix(entry.tokens, tokens)
                if shared == length:  # held already (the same text, or a longer one)
                    self._entries.move_to_end(key)
                    return
                if shared == len(entry.tokens):
                    self._drop(key)
            while self._entries and self.used_bytes + nbytes > self.budget_bytes:
                self._drop(next(iter(self._entries)))
                self.stats.evicted += 1
        entry = _Entry(tokens, cache.salt, cache.k[:, :, :, :length].clone(),
                       None if cache.shared else cache.v[:, :, :, :length].clone())
        with self._lock:
            self._entries[self._next_key] = entry
            self._next_key += 1
            self.used_bytes += entry.nbytes
            self.stats.stored += 1

    def _drop(self, key: int) -> None:
        self.used_bytes -= self._entries.pop(key).nbytes

    def clear(self) -> tuple[int, int]:
        """Drop every entry: (entries, bytes) dropped."""
        with self._lock:
            dropped = len(self._entries), self.used_bytes
            self._entries.clear()
            self.used_bytes = 0
        return dropped

    def snapshot(self) -> dict:
        """Stats for the stats feed and /metrics: counters, entries and bytes held."""
        with self._lock:
            return {**self.stats.to_dict(), "entries": len(self._entries), "bytes": self.used_bytes,
                    "budget_bytes": self.budget_bytes}


def flush_prefix_cache(decoder) -> tuple[int, int]:
    """A model's prefix cache emptied: (entries, bytes) dropped, (0, 0) without one. Entries
    are copies, never a running session's cache, so it may run at any time."""
    store = getattr(decoder, "prefix_cache", None)
    return store.clear() if store is not None else (0, 0)


def prefix_cache_stats(decoder) -> dict:
    """A role's stats-feed entries for its model's prefix cache (none without one): the share of
    prompt tokens it served (vLLM's prefix cache hit rate), their counts, and the MiB it holds."""
    store = getattr(decoder, "prefix_cache", None)
    if store is None:
        return {}
    s = store.snapshot()
    return {"prefix_cache_hit_rate": round(s["hit_tokens"] / s["query_tokens"], 4) if s["query_tokens"] else 0.0,
            "prefix_cache_hit_tokens": s["hit_tokens"], "prefix_cache_query_tokens": s["query_tokens"],
            "prefix_cache_entries": s["entries"], "prefix_cache_mb": round(s["bytes"] / 2**20, 2)}
