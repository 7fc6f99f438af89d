"""``torch.distributed`` set-up for the tensor-parallel ranks of one engine.

Rank 0 picks the rendezvous address (its node's IP) and a free TCP port on
it; every rank then joins with ``tcp://addr:port``. Gloo carries the
collectives on CPU, NCCL on CUDA. These helpers know nothing of Ray beyond
asking it for the node's IP, so they also serve plain processes.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# A peer that never joins (its actor died while starting) must not hang the
# others forever; the executor kills the group long before this fires.
DEFAULT_TIMEOUT = timedelta(minutes=5)


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where the ranks of one group meet: rank 0's address and a port free there."""

    host: str
    port: int

    @property
    def init_method(self) -> str:
        # Brackets keep an IPv6 address apart from its port.
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"


def node_ip() -> str:
    """This node's IP as Ray knows it (what other nodes reach it by); loopback without Ray."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except ImportError:  # pragma: no cover - Ray is a dependency; helpers still work without it
        pass
    return "127.0.0.1"


def free_port(host: str) -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it).

    The socket is closed before the port is used, so another process could
    take it in between; a fresh port per group keeps a retry cheap.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def new_rendezvous() -> Rendezvous:
    """Call on rank 0's node: its IP and a port free there."""
    host = node_ip()
    return Rendezvous(host, free_port(host))


def backend_for(device: torch.device) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device.type == "cuda" else "gloo"


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def init_distributed(
    rendezvous: Rendezvous,
    *,
    rank: int,
    world_size: int,
    device: torch.device,
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> None:
    """Join the default process group as ``rank`` of ``world_size`` (blocks until all join).

    On CUDA the rank's device is made current first, so NCCL communicators
    land on the right GPU.
    """
    backend = backend_for(device)
    if device.type == "cuda":
        # "cuda" without an index means the first visible GPU: Ray shows each
        # shard only the GPU of its bundle (CUDA_VISIBLE_DEVICES).
        torch.cuda.set_device(device.index if device.index is not None else 0)
    if backend == "gloo" and _is_loopback(rendezvous.host):
        # Gloo binds to the interface its hostname resolves to; when the
        # rendezvous is on loopback the peers are too, so bind there as well.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        backend, init_method=rendezvous.init_method, rank=rank, world_size=world_size, timeout=timeout
    )


def destroy_distributed() -> None:
    """Leave the process group, if this process joined one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
