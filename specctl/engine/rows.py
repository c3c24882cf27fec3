"""Whether a model's linear layers give each row the same bits alone or among other rows.

Only then does row-exact attention (``specctl_kernels.row_exact``) make a verification
forward reproduce AR decoding bit for bit, so only then is it worth its cost. Measured on
torch 2.13 CPU: the row-scaled int8 layers always do (exact integer products, a scale per
row); fp32 does not (a one-row product takes MKL's matrix-vector kernel, 1e-6 apart); CUDA
GEMMs choose kernels by shape. bf16 and fp16 products take one kernel for small row counts
and another from some count on, whose rows all agree wherever they stand: on a CPU with
AVX-512-BF16 (an AMD EPYC, torch 2.13) one row differs from two or more in most products, and
one and two rows differ from three or more in about 1 output element in 10^5 (2026-11-27: a
v_proj row of a tiny model, found by probing many draws; a single draw of 8 rows had missed
it). Such a layer is made row-independent by computing every product of fewer rows than that
count padded to it, the last row repeated (``PaddedRowLinear``). On an AMX Xeon (torch 2.13,
2026-12-03) products of up to 32 rows agree (the down projection's from two rows on) and
larger ones take another kernel, about 1 element in 10^4 apart, so no padding suffices there:
products of more rows are computed in blocks of 32 (a prefill's 512-row products about 2.7x
slower, a verification's of up to 32 rows as fast). Since it depends on the CPU's kernels, the counts are
probed on the model's own layers at load time rather than assumed."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("specctl.engine")

PROBE_ROWS = 8  # rows checked in each product
# Product sizes a verification forward has (a chain of d + 1 rows, a tree of up to 64 nodes):
# every size up to 8, tails of the 4/8/16-row blocks, and the largest.
PROBE_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 13, 16, 32, 64)
# and a prefill's (a chunk of up to 512 rows on the CPU, any remainder after a restored prefix:
# a row-exact target's prefill rows must get the bits its decode steps get): the layers'
# products only, since a prefill takes logits at its last row alone
PREFILL_PROBE_SIZES = (*PROBE_SIZES, 100, 512)
PROBE_ELEMENTS = 1 << 16  # output elements compared a size (draws of PROBE_ROWS rows)
PROBE_DRAWS_MAX = 64
PAD_CANDIDATES = (1, 2, 3, 4, 8)  # the row counts products are padded to, tried in order
# the row counts larger products are computed in blocks of, tried in order after none (a block
# costs a weight read, so the fewest blocks first)
BLOCK_CANDIDATES = (None, 32, 16, 8)


def candidate(device: str, dtype: str, quant: str) -> bool:
    """Where row independence can hold at all (a pure decision, no probe)."""
    return device == "cpu" and (quant == "int8" or dtype in ("bf16", "fp16"))


def padded_product(product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, min_rows: int,
                   max_rows: int | None = None) -> torch.Tensor:
    """``product`` of x [rows, in], more than ``max_rows`` rows computed in blocks of
    ``max_rows``, and fewer than ``min_rows`` rows (a last block too) padded to ``min_rows``,
    the last row repeated (contiguous rows: a stride-0 view may take another kernel)."""
    rows = x.shape[0]
    if max_rows is not None and rows > max_rows:
        return torch.cat([padded_product(product, x[start : start + max_rows], min_rows)
                          for start in range(0, rows, max_rows)])
    if rows >= min_rows:
        return product(x)
    return product(torch.cat([x, x[-1:].repeat(min_rows - rows, 1)]))[:rows]


def linear_rows_independent(linear: nn.Linear, min_rows: int = 1, sizes: tuple[int, ...] = PROBE_SIZES,
                            max_rows: int | None = None) -> bool:
    """One layer, probed: with products of fewer than ``min_rows`` rows padded to it (and of
    more than ``max_rows`` computed in blocks), each of the first rows of a product of every
    size in ``sizes`` equals that row's product alone.
    Every size, since a CPU's kernel blocks rows (in fours, eights, ...) and a tail block can
    take other code. Several random draws where the layer is narrow: another summation order
    changes a half-precision result only where the float32 sum lies near a rounding boundary,
    so a probe must compare enough elements (PROBE_ELEMENTS a size) to see it."""
    draws = min(PROBE_DRAWS_MAX, -(-PROBE_ELEMENTS // (PROBE_ROWS * linear.out_features)))
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for _ in range(draws):
            x = torch.randn(max(sizes), linear.in_features, generator=gen)
            x = x.to(linear.weight.device, linear.weight.dtype)
            alone = [padded_product(linear, x[i : i + 1], min_rows) for i in range(PROBE_ROWS)]
            for size in sizes:
                together = padded_product(linear, x[:size], min_rows, max_rows)
                if not all(torch.equal(together[i : i + 1], alone[i]) for i in range(min(size, PROBE_ROWS))):
                    return False
    return True


def decoder_row_blocks(decoder: nn.Module, quant: str) -> tuple[int, int | None] | None:
    """(min_rows, max_rows): the fewest rows the decoder's linear products must be padded to,
    and the most they may have before they are computed in blocks (None: any), for each row
    to get the same bits in any product ((1, None): as they are); None where no pair of
    PAD_CANDIDATES and BLOCK_CANDIDATES does. Every distinct linear shape of the first layer
    (at a verification's and a prefill's sizes) and the LM head (a verification's) is probed
    (int8: exact by construction)."""
    if quant == "int8":
        return 1, None
    layer = decoder.layers[0]
    linears = [m for m in (*layer.self_attn.modules(), *layer.mlp.modules()) if isinstance(m, nn.Linear)]
    probes = [(linear, PREFILL_PROBE_SIZES)  # one a shape: k and v share one, ...
              for linear in {tuple(linear.weight.shape): linear for linear in linears}.values()]
    if decoder.lm_head is not None:
        probes.append((decoder.lm_head, PROBE_SIZES))
    for max_rows in BLOCK_CANDIDATES:
        for min_rows in PAD_CANDIDATES:
            if max_rows is not None and min_rows > max_rows:
                continue
            if all(linear_rows_independent(linear, min_rows, sizes, max_rows) for linear, sizes in probes):
                return min_rows, max_rows
    # a warning, seen by every command: the output may then leave AR's at a near-tie
    log.warning("row-exact attention off: %s matmuls are not row-independent on this CPU, so speculative output "
                "may differ from AR's where its top logits nearly tie", probes[0][0].weight.dtype)
    return None


class PaddedRowLinear(nn.Linear):
    """A linear layer whose products of fewer than ``min_rows`` rows are computed padded to it,
    and of more than ``max_rows`` in blocks, so a decode step's row (and a short
    verification's) gets the bits a longer verification forward gives it."""

    min_rows: int = 2
    max_rows: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        flat = x.reshape(rows, -1)
        if rows >= self.min_rows and (self.max_rows is None or rows <= self.max_rows):
            return self._product(flat).reshape(*x.shape[:-1], -1)
        return padded_product(self._product, flat, self.min_rows, self.max_rows).reshape(*x.shape[:-1], -1)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def plain_linears(decoder: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, name, layer) of every plain nn.Linear of the decoder (layers and LM head), to
    replace in place (``setattr(parent, name, ...)``)."""
    return [(parent, name, child) for parent in decoder.modules() for name, child in parent.named_children()
            if type(child) is nn.Linear]


def pad_small_products(decoder: nn.Module, min_rows: int, max_rows: int | None = None) -> nn.Module:
    """Every plain nn.Linear of the decoder (layers and LM head) becomes a PaddedRowLinear of
    ``min_rows`` and ``max_rows`` sharing its parameters (tied embeddings stay tied), and every
    PaddedRowLinear already there (engine.packed's) takes them. In place."""
    for layer in decoder.modules():
        if isinstance(layer, PaddedRowLinear):
            layer.min_rows, layer.max_rows = min_rows, max_rows
    for parent, name, child in plain_linears(decoder):
        with torch.device("meta"):
            padded = PaddedRowLinear(child.in_features, child.out_features, bias=child.bias is not None)
        padded.min_rows, padded.max_rows = min_rows, max_rows
        padded.weight = child.weight
        if child.bias is not None:
            padded.bias = child.bias
        setattr(parent, name, padded)
    return decoder


def make_row_exact(decoder: nn.Module, quant: str) -> bool:
    """Probe the decoder's products (decoder_row_blocks), pad and block them as the probe
    found, and make its attention row-exact; False (and nothing changed) where no counts do."""
    blocks = decoder_row_blocks(decoder, quant)
    if blocks is None:
        return False
    if blocks != (1, None):
        pad_small_products(decoder, *blocks)
    decoder.use_row_exact_attention()
    return True
