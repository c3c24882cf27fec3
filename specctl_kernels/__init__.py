"""Attention kernels for specctl: one entry point, ``tree_attention``, two backends.

- ``torch``: SDPA with a boolean mask. Runs everywhere; the CPU path and the test oracle.
- ``flashinfer``: custom-mask prefill on CUDA (``pip install specctl[cuda]``).

The backend is chosen once from the device and what is installed (``select_backend``),
or forced by the profile's ``attention_backend``."""

from __future__ import annotations

import logging
from typing import Callable

import torch

from specctl_kernels import torch_backend
from specctl_kernels.torch_backend import static_attention

BACKENDS = ("auto", "torch", "flashinfer")

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def flashinfer_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
FLASHINFER_HEAD_DIMS = (64, 128, 256)
log = logging.getLogger("specctl.kernels")


def select_backend(requested: str, device: torch.device | str, dtype: torch.dtype | None = None,
                   head_dim: int | None = None) -> str:
    """Resolve ``auto`` to a concrete backend; refuse one that cannot run here. flashinfer has
    kernels for fp16/bf16 and head dims 64/128/256 only: ``auto`` then falls back to torch."""
    if requested not in BACKENDS:
        raise ValueError(f"unknown attention backend {requested!r}: one of {', '.join(BACKENDS)}")
    is_cuda = torch.device(device).type == "cuda"
    unsupported = None
    if dtype is not None and dtype not in FLASHINFER_DTYPES:
        unsupported = f"{str(dtype).removeprefix('torch.')} (it has fp16/bf16 kernels only)"
    elif head_dim is not None and head_dim not in FLASHINFER_HEAD_DIMS:
        unsupported = f"head dim {head_dim} (it has {', '.join(map(str, FLASHINFER_HEAD_DIMS))})"
    if requested == "auto":
        if not (is_cuda and flashinfer_available()):
            return "torch"
        if unsupported:
            log.info("attention: torch SDPA, since flashinfer has no kernels for %s", unsupported)
            return "torch"
        return "flashinfer"
    if requested == "flashinfer":
        if not (is_cuda and flashinfer_available()):
            raise ValueError("attention backend 'flashinfer' needs a CUDA device and `pip install flashinfer-python`")
        if unsupported:
            raise ValueError(f"attention backend 'flashinfer' has no kernels for {unsupported}; use attention_backend "
                             "= 'auto' or 'torch'")
    return requested


def get_attention(backend: str) -> AttentionFn:
    if backend == "torch":
        return torch_backend.tree_attention
    if backend == "flashinfer":
        from specctl_kernels import flashinfer_backend

        return flashinfer_backend.tree_attention
    raise ValueError(f"no concrete attention backend {backend!r}")


def tree_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, backend: str = "torch"
) -> torch.Tensor:
    """Attention of n new queries over T keys with an arbitrary boolean mask.

    q: [B, H, n, D]; k, v: [B, Hkv, T, D] (H a multiple of Hkv: grouped-query attention);
    mask: [n, T] or [B, n, T], True where query i may attend to key j; None = causal over
    the last n keys (the first T-n keys are the cached prefix). Returns [B, H, n, D]."""
    return get_attention(backend)(q, k, v, mask)


def causal_mask(n: int, total: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean mask of n new tokens appended after total-n cached ones (causal)."""
    past = total - n
    rows = torch.arange(n, device=device).unsqueeze(1)
    cols = torch.arange(total, device=device).unsqueeze(0)
    return cols <= rows + past


__all__ = ["BACKENDS", "causal_mask", "flashinfer_available", "get_attention", "select_backend", "static_attention",
           "tree_attention"]
