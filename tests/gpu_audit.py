"""The GPU path checked on the CPU: host synchronisations and kernel launches, counted on
FakeTensors that claim ``device="cuda"`` (issue #34).

PyTorch's ``FakeTensorMode`` runs the real code on tensors that carry a shape, a dtype and a
device but no data, so a tensor "on cuda" takes every CUDA branch of the project (``fixed_shapes``,
autocast, the trainer's device data) without a GPU. A ``TorchDispatchMode`` above it sees every
aten operator that would be dispatched to the GPU:

- :class:`SyncAudit` records each **host synchronisation** with the project line that issued it
  (the innermost frame under ``setvalued/``): a value read back (``aten._local_scalar_dense``:
  ``.item()``, ``bool()``, ``float()``, ``.tolist()``), a copy from the device to the host, a
  blocking copy from the host to the device (``copy_``/``_to_copy`` from a CPU tensor without
  ``non_blocking``, e.g. ``x[0, 1] = 2.0`` or ``torch.tensor(list, device=...)``), an
  ``index_put_`` whose value is a CPU tensor (``x[rows, cols] = 1``: the value is moved by a
  blocking copy), and an operator whose output shape depends on the data (``nonzero``,
  ``masked_select``, boolean indexing: the host waits for the count). What
  ``torch.cuda.set_sync_debug_mode("error")`` raises at on a GPU is among these. A value read
  returns 0 (False) and a data-dependent shape is taken empty, so the audit runs to the end and
  lists every finding.
- :class:`KernelCount` counts the operators that launch a kernel on the GPU (every aten operator
  but views, allocations without initialisation and metadata queries): the launches of an eager
  step, what a launch-bound GPU step pays per operator.

**Fake CUDA and meta.** On a machine without a CUDA driver the autograd engine refuses fake CUDA
tensors (it asks the driver for the device's streams), so backward passes are audited on "meta"
tensors: no data and no device, every non-CPU branch of the project taken (``fixed_shapes``, the
trainer's device data), the autograd engine on the calling thread. The two differ in one place
that matters: ``x[i, j] = 2.0`` and ``x[rows, cols] = 1`` make their value on the CPU and copy it
for a CUDA tensor, on the device for a meta one. Forward passes, where the project writes such
values, are therefore also run on fake CUDA; autocast is CUDA-only (:func:`fake_cuda_autocast`).
Both devices count as "the device" here.

``claim_cuda(module, mode)`` moves a module's parameters and buffers to fake CUDA tensors;
:class:`CudaClaimGenerator` is a CPU generator that says it is on cuda (the fake mode never
draws). Used by tests/test_gpu_path_syncs.py and benchmarks/loss_kernels.py.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Sync", "SyncAudit", "KernelCount", "claim_cuda", "CudaClaimGenerator", "fake_cuda", "fake_cuda_autocast"]

_ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "setvalued") + os.sep
_THIS = os.path.abspath(__file__)
_aten = torch.ops.aten

#: operators whose output shape depends on the values of their input
_DATA_DEPENDENT = {
    _aten.nonzero.default,
    _aten.masked_select.default,
    _aten.argwhere.default,
    _aten._unique2.default,
    _aten.unique_dim.default,
    _aten.unique_consecutive.default,
    _aten.nonzero_static.default,
}
#: operators that launch no kernel: allocation without initialisation, metadata, aliasing
_NO_KERNEL = {
    _aten.empty.memory_format,
    _aten.empty_like.default,
    _aten.empty_strided.default,
    _aten.new_empty.default,
    _aten.new_empty_strided.default,
    _aten.lift_fresh.default,
    _aten.detach.default,
    _aten.alias.default,
    _aten._local_scalar_dense.default,
    _aten.is_same_size.default,
    _aten.sym_size.int,
    _aten.sym_stride.int,
    _aten.sym_numel.default,
    _aten.sym_storage_offset.default,
    _aten.set_.source_Storage,
    _aten.set_.source_Storage_storage_offset,
    _aten.resize_.default,
}


@dataclass(frozen=True)
class Sync:
    """One host synchronisation: what (``kind``), the operator, and the project line."""

    kind: str
    op: str
    where: str

    def __str__(self) -> str:
        return f"{self.where}: {self.kind} ({self.op})"


def project_line(root: str = _ROOT) -> str:
    """``path:line`` of the innermost Python frame under ``root`` (the ``setvalued`` package),
    this module excepted; ``<autograd>`` when there is none (a built-in backward formula)."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path.startswith(root) and path != _THIS:
            return f"{os.path.relpath(path, os.path.dirname(root.rstrip(os.sep)))}:{frame.f_lineno}"
        frame = frame.f_back
    return "<autograd>"


def _is_cuda(value: Any) -> bool:
    """On the device: cuda, or meta (the stand-in of the backward pass, see the module doc)."""
    return isinstance(value, torch.Tensor) and value.device.type != "cpu"


def _is_cpu(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "cpu"


def _tensors(args: Any) -> Iterator[torch.Tensor]:
    for value in args:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _tensors(value)


class SyncAudit(TorchDispatchMode):
    """Records the host synchronisations of the operators run on fake CUDA tensors (see the
    module docstring); ``syncs`` in the order they happened. Consecutive identical findings
    (``.tolist()`` of n values reads n scalars: one copy on a GPU) count once."""

    def __init__(self, root: str = _ROOT):
        super().__init__()
        self.root = os.path.abspath(root) + os.sep
        self.syncs: list[Sync] = []

    def _record(self, kind: str, func) -> None:
        found = Sync(kind, str(func), project_line(self.root))
        if not self.syncs or self.syncs[-1] != found or kind != "value read":
            self.syncs.append(found)

    def counts(self) -> collections.Counter:
        """Findings per (kind, line)."""
        return collections.Counter((s.kind, s.where) for s in self.syncs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if isinstance(kwargs.get("generator"), torch.Generator):
            kwargs.pop("generator")  # a fake draw reads no generator (CudaClaimGenerator is a CPU one)
        if func is _aten._local_scalar_dense.default:
            if _is_cuda(args[0]):
                self._record("value read", func)
            dtype = args[0].dtype
            return False if dtype == torch.bool else (0.0 if dtype.is_floating_point else 0)
        if func in (_aten._to_copy.default, _aten.copy_.default):
            if self._check_copy(func, args, kwargs) and args[0].device.type == "meta":
                return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)  # meta has no data
        elif func in (_aten.index_put_.default, _aten.index_put.default, _aten._index_put_impl_.default):
            if _is_cuda(args[0]) and _is_cpu(args[2]):
                self._record("index_put with a CPU value (blocking copy)", func)
        if func in _DATA_DEPENDENT or (func is _aten.index.Tensor and _bool_index(args[1])):
            if any(_is_cuda(t) for t in _tensors(args)):
                self._record("data-dependent shape", func)
            return _empty_result(func, args, kwargs)
        try:
            return func(*args, **kwargs)
        except DynamicOutputShapeException:
            self._record("data-dependent shape", func)
            raise

    def _check_copy(self, func, args, kwargs) -> bool:
        """Records a copy that synchronises; True for a device-to-host ``_to_copy``."""
        source = args[1] if func is _aten.copy_.default else args[0]
        if func is _aten.copy_.default:
            target_cuda, blocking = _is_cuda(args[0]), not (len(args) > 2 and args[2])
        else:
            device = kwargs.get("device")
            target_cuda = device is not None and torch.device(device).type != "cpu"
            blocking = not kwargs.get("non_blocking", False)
            if device is not None and torch.device(device).type == "cpu" and _is_cuda(source):
                self._record("device-to-host copy", func)
                return True
        if func is _aten.copy_.default and _is_cpu(args[0]) and _is_cuda(source):
            self._record("device-to-host copy", func)
        elif target_cuda and _is_cpu(source) and blocking:
            self._record("blocking host-to-device copy", func)
        return False


def _bool_index(indices: Any) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def _empty_result(func, args, kwargs):
    """The operator's result taken empty (the audit goes on; the values are fake anyway)."""
    source = args[0]
    if func in (_aten.nonzero.default, _aten.argwhere.default):
        return source.new_empty((0, source.dim()), dtype=torch.long)
    if func is _aten.masked_select.default:
        return source.new_empty((0,))
    if func is _aten.index.Tensor:
        indices = [
            source.new_empty((0,), dtype=torch.long) if i is not None and i.dtype in (torch.bool, torch.uint8) else i
            for i in args[1]
        ]
        return func(source, indices)
    if func is _aten.nonzero_static.default:
        return func(*args, **kwargs)
    return tuple(source.new_empty((0,), dtype=torch.long if i else source.dtype) for i in range(3))


class KernelCount(TorchDispatchMode):
    """Counts the operators that launch a GPU kernel (views, bare allocations and metadata
    queries launch none); ``by_op`` per operator name."""

    def __init__(self):
        super().__init__()
        self.by_op: collections.Counter = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if isinstance(kwargs.get("generator"), torch.Generator):
            kwargs.pop("generator")
        if not (func.is_view or func in _NO_KERNEL or func.namespace == "prim"):
            self.by_op[func.overloadpacket.__name__] += 1
        if func is _aten._local_scalar_dense.default:
            return False if args[0].dtype == torch.bool else 0
        if func in _DATA_DEPENDENT or (func is _aten.index.Tensor and _bool_index(args[1])):
            return _empty_result(func, args, kwargs)
        return func(*args, **kwargs)


class CudaClaimGenerator(torch.Generator):
    """A CPU generator whose ``device`` says what it was asked for (cuda): code that draws on
    ``generator.device`` takes its CUDA branch; the audit modes drop it from the fake draws."""

    def __new__(cls, device: Any = "cpu"):
        return super().__new__(cls)

    def __init__(self, device: Any = "cpu"):
        super().__init__()
        self.claimed = torch.device(device)

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self.claimed


def claim_cuda(module: nn.Module, mode: FakeTensorMode) -> nn.Module:
    """Replace ``module``'s parameters and buffers (in place) by fake tensors on cuda of the same
    shape, dtype and ``requires_grad`` (their values are lost: an audit needs none)."""
    with mode:
        for child in module.modules():
            for name, param in list(child._parameters.items()):
                if param is not None:
                    child._parameters[name] = nn.Parameter(param.detach().to("cuda"), param.requires_grad)
            for name, buffer in list(child._buffers.items()):
                if buffer is not None:
                    child._buffers[name] = buffer.to("cuda")
    return module


@contextlib.contextmanager
def fake_cuda() -> Iterator[FakeTensorMode]:
    """A fake mode in which ``torch.randn(..., device="cuda")`` works without a GPU, real CPU
    tensors entering it are taken as fake, and ``torch.Generator(device="cuda")`` gives a
    :class:`CudaClaimGenerator`."""
    real_generator = torch.Generator
    torch.Generator = CudaClaimGenerator  # type: ignore[misc]
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            yield mode
    finally:
        torch.Generator = real_generator  # type: ignore[misc]


@contextlib.contextmanager
def fake_cuda_autocast(dtype: torch.dtype = torch.bfloat16) -> Iterator[None]:
    """``torch.autocast("cuda", dtype)`` on a machine without a GPU: its constructor would
    disable itself there, so it is built while ``torch.cuda.is_available`` (and bf16 support)
    say yes; the region then casts fake CUDA tensors as it casts real ones."""
    saved = torch.cuda.is_available, torch.cuda.is_bf16_supported
    torch.cuda.is_available = lambda: True  # type: ignore[assignment]
    torch.cuda.is_bf16_supported = lambda *args, **kwargs: True  # type: ignore[assignment]
    try:
        region = torch.autocast("cuda", dtype=dtype)
    finally:
        torch.cuda.is_available, torch.cuda.is_bf16_supported = saved
    with region:
        yield
