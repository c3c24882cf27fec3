"""Sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral, Qwen2-MoE, gpt-oss, GLM-4.5, Llama 4): a router picks each
token's top-k experts, whose outputs are summed with the router's weights, as transformers
computes it; Qwen2-MoE adds a shared expert every token runs, scaled by a sigmoid gate of its
own; gpt-oss's experts are clamped SwiGLUs with biases (ClampedSwiGLUExpert).

Each token's result depends on its own row only: every expert runs over the rows routed to it
(a product whose rows are independent wherever the dense layers' are: engine.rows probes the
experts too), and a token's expert outputs are added in expert order whatever else shares the
forward. So a verification's rows get what AR decoding gets, as with a dense MLP."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn


ROUTINGS = ("softmax", "softmax_over_chosen", "sigmoid_grouped", "softmax_grouped", "sigmoid_on_input")


@dataclass(frozen=True, slots=True)
class Routing:
    """How a router's scores pick a token's experts and weigh them, as each family's transformers
    code does: ``softmax`` over all experts, then the top k (Qwen-MoE, Mixtral); ``softmax_over_chosen``:
    the top-k logits, softmaxed among themselves (gpt-oss, whose router has a bias); ``sigmoid_grouped``
    (GLM-4.5, DeepSeek-V3): sigmoid scores plus a learned correction choose the top k within the
    ``top_groups`` best of ``groups`` expert groups, the uncorrected scores weigh them, times ``scale``;
    ``softmax_grouped`` (DeepSeek-V2): float32 softmax scores, the top k within the best groups (by
    their best score), weighed by those scores times ``scale``, never renormalised;
    ``sigmoid_on_input`` (Llama 4): the top-k logits' float32 sigmoids, in the model's dtype, weigh
    each expert's input rather than its output."""

    kind: str = "softmax"
    normalize: bool = False  # the top-k weights rescaled to sum to 1
    groups: int = 1
    top_groups: int = 1
    scale: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ROUTINGS:
            raise ValueError(f"unknown routing {self.kind!r}")


class CorrectedRouter(nn.Module):
    """GLM-4.5's and DeepSeek-V3's router: logits in float32 (transformers keeps its weight in
    float32), with the per-expert score correction beside it. Computed in float64 and rounded, so a
    token's scores do not depend on the rows beside it (a float32 product's last bits do, on a CPU:
    engine.rows), and verification routes each token as a decode step does. Not an nn.Linear, so
    row padding and int8 leave it as it is."""

    def __init__(self, hidden: int, num_experts: int, corrected: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        if corrected:  # (DeepSeek-V2's router has no correction: its float32 logits only)
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.double(), self.weight.double()).float()


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, routing: Routing,
                 expert: Callable[[], nn.Module], shared_expert: Callable[[], nn.Module] | None = None,
                 gated_shared_expert: bool = True) -> None:
        super().__init__()
        self.routing, self.top_k = routing, top_k
        # the router (checkpoints call it gate; gpt-oss's, router, has a bias)
        self.gate = (CorrectedRouter(hidden, num_experts, routing.kind == "sigmoid_grouped")
                     if routing.kind in ("sigmoid_grouped", "softmax_grouped")
                     else nn.Linear(hidden, num_experts, bias=routing.kind == "softmax_over_chosen"))
        self.experts = nn.ModuleList(expert() for _ in range(num_experts))
        # one more expert every token runs: Qwen2-MoE's times sigmoid(its gate), GLM-4.5's as it is
        self.shared_expert = None if shared_expert is None else shared_expert()
        self.shared_expert_gate = (nn.Linear(hidden, 1, bias=False) if shared_expert is not None and gated_shared_expert
                                   else None)

    @property
    def normalize(self) -> bool:
        return self.routing.normalize

    def choose(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, chosen experts) of each row of h: [rows, top_k] each."""
        routing, logits = self.routing, self.gate(h)
        if routing.kind == "sigmoid_grouped":
            scores = logits.sigmoid()
            # a group's score: its two best corrected scores' sum (DeepSeek-V3's)
            corrected = _within_best_groups(scores + self.gate.e_score_correction_bias, routing,
                                            lambda grouped: grouped.topk(2, dim=-1)[0].sum(-1), float("-inf"))
            chosen = torch.topk(corrected, self.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, chosen)
            if routing.normalize:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            return weights * routing.scale, chosen
        if routing.kind == "softmax_grouped":
            # a group's score: its best score (DeepSeek-V2's group_limited_greedy)
            scores = _within_best_groups(logits.softmax(-1, dtype=torch.float32), routing,
                                         lambda grouped: grouped.amax(-1), 0.0)
            weights, chosen = torch.topk(scores, self.top_k, dim=-1, sorted=False)
            return weights * routing.scale, chosen
        if routing.kind == "sigmoid_on_input":
            top, chosen = torch.topk(logits, self.top_k, dim=-1)
            return torch.sigmoid(top.float()).to(logits.dtype), chosen
        if routing.kind == "softmax_over_chosen":
            top, chosen = torch.topk(logits, self.top_k, dim=-1)
            weights = F.softmax(top, dim=-1, dtype=top.dtype)
        else:
            weights, chosen = torch.topk(F.softmax(logits, dim=-1, dtype=torch.float32), self.top_k, dim=-1)
        if routing.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        weights, chosen = self.choose(h)
        out = torch.zeros_like(h)
        for expert in chosen.unique().tolist():  # ascending: each token's experts add in one order
            tokens, slots = torch.where(chosen == expert)
            if self.routing.kind == "sigmoid_on_input":  # Llama 4 weighs the expert's input
                y = self.experts[expert](h[tokens] * weights[tokens, slots, None])
            else:
                y = self.experts[expert](h[tokens]) * weights[tokens, slots, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        if self.shared_expert is not None:  # added after the routed experts, as transformers adds it
            shared = self.shared_expert(h)
            out = out + (shared if self.shared_expert_gate is None else torch.sigmoid(self.shared_expert_gate(h)) * shared)
        return out.reshape(shape)


def _within_best_groups(scores: torch.Tensor, routing: Routing, group_score: Callable[[torch.Tensor], torch.Tensor],
                        fill: float) -> torch.Tensor:
    """``scores`` [rows, experts] with the experts outside each row's ``routing.top_groups`` best
    groups (by ``group_score`` of a group's scores) set to ``fill``, so the top k falls within them."""
    if routing.groups == 1:
        return scores
    grouped = scores.unflatten(-1, (routing.groups, -1))
    best = torch.topk(group_score(grouped), routing.top_groups, dim=-1, sorted=False)[1]
    kept = torch.zeros_like(grouped[..., 0]).scatter_(1, best, 1).bool()
    return grouped.masked_fill(~kept[..., None], fill).flatten(-2)


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
