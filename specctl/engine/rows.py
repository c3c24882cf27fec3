"""Whether a model's linear layers give each row the same bits alone or among other rows.

Only then does row-exact attention (``specctl_kernels.row_exact``) make a verification
forward reproduce AR decoding bit for bit, so only then is it worth its cost. Measured on
torch 2.13 CPU: the row-scaled int8 layers always do (exact integer products, a scale per
row); bf16 and fp16 matmuls do on the machines tried; fp32 does not (a one-row product
takes MKL's matrix-vector kernel, 1e-6 apart); CUDA GEMMs choose kernels by shape. Since
the half-precision result depends on the CPU's kernels, it is probed on the model's own
layers at load time rather than assumed.

On a CPU with AVX-512-BF16 (torch 2.13, oneDNN) a one-row bf16 product takes another kernel
than two or more rows, while every row of a 2..64-row product is the same bits wherever it
stands: there a one-row input is computed as a pair (itself twice, ``PairedRowLinear``), which
makes the layer row-independent."""

from __future__ import annotations

import logging
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("specctl.engine")

PROBE_ROWS = 8


def candidate(device: str, dtype: str, quant: str) -> bool:
    """Where row independence can hold at all (a pure decision, no probe)."""
    return device == "cpu" and (quant == "int8" or dtype in ("bf16", "fp16"))


def linear_rows_independent(linear: nn.Linear, rows: int = 1) -> bool:
    """One layer, probed: each of 8 random rows equals its row in the 8-row product when
    computed alone (``rows`` = 1), or in a pair, first and second (``rows`` = 2)."""
    x = torch.randn(PROBE_ROWS, linear.in_features, generator=torch.Generator().manual_seed(0)).to(linear.weight.dtype)
    with torch.inference_mode():
        together = linear(x)
        if rows == 1:
            return all(torch.equal(linear(x[i : i + 1]), together[i : i + 1]) for i in range(PROBE_ROWS))
        return all(torch.equal(linear(x[[i, j]]), together[[i, j]])
                   for i, j in zip(range(PROBE_ROWS), [*range(1, PROBE_ROWS), 0]))


RowMode = Literal["alone", "pairs"] | None


def decoder_row_mode(decoder: nn.Module, quant: str) -> RowMode:
    """How the decoder's linear layers give each row the same bits in any product: "alone"
    (as they are), "pairs" (with one-row products computed as pairs) or None (not at all).
    Every distinct linear shape of the first layer and the LM head is probed (int8: exact by
    construction)."""
    if quant == "int8":
        return "alone"
    layer = decoder.layers[0]
    linears = [m for m in (*layer.self_attn.modules(), *layer.mlp.modules()) if isinstance(m, nn.Linear)]
    if decoder.lm_head is not None:
        linears.append(decoder.lm_head)
    distinct = list({tuple(linear.weight.shape): linear for linear in linears}.values())  # k and v share a shape, ...
    if all(linear_rows_independent(linear) for linear in distinct):
        return "alone"
    if all(linear_rows_independent(linear, rows=2) for linear in distinct):
        return "pairs"
    log.info("row-exact attention off: %s matmuls are not row-independent on this CPU, so speculative output "
             "may differ from AR in the last bits", distinct[0].weight.dtype)
    return None


class PairedRowLinear(nn.Linear):
    """A linear layer whose one-row products are computed as two rows (the row twice), so a
    decode step's row gets the bits a verification forward gives it among other rows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() != x.shape[-1]:
            return F.linear(x, self.weight, self.bias)
        pair = x.reshape(1, -1).repeat(2, 1)  # contiguous rows: a stride-0 view may take another kernel
        return F.linear(pair, self.weight, self.bias)[:1].reshape(*x.shape[:-1], -1)


def pair_single_rows(decoder: nn.Module) -> nn.Module:
    """Every plain nn.Linear of the decoder (layers and LM head) becomes a PairedRowLinear
    sharing its parameters (tied embeddings stay tied). In place."""
    for parent in list(decoder.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                with torch.device("meta"):
                    paired = PairedRowLinear(child.in_features, child.out_features, bias=child.bias is not None)
                paired.weight = child.weight
                if child.bias is not None:
                    paired.bias = child.bias
                setattr(parent, name, paired)
    return decoder
