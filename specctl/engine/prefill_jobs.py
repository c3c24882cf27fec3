"""How many of a prompt's tokens one prefill job computes (chunked prefill, DESIGN §3).

A job of ``prefill_chunk`` rows at the prompt's start costs mostly its linear layers; deeper
in a long prompt every row also attends to all the keys before it, and on the CPU's row-exact
path that grows fast: a 512-row job of the 1.5B bf16 target took 6-7 s at position 0, 14 s at
4,096 and 25 s at 8,192 (2-core EPYC, 2026-12-07), and every other session waited that long
for its next round. So a job holds as many rows as cost about what the first job costs, with a
row at position p costing 1 + w·p (w: ``key_cost``, an attention key's cost against a row's
linear layers). The rows depend on the position and the model only, never on load: every
session of a model computes its prompt in the same jobs, as before."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specctl.engine.spec import ModelSpec

# A key's cost against its flops, relative to the linear layers' (fitted on the 1.5B bf16 target,
# this CPU, 2026-12-07: row by row 3.0e-4 a key against 6.6e-5 in flops; SDPA 1.4e-4). CUDA's
# attention kernels run near the matmuls' rate.
ATTENTION_SLOWDOWN = {"row_exact": 4.5, "cpu": 2.0}
GRAIN = 16  # rows: a job's size is a multiple of it (or the whole chunk)


def key_cost(spec: ModelSpec, device_type: str, row_exact: bool) -> float:
    """w: one more key in a row's attention, against the row's linear layers (both in flops,
    times the attention's measured slowdown on this path)."""
    attention = 4 * spec.num_heads * spec.head_dim  # q·k and p·v, per key
    projections = spec.head_dim * (2 * spec.num_heads + 2 * spec.num_kv_heads)  # q, k, v, o
    inner = (spec.experts_per_token * spec.expert_intermediate_size + spec.shared_expert_intermediate_size
             if spec.num_experts else spec.intermediate_size or 0)  # the MLP's width a token runs
    linear = 2 * spec.hidden_size * (projections + (3 if spec.gated_mlp else 2) * inner)
    slowdown = ATTENTION_SLOWDOWN["row_exact"] if row_exact else ATTENTION_SLOWDOWN.get(device_type, 1.0)
    return slowdown * attention / linear


def job_rows(chunk: int, start: int, key_cost: float) -> int:
    """Rows of the prefill job that starts at position ``start`` (0: the whole prompt): ``chunk``
    at the start, fewer deeper in (a multiple of GRAIN, at least GRAIN), each job costing at most
    what a ``chunk``-row job at position 0 costs."""
    if chunk <= 0 or key_cost <= 0:
        return chunk
    budget = chunk + key_cost * chunk * chunk / 2
    # t rows from ``start`` cost t + w·(t·start + t²/2): the positive root of w/2·t² + b·t = budget
    b = 1 + key_cost * start
    rows = 2 * budget / (b + math.sqrt(b * b + 2 * key_cost * budget))  # the stable form of the root
    if rows + 1e-6 >= chunk:  # the start (the root is chunk itself, but for the floats' last bits)
        return chunk
    return max(int(rows) // GRAIN * GRAIN, min(chunk, GRAIN))


def next_job_end(decoder, start: int, end: int) -> int:
    """Where the prefill job of ``decoder`` that starts at ``start`` ends, the text ending at ``end``
    (a pipeline's decoder has no chunks: the whole text)."""
    rows = job_rows(getattr(decoder, "prefill_chunk", 0), start, getattr(decoder, "prefill_key_cost", 0.0))
    return end if rows <= 0 else min(end, start + rows)
