"""What a pipeline stage computes: its layers over a micro-batch of sessions, and each
session's KV for those layers. Runs on the stage's compute thread, one message at a time
in arrival order, so a session's pruning always lands before its next forward.

A forward declared dead (StageDrop, read on arrival ahead of the compute queue) is not
computed: its rows take their KV positions unwritten and it goes on hollow, so every
stage's cache keeps stage 1's order; the pruning that follows it removes those rows before
any live row could attend to them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specctl.engine.kv_cache import KVCache, KVPool
from specctl.engine.model import Decoder, ragged_bounds
from specctl.errors import BadRequest
from specctl.net.protocol import StageDrop, StageForward, StageKeep, StageOpen, StageOutput, Tensor


def full_mask(tail_mask: torch.Tensor | None, cached: int) -> torch.Tensor | None:
    """The attention mask over (cached + n new tokens) from its last k columns [n, k] (k >= n:
    the new tokens among themselves, and for a growing tree also the tree nodes cached
    before them); the columns before those see everything (the committed prefix)."""
    if tail_mask is None:
        return None
    n, k = tail_mask.shape
    if not n <= k <= cached + n:
        raise BadRequest(f"a stage mask of {k} columns for {n} new tokens over {cached} cached")
    return torch.cat([torch.ones(n, cached + n - k, dtype=torch.bool), tail_mask.bool()], 1)


def keep_positions(prefix: int, tail: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(prefix), torch.tensor(tail, dtype=torch.long)])


def split_keep(keep: torch.Tensor | list[int]) -> tuple[int, list[int]]:
    """The compact wire form of a gather: the untouched prefix length and the rest."""
    keep = torch.as_tensor(keep, dtype=torch.long)
    moved = (keep != torch.arange(keep.numel())).nonzero()
    prefix = int(moved[0]) if moved.numel() else keep.numel()
    return prefix, keep[prefix:].tolist()


@dataclass(slots=True)
class StageStats:
    forwards: int = 0  # micro-batches run
    tokens: int = 0  # rows run through this stage's layers
    busy_s: float = 0.0
    pruned: int = 0  # KV positions dropped by verifications (rejected tree nodes)
    opened: int = 0
    closed: int = 0
    dropped_forwards: int = 0  # dead forwards passed on without computing them
    dropped_tokens: int = 0

    def to_dict(self) -> dict:
        step = 1e3 * self.busy_s / self.forwards if self.forwards else 0.0
        return {"forwards": self.forwards, "tokens": self.tokens, "step_ms": round(step, 3),
                "pruned_positions": self.pruned, "sessions_opened": self.opened, "sessions_closed": self.closed,
                "dropped_forwards": self.dropped_forwards, "dropped_tokens": self.dropped_tokens}


@dataclass(slots=True, eq=False)
class StageWorker:
    """The sessions of one upstream connection on this stage (all freed when it closes)."""
    decoder: Decoder
    pool: KVPool | None
    stats: StageStats
    caches: dict[int, KVCache] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)  # sessions whose open failed here: why
    dead: dict[int, set[int]] = field(default_factory=dict)  # sid -> tags of its dead forwards (loop thread)

    def open(self, msg: StageOpen) -> None:
        if msg.sid in self.caches:
            raise BadRequest(f"stage session {msg.sid} is already open")
        self.caches[msg.sid] = self.decoder.new_cache(msg.capacity, self.pool)
        self.stats.opened += 1

    def keep(self, msg: StageKeep) -> None:
        cache = self._cache(msg.sid)
        before = cache.length
        cache.gather(keep_positions(msg.prefix, msg.tail))
        self.stats.pruned += before - cache.length

    def mark_dead(self, msg: StageDrop, most: int) -> None:
        """(Loop thread) remember dead forwards until they reach the head of the queue: at
        most ``most`` sessions and ``most`` tags each (no more forwards can be queued), so a
        peer's stray drops cannot grow this. (Its session may still be opening: the open can
        be queued behind forwards.)"""
        if msg.tags and (msg.sid in self.dead or len(self.dead) < most):
            tags = self.dead.setdefault(msg.sid, set())
            tags.update(msg.tags[: max(most - len(tags), 0)])

    def is_dead(self, msg: StageForward) -> bool:
        """(Loop thread, once per forward, in arrival order) whether to pass ``msg`` on hollow:
        every session's row of it is dead. A session's tags grow in sending order, so the
        tags up to this one are done with here (bounded by what is in flight)."""
        if msg.dropped:
            return True
        if len(msg.tags) != len(msg.sids):
            return False
        dead = all(tag in self.dead.get(sid, ()) for sid, tag in zip(msg.sids, msg.tags))
        for sid, tag in zip(msg.sids, msg.tags):
            tags = self.dead.get(sid)
            if tags is not None:
                tags.difference_update([t for t in tags if t <= tag])
                if not tags:
                    del self.dead[sid]
        return dead

    def hollow(self, msg: StageForward) -> StageForward | StageOutput:
        """A dead forward: its rows take their KV positions unwritten; nothing is computed."""
        caches = [self._cache(sid) for sid in msg.sids]
        if len(msg.lengths) != len(caches):
            raise BadRequest("a stage forward's sessions and lengths disagree")
        for cache, n in zip(caches, msg.lengths):
            cache.skip(n)
        self.stats.dropped_forwards += 1
        self.stats.dropped_tokens += sum(msg.lengths)
        empty = Tensor.from_torch(torch.empty(0, dtype=torch.long))
        if self.decoder.lm_head is not None:
            return StageOutput(msg.fid, empty)
        return StageForward(msg.fid, msg.sids, msg.lengths, msg.positions, msg.masks, msg.logits_at, empty, msg.want,
                            msg.tags, dropped=True)

    def close(self, sid: int) -> None:
        cache = self.caches.pop(sid, None)
        if cache is not None:
            cache.release()
            self.stats.closed += 1

    def close_all(self) -> None:
        for sid in list(self.caches):
            self.close(sid)

    def _cache(self, sid: int) -> KVCache:
        cache = self.caches.get(sid)
        if cache is None:
            raise BadRequest(self.failed.get(sid, f"unknown stage session {sid}"))
        return cache

    def forward(self, msg: StageForward) -> StageForward | StageOutput:
        """Run this stage's layers: hidden states for the next stage, or (last stage) the
        logits rows asked for."""
        started = time.perf_counter()
        caches = [self._cache(sid) for sid in msg.sids]
        hidden, positions = msg.hidden.to_torch(), msg.positions.to_torch()
        if msg.want not in ("logits", "argmax"):
            raise BadRequest(f"a stage forward wants 'logits' or 'argmax', not {msg.want!r}")
        if hidden.shape[0] != sum(msg.lengths) or positions.shape[0] != hidden.shape[0]:
            raise BadRequest("a stage forward's hidden states, positions and lengths disagree")
        masks = [full_mask(None if m is None else m.to_torch(), cache.length) for m, cache in zip(msg.masks, caches)]
        bounds = ragged_bounds(msg.lengths)
        if self.decoder.lm_head is None:
            out = self.decoder.forward_ragged(hidden, positions, bounds, caches, masks)
            reply = StageForward(msg.fid, msg.sids, msg.lengths, msg.positions, msg.masks, msg.logits_at,
                                 Tensor.from_torch(out), msg.want, msg.tags)
        else:
            rows = torch.tensor([lo + at for at_list, (lo, _) in zip(msg.logits_at, bounds) for at in at_list],
                                dtype=torch.long)
            logits = self.decoder.forward_ragged(hidden, positions, bounds, caches, masks, rows)
            # The head computed them in the model's dtype: shipping that dtype is exact.
            out = logits.argmax(-1) if msg.want == "argmax" else logits.to(self.decoder.dtype)
            reply = StageOutput(msg.fid, Tensor.from_torch(out))
        self.stats.forwards += 1
        self.stats.tokens += hidden.shape[0]
        self.stats.busy_s += time.perf_counter() - started
        return reply
