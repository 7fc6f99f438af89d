"""A step's data between the host and its device, with one wait for the device per step.

On CUDA, reading device data on the host (``.item()``, ``.tolist()``,
``.cpu()``, ``bool(t)``, an op whose output shape depends on values, such as
``nonzero``) and copying pageable host data to the device without
``non_blocking`` (``torch.tensor(list, device=cuda)``, ``.to(cuda)``) make the
host wait until the device has run everything queued so far: the host stops
queuing the step's kernels and the device then idles until it queues more.

So a model step waits once, at its end, in ``to_host`` (what it sampled, and
the KV it exports). Its inputs go the other way through ``to_device`` /
``as_device_tensor``: built on the host, pinned on CUDA and copied without
waiting. On the CPU all three are free: nothing to copy, nothing to wait for.

The engine runs on the CPU or on CUDA (``EngineConfig.device``); any other
device is refused here by name rather than copied some other way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _check_cuda(device: torch.device) -> None:
    if device.type != "cuda":
        raise ValueError(f"step data moves between the host and a CUDA device, not {device}")


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``, its copy queued without the host waiting.

    Pinned first on CUDA: a non-blocking copy from pinned memory runs in
    stream order, and PyTorch's pinned-memory cache keeps the block until
    that copy has run, so the caller may drop ``host`` at once. (A
    non-blocking copy from pageable memory would be staged synchronously.)
    """
    if device.type == "cpu":
        return host
    _check_cuda(device)
    return host.pin_memory().to(device, non_blocking=True)


def as_device_tensor(
    values: Sequence[int] | Sequence[float] | Sequence[Sequence[int]], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device``, built in pinned memory on CUDA and copied without waiting."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    _check_cuda(device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def copy_from_host(dst: torch.Tensor, values: Sequence[int]) -> None:
    """Fill ``dst`` (1-D, on its device) with ``values``, queued without waiting, as ``as_device_tensor`` is.

    For static buffers (a CUDA graph reads its inputs from fixed addresses).
    """
    if len(values) != dst.numel():
        raise ValueError(f"{len(values)} values for a buffer of {dst.numel()}")
    if dst.device.type == "cpu":
        dst.copy_(torch.tensor(values, dtype=dst.dtype))
        return
    _check_cuda(dst.device)
    dst.copy_(torch.tensor(values, dtype=dst.dtype, pin_memory=True), non_blocking=True)


def to_host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Complete CPU copies of ``tensors`` (all on one device): a step's one wait for its device.

    On CUDA every tensor is copied without waiting (into pinned memory), then
    the host waits once, on an event recorded after the last copy. Waiting on
    an event rather than on the stream also keeps this wait out of
    ``torch.cuda.set_sync_debug_mode``'s reach (it flags stream and device
    syncs and synchronous copies), so under that mode a step raises on any
    wait but this one. On the CPU the tensors come back as they are.
    """
    if not tensors or tensors[0].device.type == "cpu":
        return list(tensors)
    device = tensors[0].device
    _check_cuda(device)
    assert all(t.device == device for t in tensors), [t.device for t in tensors]
    copies = [t.to("cpu", non_blocking=True) for t in tensors]
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    done.synchronize()
    return copies
