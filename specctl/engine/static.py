"""Static-shape steps: a decode or verification forward of n <= 64 new tokens padded to a
size bucket, attending over the session's whole KV buffer with an explicit mask, so that
every step of a session has the same shapes and the same tensor addresses. On CUDA each
(session cache, bucket) is captured once as a CUDA graph and then replayed: one launch per
step instead of ~40 per layer (issue 11: a 1.5B step was 6 % of the bandwidth limit,
launch-bound). On the CPU the same padded forward runs eagerly (tests check it against the
ragged path there).

Padding rows read token 0 at position 0, write their K/V into the cache's trash slot
(``KVCache.trash``, never visible to a real row) and attend to that slot alone, so they
stay finite and touch nothing real (engine.static_step). Each real row's result depends on
its own inputs only; its bits may still depend on the bucket on CUDA, whose kernels are chosen
by shape (an H100, 2026-12-06), so bf16 bit-equality with AR is claimed on the CPU only."""

from __future__ import annotations

import threading

import torch

from specctl.engine.kv_cache import KVCache
from specctl.engine.spares import SpareCaches
from specctl.engine.static_step import StepGraph

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
# of a batched verification equal the session's own alone). Above it one eager forward is cheaper.
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
            from specctl.engine.static_layer import after_attention, before_attention
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
            # the budget refused the session: the buffer stays spare
            if spare is not None and not self.spares.keep(spare):
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
