"""The logits -> probabilities transform shared by target and draft, and sampling from them
(the parameters: spec.params)."""

from __future__ import annotations

import torch

from specctl.spec.params import SAMPLER_ORDER, SamplingParams


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p in the request's order (by default temperature, then
    top-k, then top-p, then min-p: transformers' order and semantics; llama.cpp's puts
    temperature last); float32 probabilities over the last dimension. Greedy gives a one-hot
    argmax distribution (in any order: no sampler drops the likeliest token)."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    for sampler in params.sampler_order or SAMPLER_ORDER:
        if sampler == "temperature":
            logits = logits / params.temperature
        elif sampler == "top_k" and params.top_k and params.top_k < logits.shape[-1]:
            kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        elif sampler == "top_p" and params.top_p < 1.0:
            sorted_logits, sorted_idx = logits.sort(dim=-1)
            cum = sorted_logits.softmax(-1).cumsum(-1)
            remove = cum <= (1 - params.top_p)
            remove[..., -1] = False  # always keep the most likely token
            logits = logits.masked_fill(remove.scatter(-1, sorted_idx, remove), float("-inf"))
        elif sampler == "min_p" and params.min_p:
            probs = logits.softmax(-1)
            logits = logits.masked_fill(probs < params.min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    return logits.softmax(-1)


# A sampled draft draws from its top DRAFT_SUPPORT tokens only (renormalised). Verification
# uses that q exactly, so this stays lossless; it keeps q sparse, so a round's frame is
# kilobytes at any vocabulary size, and costs acceptance only the draft's tail mass.
DRAFT_SUPPORT = 256


def keep_top(probs: torch.Tensor, k: int) -> torch.Tensor:
    """``probs`` with all but its ``k`` most likely tokens set to 0, renormalised."""
    if k >= probs.shape[-1]:
        return probs
    values, ids = probs.topk(k, dim=-1)
    kept = torch.zeros_like(probs).scatter_(-1, ids, values)
    return kept / kept.sum(-1, keepdim=True)


def uniform(generator: torch.Generator | None) -> float:
    """One uniform draw in [0, 1) from the session's generator, which lives on the CPU
    whatever device the model is on (a seed then means the same stream everywhere)."""
    return float(torch.rand((), generator=generator, dtype=torch.float64))


def sample_tensor(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token drawn from ``probs`` (1-D, any device, need not sum to 1) as a 0-d tensor on
    the probabilities' device, without waiting for the device: the CDF is inverted at a
    uniform from the CPU ``generator`` (a seed means the same stream on every device), and
    zero-probability tokens are never drawn. -1 when ``probs`` has no mass."""
    cdf = probs.double().cumsum(-1)
    point = cdf[-1:] * uniform(generator)
    index = torch.searchsorted(cdf, point, right=True)[0]
    # u rounded onto the total lands past the end: take the last token with mass.
    last = torch.where(probs > 0, torch.arange(probs.shape[-1], device=probs.device), -1).max()
    return torch.minimum(index, last)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """``sample_tensor``, read back (one device sync)."""
    return checked_token(int(sample_tensor(probs, generator)))


def checked_token(token: int) -> int:
    if token < 0:
        raise ValueError("cannot sample from a distribution with no mass")
    return token


def saguaro(probs: torch.Tensor, fanout: int, c: float) -> torch.Tensor:
    """Saguaro sampling (SSD, Theorem 15): the ``fanout + 1`` most likely tokens' probabilities
    times ``c`` in (0, 1], renormalised. Drafting from this q pushes the residual max(0, p - q)
    onto the tokens pre-speculation caches as bonus candidates; verification must use this
    q (the one sampled from), so it stays lossless. c = 1 is plain sampling."""
    if not 0.0 < c <= 1.0:
        raise ValueError(f"the Saguaro constant must be in (0, 1], got {c}")
    if c == 1.0 or fanout < 0:
        return probs
    ids = probs.topk(min(fanout + 1, probs.shape[-1]), dim=-1).indices
    scaled = probs.clone()
    scaled.scatter_(-1, ids, probs.gather(-1, ids) * c)
    return scaled / scaled.sum(-1, keepdim=True)
