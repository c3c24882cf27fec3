"""What a pipeline stage computes: its layers over a micro-batch of sessions, and each
session's KV for those layers. Runs on the stage's compute thread, one message at a time
in arrival order, so a session's pruning always lands before its next forward.

Rows declared dead (StageDrop, read on arrival ahead of the compute queue) are not
computed: they take their KV positions unwritten, so every stage's cache keeps stage 1's
order, and the pruning that follows removes them before any live row could attend to them
(a live node attends only to its ancestors, which are live). A forward with every row dead
goes on hollow; one with some rows dead computes the others and sends zeros for the dead
(stage 1 reads only the root's row, which is live)."""

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
    skipped_rows: int = 0  # dead rows of forwards that were computed for their live rows

    def to_dict(self) -> dict:
        step = 1e3 * self.busy_s / self.forwards if self.forwards else 0.0
        return {"forwards": self.forwards, "tokens": self.tokens, "step_ms": round(step, 3),
                "pruned_positions": self.pruned, "sessions_opened": self.opened, "sessions_closed": self.closed,
                "dropped_forwards": self.dropped_forwards, "dropped_tokens": self.dropped_tokens,
                "skipped_rows": self.skipped_rows}


@dataclass(slots=True, eq=False)
class StageWorker:
    """The sessions of one upstream connection on this stage (all freed when it closes)."""
    decoder: Decoder
    pool: KVPool | None
    stats: StageStats
    caches: dict[int, KVCache] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)  # sessions whose open failed here: why
    # (loop thread) sid -> tag of a forward -> its dead rows (None: every row)
    dead: dict[int, dict[int, set[int] | None]] = field(default_factory=dict)

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
        """(Loop thread) remember dead rows until their forward reaches the head of the queue:
        at most ``most`` sessions and ``most`` forwards each (no more forwards can be queued),
        so a peer's stray drops cannot grow this. (Its session may still be opening: the open
        can be queued behind forwards.)"""
        if msg.tags and (msg.sid in self.dead or len(self.dead) < most):
            tags = self.dead.setdefault(msg.sid, {})
            for tag, rows in zip(msg.tags, msg.rows or [[]] * len(msg.tags)):
                if (tag not in tags and len(tags) >= most) or (tag in tags and tags[tag] is None):
                    continue
                tags[tag] = None if not rows else tags.get(tag, set()) | set(rows)

    def dead_rows(self, msg: StageForward) -> list[set[int] | None]:
        """(Loop thread, once per forward, in arrival order) each session's dead rows of
        ``msg`` (None: all of them). A session's tags grow in sending order, so the tags up to
        this one are done with here (bounded by what is in flight)."""
        if msg.dropped:
            return [None] * len(msg.sids)
        if len(msg.tags) != len(msg.sids) or len(msg.lengths) != len(msg.sids):
            return [set() for _ in msg.sids]  # not a forward SpecPipe tagged (or malformed: refused by forward)
        found = []
        for sid, tag, n in zip(msg.sids, msg.tags, msg.lengths):
            tags = self.dead.get(sid, {})
            rows = tags.get(tag, set())
            found.append(None if rows is not None and rows >= set(range(n)) else rows)  # every row listed: all
            for done in [t for t in tags if t <= tag]:
                del tags[done]
            if not tags:
                self.dead.pop(sid, None)
        return found

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
            self.stats.closed += 1  # counted first: whoever sees the pool freed sees it counted (a test raced it)
            cache.release()

    def close_all(self) -> None:
        for sid in list(self.caches):
            self.close(sid)

    def _cache(self, sid: int) -> KVCache:
        cache = self.caches.get(sid)
        if cache is None:
            raise BadRequest(self.failed.get(sid, f"unknown stage session {sid}"))
        return cache

    def forward(self, msg: StageForward, dead: list[set[int] | None] | None = None) -> StageForward | StageOutput:
        """Run this stage's layers over the rows not in ``dead`` (per session): hidden states
        for the next stage, or (last stage) the logits rows asked for."""
        started = time.perf_counter()
        caches = [self._cache(sid) for sid in msg.sids]
        hidden, positions = msg.hidden.to_torch(), msg.positions.to_torch()
        if msg.want not in ("logits", "argmax"):
            raise BadRequest(f"a stage forward wants 'logits' or 'argmax', not {msg.want!r}")
        if len(msg.lengths) != len(caches) or len(msg.masks) != len(caches) or len(msg.logits_at) != len(caches):
            raise BadRequest("a stage forward's sessions, lengths, masks and logits rows disagree")
        if hidden.shape[0] != sum(msg.lengths) or positions.shape[0] != hidden.shape[0]:
            raise BadRequest("a stage forward's hidden states, positions and lengths disagree")
        masks = [full_mask(None if m is None else m.to_torch(), cache.length) for m, cache in zip(msg.masks, caches)]
        bounds = ragged_bounds(msg.lengths)
        wanted = [lo + at for at_list, (lo, _) in zip(msg.logits_at, bounds) for at in at_list]
        live = rows_to_compute(msg.lengths, [m is None for m in masks], dead or [set() for _ in caches])
        if live == [list(range(n)) for n in msg.lengths]:
            out = self.decoder.forward_ragged(hidden, positions, bounds, caches, masks, self._head_rows(wanted))
        else:
            out = self._forward_live(hidden, positions, bounds, caches, masks, live, wanted)
        if self.decoder.lm_head is None:
            reply = StageForward(msg.fid, msg.sids, msg.lengths, msg.positions, msg.masks, msg.logits_at,
                                 Tensor.from_torch(out), msg.want, msg.tags)
        else:
            # The head computed them in the model's dtype: shipping that dtype is exact.
            out = out.argmax(-1) if msg.want == "argmax" else out.to(self.decoder.dtype)
            reply = StageOutput(msg.fid, Tensor.from_torch(out))
        computed = sum(len(rows) for rows in live)
        self.stats.forwards += 1
        self.stats.tokens += computed
        self.stats.skipped_rows += hidden.shape[0] - computed
        self.stats.busy_s += time.perf_counter() - started
        return reply

    def _head_rows(self, wanted: list[int]) -> torch.Tensor | None:
        return None if self.decoder.lm_head is None else torch.tensor(wanted, dtype=torch.long)

    def _forward_live(self, hidden: torch.Tensor, positions: torch.Tensor, bounds: list[tuple[int, int]],
                      caches: list[KVCache], masks: list[torch.Tensor | None], live: list[list[int]],
                      wanted: list[int]) -> torch.Tensor:
        """The forward over the live rows only; the dead rows' KV positions are taken unwritten
        and their outputs are zeros."""
        for cache, (lo, hi) in zip(caches, bounds):
            cache.check_room(hi - lo)
        index = [lo + row for (lo, _), rows in zip(bounds, live) for row in rows]
        computed = [i for i, rows in enumerate(live) if rows]
        starts = [cache.length for cache in caches]
        sub_masks = [live_mask(masks[i], starts[i], live[i]) for i in computed]
        at = {row: i for i, row in enumerate(index)}
        head_rows = [at[row] for row in wanted if row in at]
        select = torch.tensor(index, dtype=torch.long)
        out = self.decoder.forward_ragged(hidden[select], positions[select],
                                          ragged_bounds([len(live[i]) for i in computed]),
                                          [caches[i] for i in computed], sub_masks, self._head_rows(head_rows))
        for cache, start, rows, (lo, hi) in zip(caches, starts, live, bounds):
            cache.place(start, rows, hi - lo)
        if self.decoder.lm_head is None:
            full = out.new_zeros(hidden.shape[0], out.shape[1])
            full[select.to(out.device)] = out
        else:
            full = out.new_zeros(len(wanted), out.shape[1])
            full[torch.tensor([row in at for row in wanted], dtype=torch.bool, device=out.device)] = out
        return full


def rows_to_compute(lengths: list[int], causal: list[bool], dead: list[set[int] | None]) -> list[list[int]]:
    """Per session, the rows of a forward a stage computes: all but the dead ones, except in a
    causal forward (a prefill: every row attends to every row before it), computed whole."""
    return [list(range(n)) if is_causal and rows is not None else
            [] if rows is None else [row for row in range(n) if row not in rows]
            for n, is_causal, rows in zip(lengths, causal, dead)]


def live_mask(mask: torch.Tensor | None, cached: int, rows: list[int]) -> torch.Tensor | None:
    """A forward's full mask [n, cached + n] cut to its live rows, among themselves and over
    everything cached."""
    if mask is None:
        return None
    columns = torch.cat([torch.arange(cached), cached + torch.tensor(rows, dtype=torch.long)])
    return mask[rows][:, columns]
