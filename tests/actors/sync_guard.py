"""Count, on any device, the calls that would make the host wait for a CUDA device.

``HostSyncCounter`` is a ``TorchFunctionMode``: while its block runs it sees
every torch function and tensor method called from Python and records those
that, on CUDA, block the host until the device has run all work queued so
far. On the CPU nothing waits, so this is how a CPU test proves a CUDA step
has no such wait; on CUDA, ``torch.cuda.set_sync_debug_mode("error")`` is the
device's own check of the same thing (``tests/actors/runner/test_step_syncs.py``).

Counted (``SYNC_METHODS``, ``SYNC_FUNCTIONS`` and the rules in
``_sync_name``):

- host reads of device data: ``Tensor.item``, ``.tolist``, ``.numpy``,
  ``.cpu``, ``bool(t)``, ``int(t)``, ``float(t)``, ``t.__index__`` (a tensor
  used as a Python index), ``.__format__`` / ``.__repr__`` (printing),
  ``torch.equal`` / ``allclose`` / ``is_nonzero``;
- ops whose output shape depends on tensor values, which CUDA must read
  back to allocate: ``nonzero``, ``argwhere``, ``masked_select``,
  ``unique`` / ``unique_consecutive``, ``torch.where(cond)`` with one
  argument, ``bincount`` (its length is the largest value),
  ``repeat_interleave`` with tensor repeats and no ``output_size``, and
  indexing (``x[mask]``, ``x[mask] = v``, ``index_put_``) with a bool tensor;
- synchronous host-to-device copies: ``torch.tensor`` / ``as_tensor`` /
  ``asarray`` given ``device=`` that names the step's device, and
  ``Tensor.to(device)`` / ``.cuda()`` without ``non_blocking=True`` (a
  device-to-host ``.to("cpu")`` as well).
  On the CPU the guard cannot tell host tensors from device tensors, so
  every such move counts; the step path builds host data without a
  ``device`` and moves it with ``non_blocking=True`` (pinned on CUDA), or
  builds it on the device from device tensors.

Not counted: ``Tensor.copy_`` (on the CPU a host-to-device copy looks like a
device-to-device one) and waits inside C++ or inside a Python torch function
(the mode sees the outer call only). The CUDA check covers both.

Calls made from ``kernel_files`` (a CPU stand-in for device kernels, such as
the FlashInfer emulator, which computes on the host what a launched kernel
computes on the device) are the kernels' own: they go to ``kernel_calls``,
not ``calls``. A real launch reads nothing back; what the caller hands the
kernels is still counted.

The step's one allowed wait, ``kvcache.device_copy.to_host``, counts once
per call (``allowed``), not in ``calls``; the tensors it returns are host
data, so reading them (``.tolist()``) is not counted either. The counter
replaces ``device_copy.to_host`` while its block runs, so callers call it
through the module (``device_copy.to_host(...)``), never a name imported
from it; a call that bypassed the counter would leave its tensors unmarked,
and their ``.tolist()`` would count.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType

import torch
from torch.overrides import TorchFunctionMode

from kvcache import device_copy

SYNC_METHODS: frozenset[Callable[..., object]] = frozenset({
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.cpu,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.__format__,
    torch.Tensor.__repr__,
    torch.Tensor.is_nonzero,
    torch.Tensor.equal,
    torch.Tensor.allclose,
    torch.Tensor.nonzero,
    torch.Tensor.argwhere,
    torch.Tensor.masked_select,
    torch.Tensor.unique,
    torch.Tensor.unique_consecutive,
    torch.Tensor.bincount,
})
SYNC_FUNCTIONS: frozenset[Callable[..., object]] = frozenset({
    torch.equal,
    torch.allclose,
    torch.is_nonzero,
    torch.nonzero,
    torch.argwhere,
    torch.masked_select,
    torch.unique,
    torch.unique_consecutive,
    torch.bincount,
})
_FROM_DATA = frozenset({torch.tensor, torch.as_tensor, torch.asarray})
_REPEAT = frozenset({torch.repeat_interleave, torch.Tensor.repeat_interleave})
_INDEXING = frozenset({torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_,
                       torch.Tensor.index_put, torch.index_put})
_MOVES = frozenset({torch.Tensor.to, torch.Tensor.cuda})


def _has_bool_index(index: object) -> bool:
    if isinstance(index, torch.Tensor):
        return index.dtype == torch.bool
    if isinstance(index, (tuple, list)):
        return any(_has_bool_index(i) for i in index)
    return False


def _move_target(args: Sequence[object], kwargs: Mapping[str, object]) -> tuple[torch.device | None, bool]:
    """The device ``Tensor.to(*args, **kwargs)`` moves to (None: dtype only) and its ``non_blocking``."""
    target = kwargs.get("device")
    non_blocking = bool(kwargs.get("non_blocking", False))
    for a in args:
        if isinstance(a, (str, torch.device)) and target is None:
            target = a
        elif isinstance(a, torch.Tensor) and target is None:
            target = a.device  # to(other): other's device and dtype
        elif isinstance(a, bool):
            non_blocking = non_blocking or a  # positional non_blocking (after a dtype or device)
    if target is None:
        return None, non_blocking
    return torch.device(target) if isinstance(target, (str, torch.device)) else None, non_blocking


class HostSyncCounter(TorchFunctionMode):
    """Records, in ``calls``, each call in the block that would sync a CUDA ``device``.

    ``device`` is the step's device: moves onto it count (see the module
    docstring). ``allowed`` counts the calls of ``device_copy.to_host``.
    """

    def __init__(self, device: torch.device, kernel_files: Sequence[str] = ()) -> None:
        super().__init__()
        self.device = device
        self.calls: list[str] = []
        self.kernel_calls: list[str] = []
        self._kernel_files = frozenset(kernel_files)
        self.allowed = 0
        # Host copies to_host returned, held so their ids stay unique in the block.
        self._host: dict[int, torch.Tensor] = {}

    def __enter__(self) -> HostSyncCounter:
        real = self._real_to_host = device_copy.to_host

        def counted(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
            host = real(tensors)
            self.note_host_read(host)
            return host

        device_copy.to_host = counted  # every caller calls it through the module
        super().__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        super().__exit__(exc_type, exc, tb)
        device_copy.to_host = self._real_to_host
        self._host.clear()

    @property
    def count(self) -> int:
        """Every wait in the block, the allowed reads included."""
        return len(self.calls) + self.allowed

    def __torch_function__(
        self,
        func: Callable[..., object],
        types: Sequence[type],
        args: Sequence[object] = (),
        kwargs: Mapping[str, object] | None = None,
    ) -> object:
        kwargs = kwargs or {}
        name = self._sync_name(func, args, kwargs)
        if name is not None:
            caller = sys._getframe(1).f_code.co_filename  # who called torch: the step or a kernel stand-in
            (self.kernel_calls if caller in self._kernel_files else self.calls).append(name)
        return func(*args, **kwargs)

    def _sync_name(
        self, func: Callable[..., object], args: Sequence[object], kwargs: Mapping[str, object]
    ) -> str | None:
        """``func``'s name when this call would sync a CUDA device, else None."""
        name = getattr(func, "__name__", repr(func))
        if func in SYNC_METHODS:
            receiver = args[0] if args else None
            if isinstance(receiver, torch.Tensor) and id(receiver) in self._host:
                return None  # already on the host: reading it waits for nothing
            return name
        if func in SYNC_FUNCTIONS:
            return name
        if func is torch.where and len(args) + len(kwargs) == 1:
            return "where(condition)"
        if func in _REPEAT:
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            if isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None:
                return "repeat_interleave(tensor repeats)"
            return None
        if func in _INDEXING:
            index = args[1] if len(args) > 1 else kwargs.get("indices")
            return f"{name}(bool index)" if _has_bool_index(index) else None
        if func in _FROM_DATA:
            device = kwargs.get("device")
            if isinstance(device, (str, torch.device)) and torch.device(device) == self.device:
                return f"{name}(device={self.device})"
            return None
        if func in _MOVES:
            if func is torch.Tensor.cuda:
                return name
            target, non_blocking = _move_target(args[1:], kwargs)
            if target is not None and not non_blocking:  # onto the device, or back to the host
                return f"to({target})"
        return None

    def note_host_read(self, tensors: Sequence[torch.Tensor]) -> None:
        """One allowed wait brought ``tensors`` to the host (called by the ``to_host`` wrapper)."""
        self.allowed += 1
        for t in tensors:
            self._host[id(t)] = t
