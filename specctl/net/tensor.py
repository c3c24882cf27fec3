"""A tensor as it travels in a frame: {dtype, shape, data}; one that does not add up is a
ProtocolError, never a crash."""

from __future__ import annotations

import msgspec
import torch

from specctl.errors import ProtocolError

TENSOR_DTYPES = ("float32", "float16", "bfloat16", "int64", "int32", "bool")


class Tensor(msgspec.Struct, frozen=True):
    dtype: str
    shape: list[int]
    data: bytes

    @classmethod
    def from_torch(cls, t: torch.Tensor) -> "Tensor":
        t = t.detach().contiguous().cpu()
        raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t  # numpy has no bfloat16: ship its bits
        return cls(str(t.dtype).removeprefix("torch."), list(t.shape), raw.numpy().tobytes())

    def to_torch(self) -> torch.Tensor:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype) or self.dtype not in TENSOR_DTYPES:
            raise ProtocolError(f"unsupported tensor dtype {self.dtype!r}")
        count = 1
        for dim in self.shape:
            if dim < 0:
                raise ProtocolError(f"negative tensor dimension in {self.shape}")
            count *= dim
        item = torch.tensor([], dtype=dtype).element_size()
        if count * item != len(self.data):
            raise ProtocolError(f"tensor of shape {self.shape} and dtype {self.dtype} needs {count * item} bytes, got {len(self.data)}")
        return torch.frombuffer(bytearray(self.data), dtype=dtype).reshape(self.shape) if count else torch.empty(self.shape, dtype=dtype)
