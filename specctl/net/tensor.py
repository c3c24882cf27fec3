"""A tensor as it travels in a frame: {dtype, shape, data}; one that does not add up is a
ProtocolError, never a crash. torch is imported where a tensor is made or read, not with the
module: the monitor and `specctl --help` read frames without it (a second)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
import numpy as np

from specctl.errors import ProtocolError

if TYPE_CHECKING:
    import torch

# the dtypes a frame may carry, as numpy reads them (numpy has no bfloat16: its bits travel as int16)
NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.int16, "int64": np.int64,
                "int32": np.int32, "bool": np.bool_}


class Tensor(msgspec.Struct, frozen=True):
    dtype: str
    shape: list[int]
    data: bytes

    @classmethod
    def from_torch(cls, t: torch.Tensor) -> "Tensor":
        import torch

        t = t.detach().contiguous().cpu()
        raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
        return cls(str(t.dtype).removeprefix("torch."), list(t.shape), raw.numpy().tobytes())

    def to_numpy(self) -> np.ndarray:
        """The values, read-only, checked in plain Python and numpy: what the event loop's thread
        may look at (torch runs on the compute thread; a bfloat16 tensor comes as its int16 bits)."""
        if self.dtype not in NUMPY_DTYPES:
            raise ProtocolError(f"unsupported tensor dtype {self.dtype!r}")
        count = 1
        for dim in self.shape:
            if dim < 0:
                raise ProtocolError(f"negative tensor dimension in {self.shape}")
            count *= dim
        dtype = np.dtype(NUMPY_DTYPES[self.dtype])
        if count * dtype.itemsize != len(self.data):
            raise ProtocolError(f"tensor of shape {self.shape} and dtype {self.dtype} needs "
                                f"{count * dtype.itemsize} bytes, got {len(self.data)}")
        return np.frombuffer(self.data, dtype=dtype).reshape(self.shape)

    def to_torch(self) -> torch.Tensor:
        import torch

        values = torch.from_numpy(self.to_numpy().copy())  # a copy: frames' bytes are read-only
        return values.view(torch.bfloat16) if self.dtype == "bfloat16" else values
