"""A pipeline stage run in this process: layers [a, b) of a loaded decoder, with its embedding
and/or norm + head, sharing the weights (no copy)."""

from __future__ import annotations

import torch
from torch import nn

from specctl.engine.model import Decoder


def decoder_part(decoder: Decoder, layer_range: tuple[int, int], embed: bool, head: bool) -> Decoder:
    """Layers ``layer_range`` of ``decoder`` (within its own), with its embedding (``embed``) and/or
    its final norm and head (``head``), the same modules: nothing is copied."""
    first, last = layer_range
    own_first, own_last = decoder.layer_range
    if not own_first <= first < last <= own_last or (embed and decoder.embed_tokens is None) \
            or (head and decoder.lm_head is None):
        raise ValueError(f"decoder with layers {own_first}:{own_last} has no part {first}:{last}"
                         f"{' with the embedding' if embed else ''}{' with the head' if head else ''}")
    with torch.device("meta"):
        part = Decoder(decoder.spec, layer_range, embed=False, head=False)
    part.layers = nn.ModuleList(list(decoder.layers)[first - own_first : last - own_first])
    if embed:
        part.embed_tokens = decoder.embed_tokens
    if head:
        part.norm, part.lm_head = decoder.norm, decoder.lm_head
    part.has_embed, part.has_head = embed, head
    part.inv_freq, part.rope_scaling = decoder.inv_freq, decoder.rope_scaling
    part.local_inv_freq, part.local_rope_scaling = decoder.local_inv_freq, decoder.local_rope_scaling
    return part
