"""Whether a model's linear layers give each row the same bits alone or among other rows.

Only then does row-exact attention (``specctl_kernels.row_exact``) make a verification
forward reproduce AR decoding bit for bit, so only then is it worth its cost. Measured on
torch 2.13 CPU: the row-scaled int8 layers always do (exact integer products, a scale per
row); bf16 and fp16 matmuls do on the machines tried; fp32 does not (a one-row product
takes MKL's matrix-vector kernel, 1e-6 apart); CUDA GEMMs choose kernels by shape. Since
the half-precision result depends on the CPU's kernels, it is probed on the model's own
layers at load time rather than assumed."""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("specctl.engine")

PROBE_ROWS = 8


def candidate(device: str, dtype: str, quant: str) -> bool:
    """Where row independence can hold at all (a pure decision, no probe)."""
    return device == "cpu" and (quant == "int8" or dtype in ("bf16", "fp16"))


def linear_rows_independent(linear: nn.Linear) -> bool:
    """One layer, probed: each of 8 random rows alone equals its row in the 8-row product."""
    x = torch.randn(PROBE_ROWS, linear.in_features, generator=torch.Generator().manual_seed(0)).to(linear.weight.dtype)
    with torch.inference_mode():
        together = linear(x)
        return all(torch.equal(linear(x[i : i + 1]), together[i : i + 1]) for i in range(PROBE_ROWS))


def decoder_rows_independent(decoder: nn.Module, quant: str) -> bool:
    """Every distinct linear shape of the decoder's first layer and its LM head, probed
    (int8: exact by construction)."""
    if quant == "int8":
        return True
    layer = decoder.layers[0]
    linears = [m for m in (*layer.self_attn.modules(), *layer.mlp.modules()) if isinstance(m, nn.Linear)]
    if decoder.lm_head is not None:
        linears.append(decoder.lm_head)
    distinct = {tuple(linear.weight.shape): linear for linear in linears}  # k and v share a shape, ...
    for linear in distinct.values():
        if not linear_rows_independent(linear):
            log.info("row-exact attention off: %s matmuls of shape %s are not row-independent on this CPU, "
                     "so speculative output may differ from AR in the last bits", linear.weight.dtype,
                     tuple(linear.weight.shape))
            return False
    return True
