"""Linear layers whose weights oneDNN reordered once, at load (CPU, bf16).

``F.linear`` on a bf16 CPU tensor calls oneDNN, which reorders the weight into its blocked
layout on every call: for a decode step, whose products are one row each, that reorder is a
good part of the step. vLLM's CPU backend and llama.cpp's repacked CPU buffers reorder once;
so does this. Measured here (torch 2.13, an AMX Xeon, 2 threads, the Qwen 1.5B, 512 tokens
cached): an AR step 203 -> 159 ms, a verification of 8 tokens 204 -> 167 ms, a 512-token
row-exact prefill 3.6 -> 2.7 s (docs/results/packed-weights-2026-12-04.txt). fp32 one-row
products got slower (MKL's matrix-vector kernel is already fast) and fp16's barely moved, so
only bf16 packs.

A packed weight is an opaque oneDNN tensor (``is_mkldnn``): only ``_linear_pointwise`` reads
it, ``to_dense()`` gives the weight back. Packed weights are the process's own memory (the
unpacked ones stay mapped from the checkpoint), and a tied LM head packs a copy of the
embedding table, which still looks rows up in its own (the 1.5B's: 0.47 GB)."""

from __future__ import annotations

import torch
from torch import nn

from specctl.engine.rows import PaddedRowLinear, plain_linears

# the rows oneDNN chooses the packed layout for: the row probe's blocks (packed for one row,
# the 1.5B's down projection gave products of more than 8 rows other bits)
PACKED_FOR_ROWS = 32
# linears whose weight is read as a tensor too (latent attention's absorbed up-projection)
READ_AS_TENSORS = ("kv_b_proj",)


def candidate(device: str, dtype: str, quant: str) -> bool:
    """Where packing applies (a pure decision): the CPU, bf16, unquantized, a oneDNN build
    with native bf16 kernels for this CPU."""
    return (device == "cpu" and dtype == "bf16" and quant == "none" and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(PaddedRowLinear):
    """A linear layer over a oneDNN-packed weight, padded and blocked as PaddedRowLinear is
    (min_rows 1 and no blocks until the row probe says otherwise)."""

    min_rows: int = 1
    max_rows: int | None = None

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def pack(linear: nn.Linear) -> PackedLinear:
    """``linear`` as a PackedLinear sharing its bias; its weight reordered (a new tensor)."""
    with torch.device("meta"):
        packed = PackedLinear(linear.in_features, linear.out_features, bias=linear.bias is not None)
    weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACKED_FOR_ROWS)
    packed.weight = nn.Parameter(weight, requires_grad=False)
    if linear.bias is not None:
        packed.bias = linear.bias
    return packed


def pack_linears(decoder: nn.Module) -> int:
    """Every plain nn.Linear of the decoder (layers and LM head) packed, in place; returns how
    many. Before the row probe, which then probes the packed products."""
    count = 0
    for parent, name, child in plain_linears(decoder):
        if name not in READ_AS_TENSORS and child.weight.dtype == torch.bfloat16 and child.weight.device.type == "cpu":
            setattr(parent, name, pack(child))
            count += 1
    return count
