"""Sliding-window attention over a full KV cache (Mistral, Phi-3-mini-4k, Gemma 2's every other
layer, Qwen's layers past max_window_layers): a query at position p sees the keys at positions
p - window < k <= p, as transformers' sliding mask has it. The cache keeps every position (no
memory saved: the point is the checkpoint's own output at any length); a sliding layer attends
over the slots from the first one any row of the forward sees (a view), with a mask where rows
start at different slots. Computed once a forward per session, used by every sliding layer.

A committed token's slot is its position. A tree node's slot is at least its position (its
ancestors fill slots before it), and the nodes a query sees are its ancestors, a few positions
behind it: so "slot >= p - window + 1" hides exactly what the window hides as long as a tree is
shallower than the window (64 nodes deep at most, windows are hundreds to thousands).

Llama 4's chunked layers (``chunked``: the window is a chunk size C) see the keys of their own
chunk, positions p // C * C .. p. A tree's ancestor just before a chunk boundary can sit in a
slot past it, so a chunk cuts by the keys' positions — a committed slot's is its index, a new
row's its own — not by their slots."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specctl_kernels import causal_mask


@dataclass(frozen=True, slots=True)
class WindowCut:
    """A session's forward as its sliding layers see it: keys from cache slot ``start`` on,
    and the rows' mask over them (None: causal over the last n, as an unmasked forward)."""

    start: int
    mask: torch.Tensor | None


def first_visible(positions, window: int, chunked: bool = False):
    """Each row's first visible position: its window's, or its chunk's start (a tensor or an array)."""
    return positions // window * window if chunked else positions - window + 1


def window_cut(positions: torch.Tensor, total: int, mask: torch.Tensor | None, window: int,
               chunked: bool = False) -> WindowCut | None:
    """The cut for n new rows at ``positions`` over ``total`` slots (the cache's length + n),
    whose own mask is ``mask`` [n, total] (None: causal). None: no row reaches past the window."""
    first_seen = first_visible(positions.cpu(), window, chunked)
    if int(first_seen.max()) <= 0:
        return None
    start = max(0, int(first_seen.min()))
    if positions.numel() == 1 and mask is None:  # a decode step: the last ``window`` keys, a view
        return WindowCut(start, None)
    device = mask.device if mask is not None else positions.device
    n = positions.numel()
    base = mask if mask is not None else causal_mask(n, total, device)
    keys = torch.arange(start, total, device=device)  # the slots' positions (committed: their own)
    if chunked:
        keys[total - n - start :] = positions.to(device)  # (start <= the committed length: first_seen's min)
    return WindowCut(start, base[:, start:] & (keys[None, :] >= first_seen.to(device)[:, None]))


def window_rows(full: np.ndarray, positions: np.ndarray, window: int, chunked: bool = False,
                written: np.ndarray | None = None) -> None:
    """A static step's mask (engine.static: rows over the whole buffer) cut to the window in
    place: real row i (positions[i]) loses the slots before its first visible position (chunked:
    the slots whose keys lie before it, the new rows' keys in the slots ``written``)."""
    keys = np.arange(full.shape[1])
    if chunked:
        keys[written] = positions
    full[: len(positions)] &= keys[None, :] >= first_visible(positions, window, chunked)[:, None]
