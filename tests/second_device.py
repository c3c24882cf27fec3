"""A second device for CPU-only CI: tensors on ``privateuseone`` hold CPU data, and an op that
meets one of them beside a CPU tensor fails as it would on CUDA ("Expected all tensors to be on
the same device"). The engine treats the device as it treats CUDA wherever it asks "is this the
CPU?" (eager and static steps; CUDA graphs, flashinfer and CUDA events stay CUDA's), so the
code paths a GPU takes run here, and a tensor left on the host fails the test instead of a lent
H100 (issue 11: tree mode and sampling crashed there this way).

What CUDA accepts, this device accepts: 0-dim CPU tensors beside device tensors, CPU index
tensors in advanced indexing, copies across (``.to``, ``copy_``, ``.cpu()``, ``.tolist()``,
``.item()``). A CPU ``torch.Generator`` given to an op on the device fails, as on CUDA. The data
are CPU tensors computed by the CPU kernels, so outputs equal the CPU's bit for bit."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

DEVICE = torch.device("privateuseone", 0)
CROSSING = ("copy_", "_to_copy", "to.", "_copy_from", "_local_scalar_dense", "set_", "lift_fresh")
INDEXING = ("index.", "index_put", "_index_put")  # CUDA moves CPU index tensors for you


class DeviceMismatch(RuntimeError):
    pass


class OnDevice(torch.Tensor):
    """A tensor on the second device: a wrapper whose data is the CPU tensor ``inner``."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> "OnDevice":
        out = torch.Tensor._make_wrapper_subclass(cls, inner.size(), strides=inner.stride(),
                                                  storage_offset=inner.storage_offset(), dtype=inner.dtype,
                                                  device=DEVICE, requires_grad=False)
        out.inner = inner
        return out

    def tolist(self):  # a read back to the host (a sync on CUDA)
        return self.inner.tolist()

    def numpy(self, *args, **kwargs):
        raise TypeError(f"can't convert {DEVICE} device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                        "to host memory first.")

    def __repr__(self) -> str:
        return f"OnDevice({self.inner!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


def _run(func, args, kwargs):
    on_device: list[OnDevice] = []
    on_cpu: list[torch.Tensor] = []

    def look(x):
        if isinstance(x, OnDevice):
            on_device.append(x)
        elif isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dim() > 0:
            on_cpu.append(x)
        return x

    tree_map(look, (args, kwargs))
    name = func.__name__
    asked = kwargs.get("device", next((a for a in args if isinstance(a, torch.device)), None))
    to_device = asked is not None and torch.device(asked).type == DEVICE.type
    if on_device and any(isinstance(x, torch.Generator) and x.device.type == "cpu" for x in (*args, *kwargs.values())):
        raise DeviceMismatch(f"{func}: Expected a '{DEVICE.type}' device type for generator but found 'cpu'")
    if name.startswith(INDEXING):
        on_cpu = [t for t in on_cpu if t is args[0] or t.dtype not in (torch.long, torch.int, torch.bool)]
    if on_device and on_cpu and not name.startswith(CROSSING):
        raise DeviceMismatch(f"{func}: Expected all tensors to be on the same device, but found at least two "
                             f"devices, {DEVICE} and cpu! (cpu tensors of shapes {[tuple(t.shape) for t in on_cpu]})")
    inner_args, inner_kwargs = tree_map(lambda x: x.inner if isinstance(x, OnDevice) else x, (args, kwargs))
    if to_device:
        inner_args = tuple(torch.device("cpu") if isinstance(a, torch.device) else a for a in inner_args)
        if "device" in inner_kwargs:
            inner_kwargs["device"] = torch.device("cpu")
    out = func(*inner_args, **inner_kwargs)
    leaves = name.startswith("_local_scalar_dense") or (name.startswith(("_to_copy", "to.")) and asked is not None)
    if not (to_device or (on_device and not leaves)):
        return out
    written = [r.alias_info is not None and r.alias_info.is_write for r in func._schema.returns]
    if written and all(written):  # an in-place or out= op returns the (wrapped) tensors it wrote
        outs = [kwargs[a.name] for a in func._schema.arguments if a.is_out and a.name in kwargs]
        return (outs[0] if len(outs) == 1 else tuple(outs)) if outs else args[0]
    # an inference-mode tensor or not as the op's own would be: a view as its base, the rest as the mode is
    viewing = bool(func._schema.returns) and func._schema.returns[0].alias_info is not None
    inference = on_device[0].is_inference() if viewing and on_device else torch.is_inference_mode_enabled()
    with torch.inference_mode(inference):
        return tree_map(lambda x: OnDevice(x) if isinstance(x, torch.Tensor) and not isinstance(x, OnDevice) else x,
                        out)


_library: torch.library.Library | None = None


def second_device() -> torch.device:
    """The device, registered once a process (PrivateUse1 as a Python backend; factories such as
    ``torch.zeros(..., device=)`` reach ``_run`` through its fallback)."""
    global _library
    if _library is None:
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        _setup_privateuseone_for_python_backend()
        _library = torch.library.Library("_", "IMPL")
        _library.fallback(lambda op, *args, **kwargs: _run(op, args, kwargs), "PrivateUse1")
    return DEVICE


def _built_on_the_host(make):
    # torch.tensor(..., device=) copies with Python dispatch switched off, which a Python backend
    # cannot take: build on the CPU, then move
    def made(*args, device=None, **kwargs):
        if device is not None and torch.device(device).type == DEVICE.type:
            return make(*args, **kwargs).to(device)
        return make(*args, device=device, **kwargs)
    return made


def patch_factories(monkeypatch) -> None:
    for name in ("tensor", "as_tensor"):
        monkeypatch.setattr(torch, name, _built_on_the_host(getattr(torch, name)))
