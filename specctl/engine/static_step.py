"""One padded static step (engine.static): the inputs, the mask over the session's whole KV
buffer and, on CUDA, the graph captured over them, for one (session cache, bucket). Padding
rows read token 0 at position 0, write their K/V into the cache's trash slot and attend to it
alone, so they stay finite and touch nothing real."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specctl.engine.kv_cache import KVCache
from specctl.engine.window import window_rows
from specctl_kernels import static_attention


@dataclass(frozen=True, slots=True)
class StaticSegment:
    """One session's padded step, as the attention layers see it."""

    cache: KVCache
    write_at: torch.Tensor  # [M] cache slot each row's K/V goes to
    mask: torch.Tensor  # [G*M, slots] bool: row (g, m) = mask of row m (queries grouped per KV head)
    window_mask: torch.Tensor | None = None  # the same cut to the sliding window (sliding layers')

    def attend(self, layer: int, q: torch.Tensor, kv: torch.Tensor, attention=static_attention,
               windowed: bool = False) -> torch.Tensor:
        """Write this step's keys and values kv [2, Hkv, M, D] into the layer's buffer (one
        kernel; a latent cache's one plane: the keys), then attend with q [1, H, M, D] over all
        of it (``windowed``: a sliding layer, through the window's mask)."""
        planes = self.cache.kv.shape[1]
        self.cache.kv[layer, :, 0].index_copy_(2, self.write_at, kv[:planes])
        mask = self.window_mask if windowed else self.mask
        return attention(q, self.cache.k[layer], self.cache.v[layer], mask)


def step_mask(size: int, n: int, length: int, slots: int, trash: int, mask: torch.Tensor | None) -> torch.Tensor:
    """[size, slots] bool: real row i sees what ``mask`` row i says over the cache's first
    length + n slots (None = causal); padding rows see only the trash slot."""
    full = torch.zeros(size, slots, dtype=torch.bool)
    fill_step_mask(full.numpy(), n, length, trash, mask)
    return full


def fill_step_mask(full: np.ndarray, n: int, length: int, trash: int, mask: torch.Tensor | None) -> None:
    """``step_mask`` written in place into ``full`` [size, slots] (a step's host staging buffer)."""
    full[:] = False
    if mask is None:
        full[:n, :length] = True
        full[:n, length : length + n] = np.tri(n, dtype=bool)
    else:
        full[:n, : length + n] = mask.cpu().numpy()
    full[n:, trash] = True


class StepGraph:
    """The padded step of one size for one session's cache: static input buffers, and on
    CUDA the captured graph that reads them."""

    def __init__(self, decoder, cache: KVCache, size: int, pool=None, warm: bool = True) -> None:
        device = decoder.device
        self.decoder, self.cache, self.size = decoder, cache, size
        pinned = device.type == "cuda"
        # A step's inputs are written in place into pinned host buffers and sent in two
        # asynchronous copies: building them as new tensors and sending them in five pageable
        # (blocking) copies cost ~0.7 ms a step on an H100, beside a 1.5B graph's 2.3 ms.
        self.host_index = torch.zeros(3, size, dtype=torch.long, pin_memory=pinned)  # ids, positions, write_at
        self.host_mask = torch.zeros(size, cache.slots, dtype=torch.bool, pin_memory=pinned)
        self.sent = torch.cuda.Event() if pinned else None
        # The device buffers hold a padding-only step (writes go to the trash slot) until the first run.
        self.index = torch.zeros(3, size, dtype=torch.long, device=device)
        self.index[2] = cache.trash
        self.mask = step_mask(size, 0, 0, cache.slots, cache.trash, None).to(device)
        # a model with sliding layers: their mask too, cut to the window (engine.window)
        self.window = decoder.spec.window
        self.host_window = torch.zeros_like(self.host_mask) if self.window is not None else None
        self.window_mask = self.mask.clone() if self.window is not None else None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None
        if pool is not None:
            self._capture(pool, warm)

    def _body(self) -> torch.Tensor:
        groups = self.decoder.spec.num_heads // self.decoder.spec.num_kv_heads
        windowed = None if self.window_mask is None else self.window_mask.repeat(groups, 1)
        segment = StaticSegment(self.cache, self.index[2], self.mask.repeat(groups, 1), windowed)
        return self.decoder.static_forward(self.index[0], self.index[1], segment)

    def _capture(self, pool, warm: bool) -> None:
        if warm:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._body()
            torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: another compute thread of this process (a draft server beside a target)
        # may use the GPU while this one captures.
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            self.out = self._body()

    def run(self, inputs: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
            logits_at: torch.Tensor | None) -> torch.Tensor:
        n, length, cache = inputs.shape[0], self.cache.length, self.cache
        if self.sent is not None:
            self.sent.synchronize()  # the last step's copies have left the staging buffers
        index = self.host_index.numpy()
        index[:2] = 0
        # A draft's own last token stays on the device (a greedy chain reads back once per
        # proposal): it is copied into the step's ids after the staging copy, without a sync.
        ids_on_device = inputs.device.type != "cpu"
        if not ids_on_device:
            index[0, :n] = inputs.numpy()
        index[1, :n] = positions.cpu().numpy()
        index[2] = cache.trash
        index[2, :n] = np.arange(length, length + n)
        fill_step_mask(self.host_mask.numpy(), n, length, cache.trash, mask)
        self.index.copy_(self.host_index, non_blocking=True)
        self.mask.copy_(self.host_mask, non_blocking=True)
        if self.window is not None:
            window = self.host_window.numpy()
            window[:] = self.host_mask.numpy()
            window_rows(window, index[1, :n], self.window, self.decoder.spec.chunked_attention, index[2, :n])
            self.window_mask.copy_(self.host_window, non_blocking=True)
        if ids_on_device:
            self.index[0, :n].copy_(inputs)
        if self.sent is not None:
            self.sent.record()
        if self.graph is not None:
            self.graph.replay()
            out = self.out
        else:
            out = self._body()
        cache.commit(n)
        # A copy: the graph's output buffer is overwritten by the next replay. Rows in a run are
        # sliced: a row index sent to the device would be a blocking copy (a second host sync
        # in every draft step).
        rows = list(range(n)) if logits_at is None else logits_at.tolist()
        first = rows[0] if rows else 0
        if rows == list(range(first, first + len(rows))):
            return out[first : first + len(rows)].clone()
        return out[torch.tensor(rows, device=out.device)]
