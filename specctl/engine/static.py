"""Static-shape steps: a decode or verification forward of n <= 64 new tokens padded to a
size bucket, attending over the session's whole KV buffer with an explicit mask, so that
every step of a session has the same shapes and the same tensor addresses. On CUDA each
(session cache, bucket) is captured once as a CUDA graph and then replayed: one launch per
step instead of ~40 per layer (issue 11: a 1.5B step was 6 % of the bandwidth limit,
launch-bound). On the CPU the same padded forward runs eagerly (tests check it against the
ragged path there).

Padding rows read token 0 at position 0, write their K/V into the cache's trash slot
(``KVCache.trash``, never visible to a real row) and attend to that slot alone, so they
stay finite and touch nothing real. Each real row's result depends on its own inputs
only: the padded forward is exact where the eager one is."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from specctl.engine.kv_cache import KVCache
from specctl.engine.spares import SpareCaches
from specctl.engine.window import window_rows
from specctl_kernels import static_attention

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# A static decoder's KV buffers come in multiples of this many slots, and a released session's
# buffer is kept, with the steps captured over it, for the next session of the same size
# (engine.spares). The padding's extra slots are masked; at 256 they add <= 255 positions of
# attention, a few % of a small model's step at the longest.
SLOT_QUANTUM = 256

# Several sessions' forwards (a batched draft step, a batched verification) run as one graph
# replay each, up to this many sessions, rather than as one eager forward of all of them: on an
# H100 an eager forward cost 16-30 ms against a 1.5B step's 2.5 ms replayed (bench kernels,
# 2026-11-26), and each session then computes through the kernels it uses alone (bf16 outputs
# of a batched verification equal the session's AR). Above it one eager forward is cheaper.
REPLAY_PER_SESSION_UP_TO = 8

# One CUDA graph capture at a time per process, and no other forward while one runs:
# torch.cuda.graph synchronises the device on entry, which fails while another thread is
# capturing, and two captures cannot record into memory pools at once. A draft server and a
# target in one process (``specctl up``, tests) each have a compute thread; every CUDA forward
# takes this lock (uncontended in a one-model process).
CUDA_LOCK = threading.RLock()


def bucket_for(n: int) -> int | None:
    """The smallest bucket holding n tokens (None: too many, run eagerly)."""
    return next((size for size in BUCKETS if size >= n), None)


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


COMPILES_A_RUNNER = 2 * len(BUCKETS)  # a model shape's compiles of one piece: one a bucket, with room to spare


def make_room_for_compiles() -> None:
    """Raise torch's recompile limits by a runner's share: every model shape compiles each piece
    once a bucket against one limit per function, and with fullgraph=True a limit met fails the
    step (a fixed 28 failed a process's fifth model shape on an H100, 2026-12-06)."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, COMPILES_A_RUNNER) + COMPILES_A_RUNNER
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 256) + 3 * COMPILES_A_RUNNER


class StaticRunner:
    """Runs a full decoder's small steps padded (and, on CUDA with ``graphs``, as CUDA
    graphs), one StepGraph per (cache, bucket), kept on the cache so it goes with it."""

    def __init__(self, decoder, graphs: bool, compile: bool = False) -> None:
        self.decoder = decoder
        # a mixture of experts picks its experts on the host (a sync no graph can capture): padded, not captured
        self.graphs = graphs and decoder.device.type == "cuda" and not any(decoder.spec.sparse_layers)
        # (before, attend, after): the per-layer functions a static step runs, None = the modules' forward
        self.pieces = None
        if not all(layer.llama_shaped for layer in decoder.layers):
            compile = False  # the pieces compute the Llama layer; another (Gemma's) runs its modules
        elif compile or all(layer.fused for layer in decoder.layers):
            from specctl.engine.layers import after_attention, before_attention
            from specctl_kernels import static_attention

            if not all(layer.fused for layer in decoder.layers):
                raise ValueError("compiled static steps need fused projections (engine.fusion.fuse_projections)")
            self.pieces = (before_attention, static_attention, after_attention)
            if compile:
                # One specialised compile per bucket (automatic dynamic shapes made slower
                # kernels on an H100); attention's KV length differs between sessions, so it
                # gets one compile with symbolic sizes.
                make_room_for_compiles()
                self.pieces = (torch.compile(before_attention, fullgraph=True, dynamic=False),
                               torch.compile(static_attention, fullgraph=True, dynamic=True),
                               torch.compile(after_attention, fullgraph=True, dynamic=False))
        self.pool = None
        if self.graphs:
            # A graph memory pool dies with the last graph captured into it, and capturing into
            # a dead pool's handle trips an allocator assert. Sessions come and go (their graphs
            # with them), so a tiny graph that lives as long as the runner keeps the pool alive.
            self.pool = torch.cuda.graph_pool_handle()
            self._anchor = torch.cuda.CUDAGraph()
            scratch = torch.zeros(1, device=decoder.device)
            with torch.cuda.graph(self._anchor, pool=self.pool, capture_error_mode="thread_local"):
                self._anchor_out = scratch + 1
        self.compiled = compile
        self.per_session = self.graphs  # batches as per-session steps: where steps are graph replays
        self.warmed: set[tuple[int, int]] = set()
        self.captures = 0
        self.replays = 0
        self.spares = SpareCaches()
        self.reused = 0  # caches opened on a spare buffer

    def new_cache(self, capacity: int, pool=None) -> KVCache:
        """A session's cache, on a spare buffer of its size (and the steps captured over it) if one is kept."""
        slots = -(-(capacity + 1) // SLOT_QUANTUM) * SLOT_QUANTUM
        spare = self.spares.take(slots)
        spec = self.decoder.spec
        try:
            cache = KVCache(self.decoder.num_layers, spec.num_kv_heads, spec.head_dim, capacity, self.decoder.dtype,
                            self.decoder.device, pool, slots=slots, spare=spare, arena=self.decoder.kv_arena,
                            planes=spec.kv_planes)
        except BaseException:
            if spare is not None and not self.spares.keep(spare):  # the budget refused the session: the buffer stays spare
                spare.free_buffer()
            raise
        cache.recycle = self.spares.keep
        self.reused += spare is not None
        return cache

    def adopt_arena(self, arena) -> None:
        """Caches come from ``arena`` (engine.kv_arena): kept buffers are ranges of it, given back
        when a new session finds no free range (a session's memory before a spare's)."""
        arena.reclaimers.append(self.spares.drop_all)

    def leave_arena(self, arena) -> None:
        """This runner is being replaced: its kept ranges go back to ``arena``, which stops asking it."""
        self.spares.drop_all()
        arena.reclaimers.remove(self.spares.drop_all)

    def replays_each(self, sessions: int) -> bool:
        """Whether a forward of several sessions runs as one step per session (see REPLAY_PER_SESSION_UP_TO)."""
        return self.per_session and 1 < sessions <= REPLAY_PER_SESSION_UP_TO

    def fits(self, n: int, cache: KVCache) -> bool:
        return bucket_for(n) is not None and cache.length + n <= cache.capacity

    def fits_in_chunks(self, n: int, cache: KVCache, mask: torch.Tensor | None) -> bool:
        """A causal forward longer than the largest step (a prefill) that runs as steps of it."""
        return mask is None and n > BUCKETS[-1] and cache.length + n <= cache.capacity

    def run_chunks(self, inputs: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                   logits_at: torch.Tensor | None) -> torch.Tensor:
        """A causal forward of more tokens than the largest bucket as consecutive steps of that
        bucket (a chunked prefill): each chunk attends to the cache and to itself causally, as
        the whole forward would, and replays a captured graph on CUDA — an eager prefill of a
        few hundred tokens costs ~10x a 64-token graph step on an H100 (issue 11). Logits of
        the ``logits_at`` rows (None = all), in that order."""
        n, chunk = inputs.shape[0], BUCKETS[-1]
        wanted = list(range(n)) if logits_at is None else [int(row) for row in logits_at.tolist()]
        in_order = sorted(range(len(wanted)), key=wanted.__getitem__)  # the wanted rows in forward order
        outs = []
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            at = torch.tensor([wanted[i] - start for i in in_order if start <= wanted[i] < end], dtype=torch.long)
            outs.append(self.run(inputs[start:end], positions[start:end], cache, None, at))
        out = torch.cat(outs)
        if in_order == list(range(len(wanted))):
            return out
        return out[torch.tensor(in_order).argsort().to(out.device)]

    def run(self, inputs: torch.Tensor, positions: torch.Tensor, cache: KVCache, mask: torch.Tensor | None,
            logits_at: torch.Tensor | None) -> torch.Tensor:
        size = bucket_for(inputs.shape[0])
        step = cache.steps.get(size)
        if step is None:
            # cuBLAS and the allocator need one eager pass per shape before a capture, and a
            # compiled attention may meet a KV buffer size it has not seen (no compiling while
            # capturing).
            shape = (size, cache.slots if self.compiled else 0)
            step = StepGraph(self.decoder, cache, size, self.pool, warm=shape not in self.warmed)
            self.warmed.add(shape)
            cache.steps[size] = step
            self.captures += step.graph is not None
        self.replays += step.graph is not None
        return step.run(inputs, positions, mask, logits_at)
