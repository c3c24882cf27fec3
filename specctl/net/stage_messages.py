"""The pipeline stages' messages (specctl verify --stage i/n), members of net.protocol's one
tagged union."""

from __future__ import annotations

import msgspec

from specctl.net.tensor import Tensor

# --- pipeline stage i -> stage i+1 (and StageOutput back) ----------------------------------
# One connection per neighbouring pair. Messages apply in the order sent, so a session's
# KV pruning reaches every stage before that session's next forward (no stage ever runs
# ahead of what was verified).

class StageOpen(msgspec.Struct, tag=True, frozen=True):
    sid: int
    capacity: int  # positions to reserve for the session's KV on every stage


class StageForward(msgspec.Struct, tag=True, frozen=True):
    """A micro-batch: the hidden states of several sessions' new tokens, concatenated."""
    fid: int
    sids: list[int]
    lengths: list[int]  # new tokens per session
    positions: Tensor  # int64 [sum(lengths)] RoPE positions
    masks: list[Tensor | None]  # per session: bool [n, k], the last k columns of its attention mask (None = causal)
    logits_at: list[list[int]]  # per session: which of its new tokens get logits (last stage)
    hidden: Tensor  # [sum(lengths), hidden] in the model's dtype
    want: str = "logits"  # last stage: "logits" rows, or "argmax" (greedy: one token id per row)
    tags: list[int] = []  # per session: the sender's id of this forward (SpecPipe: its level), for StageDrop
    dropped: bool = False  # a dead forward passed on without hidden states: reserve its KV rows, compute nothing


class StageKeep(msgspec.Struct, tag=True, frozen=True):
    """Keep KV positions [0, prefix) + ``tail`` (ascending), compacted: after a verification."""
    sid: int
    prefix: int
    tail: list[int] = []


class StageClose(msgspec.Struct, tag=True, frozen=True):
    sid: int


class StageDrop(msgspec.Struct, tag=True, frozen=True):
    """Control path: rows of the forwards of session ``sid`` tagged ``tags`` are dead (they
    will be pruned: a flushed tree, a level wholly or partly in rejected branches). A stage
    reads it as soon as it arrives, ahead of the forwards queued for its compute, and does
    not compute those rows. ``rows``: per tag, its dead rows; empty (or no list at all) =
    every row of it, and the forward is passed on without computing anything."""
    sid: int
    tags: list[int]
    rows: list[list[int]] = []

    def __post_init__(self) -> None:
        if self.rows and len(self.rows) != len(self.tags):
            raise ValueError(f"a stage drop lists rows for {len(self.rows)} forwards but tags {len(self.tags)}")
        if any(row < 0 for rows in self.rows for row in rows):
            raise ValueError("a stage drop's rows must be >= 0")


class StageOutput(msgspec.Struct, tag=True, frozen=True):
    """Last stage -> back up the chain: logits rows of a StageForward, in the model's dtype
    (exact: the LM head computes them in it), rows of every session concatenated."""
    fid: int
    logits: Tensor
