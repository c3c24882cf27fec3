"""Sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral, Qwen2-MoE, gpt-oss): a router picks each
token's top-k experts, whose outputs are summed with the router's weights, as transformers
computes it; Qwen2-MoE adds a shared expert every token runs, scaled by a sigmoid gate of its
own; gpt-oss's experts are clamped SwiGLUs with biases (ClampedSwiGLUExpert).

Each token's result depends on its own row only: every expert runs over the rows routed to it
(a product whose rows are independent wherever the dense layers' are: engine.rows probes the
experts too), and a token's expert outputs are added in expert order whatever else shares the
forward. So a verification's rows get what AR decoding gets, as with a dense MLP."""

from __future__ import annotations

from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, normalize: bool,
                 expert: Callable[[], nn.Module], shared_expert: Callable[[], nn.Module] | None = None,
                 softmax_over_chosen: bool = False) -> None:
        super().__init__()
        # the router (checkpoints call it gate; gpt-oss's, router, has a bias)
        self.gate = nn.Linear(hidden, num_experts, bias=softmax_over_chosen)
        self.experts = nn.ModuleList(expert() for _ in range(num_experts))
        self.top_k, self.normalize = top_k, normalize  # normalize: the top-k weights rescaled to sum to 1
        # gpt-oss: the top-k logits chosen first, their softmax (in the logits' dtype) the weights
        self.softmax_over_chosen = softmax_over_chosen
        # Qwen2-MoE: one more expert every token runs, its output times sigmoid(its gate)
        self.shared_expert = None if shared_expert is None else shared_expert()
        self.shared_expert_gate = None if shared_expert is None else nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        logits = self.gate(h)
        if self.softmax_over_chosen:
            top, chosen = torch.topk(logits, self.top_k, dim=-1)
            weights = F.softmax(top, dim=-1, dtype=top.dtype)
        else:
            weights, chosen = torch.topk(F.softmax(logits, dim=-1, dtype=torch.float32), self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(logits.dtype)
        out = torch.zeros_like(h)
        for expert in chosen.unique().tolist():  # ascending: each token's experts add in one order
            tokens, slots = torch.where(chosen == expert)
            y = self.experts[expert](h[tokens]) * weights[tokens, slots, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        if self.shared_expert is not None:  # added after the routed experts, as transformers adds it
            out = out + torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h)
        return out.reshape(shape)


def mlps(mlp: nn.Module) -> Iterator[nn.Module]:
    """The dense MLPs of a layer's MLP: itself, or a sparse one's experts (and shared expert)."""
    if isinstance(mlp, SparseMoE):
        yield from mlp.experts
        if mlp.shared_expert is not None:
            yield mlp.shared_expert
    else:
        yield mlp


class ClampedSwiGLUExpert(nn.Module):
    """gpt-oss's expert, as transformers' GptOssExperts computes one: gate and up interleaved in
    one projection (even columns gate, odd up), each product and its bias added apart (two
    roundings, as x @ W + b), the gate clamped above and up on both sides at ``limit``, then
    (up + 1) * gate * sigmoid(alpha * gate). The projections are bias-free nn.Linear layers, so
    row padding and int8 treat them as any other (their biases stay beside them)."""

    def __init__(self, hidden: int, inner: int, alpha: float, limit: float) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inner, bias=False)
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(2 * inner))
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.down_proj_bias = nn.Parameter(torch.zeros(hidden))
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x) + self.gate_up_proj_bias
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return self.down_proj((up + 1) * (gate * torch.sigmoid(gate * self.alpha))) + self.down_proj_bias
