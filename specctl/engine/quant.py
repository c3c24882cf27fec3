"""Draft quantization. A draft may be any model at all — verification uses the q it
actually sampled from — so a quantized draft is still exactly lossless, only its
acceptance may change. int8 dynamic quantization (int8 weights, per-batch activation
scales, fbgemm kernels) halves the draft's memory traffic on CPU, where a decode step is
memory-bound."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from specctl.engine.model import Decoder
from specctl.errors import ConfigError

QUANT_MODES = ("none", "int8")


def quantize_decoder(decoder: Decoder, mode: str) -> Decoder:
    if mode == "none":
        return decoder
    if mode != "int8":
        raise ConfigError(f"draft quantization must be one of {', '.join(QUANT_MODES)}, got {mode!r}")
    if decoder.device.type != "cpu":
        raise ConfigError("int8 draft quantization runs on the CPU only; use --draft-quant none on CUDA")
    if decoder.dtype != torch.float32:
        decoder = decoder.float()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's eager quantization is deprecated in favour of torchao
        return torch.ao.quantization.quantize_dynamic(decoder, {nn.Linear}, dtype=torch.qint8)
