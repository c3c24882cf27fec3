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
input is scaled and quantized once and fbgemm is called once.

Memory: the model is loaded in its checkpoint's dtype (bf16 for the packaged ones) and each
linear is widened to fp32 only while it is quantized, so loading never holds an fp32 copy of
the whole model; the embedding table stays in its 16-bit dtype (``CompactEmbedding``): the
LM head has its own int8 copy, and widening a looked-up row is exact."""

from __future__ import annotations

import ctypes
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn
from torch.nn import functional as F

from specctl.config import QUANTS
from specctl.engine.layers import PlainMLP
from specctl.engine.model import Decoder
from specctl.engine.moe import ClampedSwiGLUExpert, CorrectedRouter, SparseMoE, mlps
from specctl.errors import ConfigError

QUANTIZE_WORKERS = 4  # at most: each holds one fp32 copy of a product's weight while it quantizes
_PINNED_COLUMNS = 8  # +1, -1, then zeros: keeps the input width a multiple of 8 for fbgemm


class RowScaledInt8Linear(nn.Module):
    """y = x Wᵀ + b for the row-wise concatenation W of one or more nn.Linear weights."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        super().__init__()
        self.in_features = linears[0].in_features
        out_features = sum(linear.out_features for linear in linears)
        # Widened to fp32 straight into the padded matrix (exact from bf16/fp16): one transient copy.
        padded = torch.zeros(out_features, self.in_features + _PINNED_COLUMNS)
        row = 0
        for linear in linears:
            padded[row : row + linear.out_features, : self.in_features] = linear.weight.detach()
            row += linear.out_features
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
        y = self.rows_product(x.reshape(-1, self.in_features).float())
        return y.view(*shape[:-1], self.out_features)

    def rows_product(self, rows: torch.Tensor) -> torch.Tensor:
        """The product of float32 rows [n, in]: [n, out] (engine.decode_step calls it on its rows as they are)."""
        # An all-zero row stays zero: 0 / tiny = 0.
        row_max = rows.abs().amax(-1, keepdim=True).clamp_min_(1e-30)
        pins = self.pins if rows.shape[0] == 1 else self.pins.expand(rows.shape[0], -1)
        pinned = torch.cat((rows / row_max, pins), 1)
        y = torch.ops.quantized.linear_dynamic(pinned, self._packed, True).mul_(row_max)
        return y if self.bias is None else y.add_(self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel, row-scaled"


class CompactEmbedding(nn.Module):
    """An embedding table kept in its checkpoint's 16-bit dtype whose looked-up rows are widened
    to the model's fp32: bit-identical to a widened table (bf16/fp16 -> fp32 is exact) at half
    the memory (466 MB saved for Qwen2.5 1.5B's 151,936 x 1,536 table)."""

    def __init__(self, weight: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        # A copy: a table loaded as stored may be a view of the mapped checkpoint file, which
        # would then stay mapped (and resident) as long as the model lives.
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.out_dtype = out_dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight).to(self.out_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, stored {self.weight.dtype}, rows as {self.out_dtype}"


def quantize_decoder(decoder: Decoder, mode: str) -> Decoder:
    """Replace every linear layer of ``decoder`` (in place) with row-scaled int8 ones; the rest
    becomes fp32, but for a 16-bit embedding table, which stays compact. ``decoder`` may be in
    any float dtype (its checkpoint's: each linear is widened only while it is quantized)."""
    if mode == "none":
        return decoder
    if mode != "int8":
        raise ConfigError(f"quantization must be one of {', '.join(QUANTS)}, got {mode!r}")
    if decoder.device.type != "cpu":
        raise ConfigError("int8 quantization runs on the CPU only; use --draft-quant none / --quant none on CUDA")
    plan: list[tuple[nn.Module, str, list[nn.Linear]]] = []  # (parent, attribute, the linears it fuses)
    for layer in decoder.layers:
        attn = layer.self_attn
        if attn.k_proj is None:  # a latent attention (DeepSeek-V3), or one fused already: each projection alone
            for name, child in list(attn.named_children()):
                # an absorbing latent attention reads kv_b_proj's weight per head: it stays as loaded
                if type(child) is nn.Linear and not (name == "kv_b_proj" and getattr(attn, "absorbed", False)):
                    plan.append((attn, name, [child]))
        else:
            plan.append((attn, "qkv_proj", [attn.q_proj, attn.k_proj, attn.v_proj]))
            attn.q_proj = attn.k_proj = attn.v_proj = None
            plan.append((attn, "o_proj", [attn.o_proj]))
        # a sparse layer's router too: a float one's scores differ in the last bits between a
        # batch and a row alone (this CPU's fp32 products), and a token's experts with them
        if isinstance(layer.mlp, SparseMoE) and not isinstance(layer.mlp.gate, CorrectedRouter):
            # (GLM-4.5's router computes in float64: row-independent, and kept as transformers keeps it)
            plan.append((layer.mlp, "gate", [layer.mlp.gate]))
            if layer.mlp.shared_expert_gate is not None:  # Qwen2-MoE's shared expert's gate, for the same reason
                plan.append((layer.mlp, "shared_expert_gate", [layer.mlp.shared_expert_gate]))
        for mlp in mlps(layer.mlp):  # a sparse layer's experts each
            if isinstance(mlp, PlainMLP):  # StarCoder2's: no gate
                plan += [(mlp, "c_fc", [mlp.c_fc]), (mlp, "c_proj", [mlp.c_proj])]
                continue
            if isinstance(mlp, ClampedSwiGLUExpert):  # gpt-oss's: gate/up one projection already, biases beside
                plan += [(mlp, "gate_up_proj", [mlp.gate_up_proj]), (mlp, "down_proj", [mlp.down_proj])]
                continue
            plan += [(mlp, "gate_up_proj", [mlp.gate_proj, mlp.up_proj]), (mlp, "down_proj", [mlp.down_proj])]
            mlp.gate_proj = mlp.up_proj = None
    if decoder.lm_head is not None:
        plan.append((decoder, "lm_head", [decoder.lm_head]))
    # Quantizing and fbgemm's packing are mostly single-threaded: products in parallel (the
    # 0.5B draft's 97, loaded after the 1.5B target, 6.8-9.5 -> 5.4-5.9 s on 2 cores), the
    # largest first (its head alone is 40 % of the work: started last, it ran alone at the
    # end; 4.5-4.9 -> 3.3-3.6 s); each product is built alone, so the model is the same bit
    # for bit with any number of workers in any order.
    largest_first = sorted(range(len(plan)), key=lambda i: -sum(linear.weight.numel() for linear in plan[i][2]))
    with ThreadPoolExecutor(max(1, min(QUANTIZE_WORKERS, torch.get_num_threads()))) as pool:
        products = {i: pool.submit(RowScaledInt8Linear, plan[i][2]) for i in largest_first}
        replaced = [(parent, name) for parent, name, _ in plan]
        plan.clear()  # each float weight freed once its product is built and replaces it
        for i, (parent, name) in enumerate(replaced):
            setattr(parent, name, products.pop(i).result())
    embedding = decoder.embed_tokens
    decoder.embed_tokens = None  # kept out of the widening below
    decoder.float()  # norms (and anything not quantized) compute in fp32, as before
    if embedding is not None:
        weight = embedding.weight
        decoder.embed_tokens = (CompactEmbedding(weight) if weight.dtype in (torch.bfloat16, torch.float16)
                                else embedding.float())
    _return_freed_memory()
    return decoder


def _return_freed_memory() -> None:
    """Hand the heap pages the widened copies freed back to the OS (glibc keeps them otherwise:
    measured, 300 MB of a 1.5B model's resident memory); a no-op where libc is not glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
