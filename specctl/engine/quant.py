"""int8 models on the CPU (fbgemm kernels), whose rows do not depend on their neighbours.

A decode step is memory-bound on CPU, so int8 weights (a scale per output channel) make
it 2-3x faster. A draft may be any model at all — verification uses the q it actually
sampled from — so a quantized draft is still exactly lossless; only acceptance changes.

Why not ``torch.ao.quantization.quantize_dynamic``: it picks ONE activation scale for the
whole input, so when the draft server batches several sessions into one forward, each
session's result depends on the others — one new session's prompt, whose first token has
hidden states hundreds of times larger than the rest, coarsens everyone's quantization
(measured: agreement with the target fell from 33% to 27% of positions). Here every row
is scaled by its own max |x| and quantized on one fixed grid; the grid is pinned by two
extra input columns holding +1 and -1 (their weights are 0). fbgemm then sees the same
range in every call, the integer products are exact, and a row's output is bit-for-bit
the same alone or in any batch. So an int8 target may batch its sessions as well.

q/k/v and gate/up read the same input, so each group runs as one fused projection: the
input is scaled and quantized once and fbgemm is called once."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from specctl.config import QUANTS
from specctl.engine.model import Decoder
from specctl.errors import ConfigError

_PINNED_COLUMNS = 8  # +1, -1, then zeros: keeps the input width a multiple of 8 for fbgemm


class RowScaledInt8Linear(nn.Module):
    """y = x Wᵀ + b for the row-wise concatenation W of one or more nn.Linear weights."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        super().__init__()
        weight = torch.cat([linear.weight.detach().float() for linear in linears])
        out_features, self.in_features = weight.shape
        padded = torch.cat((weight, weight.new_zeros(out_features, _PINNED_COLUMNS)), 1)
        scales = (padded.abs().amax(1) / 127).clamp_min(1e-12).double()
        with warnings.catch_warnings():
            # torch deprecates quantized tensors in favour of torchao; 2.13 (pinned) has them.
            warnings.simplefilter("ignore")
            qweight = torch.quantize_per_channel(padded, scales, torch.zeros(out_features, dtype=torch.long), 0,
                                                 torch.qint8)
        self._packed = torch.ops.quantized.linear_prepack(qweight, None)
        biases = [linear.bias for linear in linears]
        if any(b is not None for b in biases):
            bias = torch.cat([b.detach().float() if b is not None else torch.zeros(l.out_features)
                              for b, l in zip(biases, linears)])
            self.register_buffer("bias", bias)
        else:
            self.bias = None
        pins = torch.zeros(1, _PINNED_COLUMNS)
        pins[0, 0], pins[0, 1] = 1.0, -1.0
        self.register_buffer("pins", pins)
        self.out_features = out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features).float()
        # An all-zero row stays zero: 0 / tiny = 0.
        row_max = rows.abs().amax(-1, keepdim=True).clamp_min_(1e-30)
        pinned = torch.cat((rows / row_max, self.pins.expand(rows.shape[0], -1)), 1)
        y = torch.ops.quantized.linear_dynamic(pinned, self._packed, True).mul_(row_max)
        if self.bias is not None:
            y.add_(self.bias)
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel, row-scaled"


def quantize_decoder(decoder: Decoder, mode: str) -> Decoder:
    """Replace every linear layer of ``decoder`` (in place) with row-scaled int8 ones."""
    if mode == "none":
        return decoder
    if mode != "int8":
        raise ConfigError(f"quantization must be one of {', '.join(QUANTS)}, got {mode!r}")
    if decoder.device.type != "cpu":
        raise ConfigError("int8 quantization runs on the CPU only; use --draft-quant none / --quant none on CUDA")
    if decoder.dtype != torch.float32:
        decoder = decoder.float()
    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = RowScaledInt8Linear([attn.q_proj, attn.k_proj, attn.v_proj])
        attn.q_proj = attn.k_proj = attn.v_proj = None
        attn.o_proj = RowScaledInt8Linear([attn.o_proj])
        mlp.gate_up_proj = RowScaledInt8Linear([mlp.gate_proj, mlp.up_proj])
        mlp.gate_proj = mlp.up_proj = None
        mlp.down_proj = RowScaledInt8Linear([mlp.down_proj])
    if decoder.lm_head is not None:
        decoder.lm_head = RowScaledInt8Linear([decoder.lm_head])
    return decoder
