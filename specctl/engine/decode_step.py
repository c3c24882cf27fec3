"""One token a session through Llama-shaped layers on the CPU, as straight-line tensor code.

The modules' forward serves every case — several sessions, masks, windows, each family's norms
and rotations — and for a single decode token on the CPU that generality costs: the 0.5B int8
draft's step 29.9 ms median through the modules, 28.0 here (2026-12-07, 2-core EPYC, alternated;
`examples/decode_step_cost.py`). A draft drafts token by token, so every speculative round pays
it d times. Here the same operations run in the same order on the same values, minus the
dispatching: each layer's tensors are looked up once, at build. The bits equal the modules'
(tests/test_decode_step.py, per family, dtype and quantization). Several sessions with a token
each (a draft server's batched step) run as one such step, each attending over its own cache; a
decoder of another shape, a masked forward or one of more tokens a session takes the modules'."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from specctl.engine.layers import MLP, Attention
from specctl.engine.norms import RMSNorm, rms_norm
from specctl.engine.rope import apply_rope

Product = Callable[[torch.Tensor], torch.Tensor]


def fits(decoder: nn.Module) -> bool:
    """Whether ``decoder``'s one-token steps can run here (a pure decision on its shape): a full
    model on the CPU whose every layer is Llama's (pre-norms, one attention over all keys, a gated
    SiLU MLP, RoPE in the halves layout over all or a leading part of each head) with plain RMSNorms."""
    spec = decoder.spec
    if decoder.device.type != "cpu" or not (decoder.has_embed and decoder.has_head) or decoder.static is not None:
        return False
    if not spec.llama_layers or spec.window is not None or spec.qk_norm_after_rope:
        return False
    return all(_layer_fits(layer) for layer in decoder.layers)


def _layer_fits(layer: nn.Module) -> bool:
    attn, mlp = layer.self_attn, layer.mlp
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if attn.q_norm is not None:
        norms += [attn.q_norm, attn.k_norm]
    return (type(attn) is Attention and type(mlp) is MLP and attn.window is None and layer.rotates
            and not layer.rotates_locally and all(type(n) is RMSNorm and not n.scale_in_float32 for n in norms))


def _product(linear: nn.Module) -> Product:
    """x [1, in] -> [1, out] as ``linear`` computes it: a row-scaled int8 layer's core on the
    row itself (its forward only reshapes around it), any other through its forward."""
    return getattr(linear, "rows_product", None) or linear.forward


class _Layer:
    """One layer's parts, looked up once."""

    __slots__ = ("norm_in", "norm_post", "eps", "eps_post", "qkv", "q", "k", "v", "sizes", "q_norm", "k_norm",
                 "o", "gate_up", "gate", "up", "down", "act", "attn", "heads", "kv_heads", "head_dim")

    def __init__(self, layer: nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.norm_in, self.eps = layer.input_layernorm.weight, layer.input_layernorm.eps
        self.norm_post, self.eps_post = layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps
        fused = attn.qkv_proj is not None
        self.qkv = _product(attn.qkv_proj) if fused else None
        self.q, self.k, self.v = (None, None, None) if fused else map(_product, (attn.q_proj, attn.k_proj, attn.v_proj))
        self.sizes = attn.qkv_sizes
        self.q_norm, self.k_norm = attn.q_norm, attn.k_norm
        self.o = _product(attn.o_proj)
        fused = mlp.gate_up_proj is not None
        self.gate_up = _product(mlp.gate_up_proj) if fused else None
        self.gate, self.up = (None, None) if fused else (_product(mlp.gate_proj), _product(mlp.up_proj))
        self.down, self.act = _product(mlp.down_proj), mlp.act
        self.attn = attn  # its ``attend`` read at each step (row-exact attention replaces it)
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches: list, index: int) -> torch.Tensor:
        """Attention.forward and MLP.forward inside DecoderLayer.forward's residuals, for x
        [N, hidden], a row for each of N sessions (cos, sin [N, 1, D]): a row's heads as rows
        [H, D], to which the element-wise and per-row operations give the modules' bits."""
        n = x.shape[0]
        h = rms_norm(x, self.norm_in, self.eps)
        if self.qkv is not None:
            q, k, v = self.qkv(h).split(self.sizes, dim=-1)
        else:
            q, k, v = self.q(h), self.k(h), self.v(h)
        q, k = q.reshape(n, self.heads, self.head_dim), k.reshape(n, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        v = v.reshape(n, self.kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin).to(v.dtype), apply_rope(k, cos, sin).to(v.dtype)
        outs = []
        for row, cache in enumerate(caches):  # each session attends over its own cache
            keys, values = cache.write(index, k[row].view(1, self.kv_heads, 1, self.head_dim),
                                       v[row].view(1, self.kv_heads, 1, self.head_dim))
            out = self.attn.attend(q[row].view(1, self.heads, 1, self.head_dim), keys, values, None)
            outs.append(out.reshape(1, -1))
        x = x + self.o(outs[0] if n == 1 else torch.cat(outs))
        h = rms_norm(x, self.norm_post, self.eps_post)
        if self.gate_up is not None:
            gate, up = self.gate_up(h).chunk(2, dim=-1)
        else:
            gate, up = self.gate(h), self.up(h)
        return x + self.down(self.act(gate) * up)


class DecodeStep:
    """A decoder's one-token steps (build only where ``fits``)."""

    def __init__(self, decoder: nn.Module) -> None:
        self.decoder = decoder
        self.layers = [_Layer(layer) for layer in decoder.layers]

    def run(self, ids: torch.Tensor, positions: torch.Tensor, caches: list, rows: torch.Tensor | None) -> torch.Tensor:
        """Decoder.forward_ragged (Decoder.forward for one session) for one token of each of the
        sessions of ``caches``, without masks: ids and positions [N]; logits at ``rows`` (None: all)."""
        decoder = self.decoder
        x = decoder.embed(ids.to(decoder.device))
        ropes = decoder._ropes(positions.to(decoder.device), x.dtype)
        for index, (layer, (cos, sin)) in enumerate(zip(self.layers, ropes)):
            x = layer(x, cos[0, 0, :, None], sin[0, 0, :, None], caches, index)
        for cache in caches:
            cache.commit(1)
        if rows is not None:
            x = x[rows.to(decoder.device)]
        return decoder.logits(decoder.norm(x))
