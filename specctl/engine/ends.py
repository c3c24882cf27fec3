"""The model's two ends, as each family computes them: token embeddings scaled (Gemma, Granite)
and logits divided, scaled and soft-capped (Granite, Cohere, Gemma 2), always in float32."""

from __future__ import annotations

import torch
from torch import nn

from specctl.engine.spec import ModelSpec


def scaled_embedding(spec: ModelSpec, table: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """Token embeddings, scaled where the model scales them (Gemma: by sqrt(hidden) rounded to
    its dtype, as transformers rounds it; Granite: by its embedding multiplier, a Python number)."""
    x = table(ids)
    scale = spec.embed_scale
    if scale is not None and spec.embed_scale_in_dtype:
        scale = torch.tensor(scale, dtype=x.dtype).item()  # a Python number: no tensor to move
    return x if scale is None else x * scale


def head_logits(spec: ModelSpec, lm_head: nn.Linear, h: torch.Tensor) -> torch.Tensor:
    """float32 logits of normed hidden states h; soft-capped where the model caps them (Gemma 2)."""
    logits = lm_head(h).float()
    if spec.logit_divisor is not None:  # Granite
        logits = logits / spec.logit_divisor
    if spec.logit_scale is not None:  # Cohere
        logits = logits * spec.logit_scale
    if spec.logit_softcap is not None:
        logits = torch.tanh(logits / spec.logit_softcap) * spec.logit_softcap
    return logits
