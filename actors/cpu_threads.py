"""How many torch intra-op threads an engine's forward uses on CPU.

Ray starts its workers with ``OMP_NUM_THREADS=1`` unless an actor reserves
CPUs, so without this a scheduler actor would run its forward on one core
however many the node has. The rule (``engine_cpu_threads``): the configured
number; else the whole CPUs Ray reserved for this actor; else every core this
process may run on, which is torch's own default outside Ray.
"""

from __future__ import annotations

import os

import torch


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS reports one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)  # pragma: no cover - macOS


def ray_reserved_cpus() -> float:
    """CPUs Ray reserved for the calling actor or task (0 outside Ray or when none were)."""
    try:
        import ray

        if not ray.is_initialized():
            return 0.0
        return float(ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0))
    except Exception:  # noqa: BLE001 - not inside a Ray worker: nothing reserved
        return 0.0


def engine_cpu_threads(configured: int | None) -> int:
    """Threads for an engine's forward: ``configured``, else the reserved whole CPUs, else every usable core."""
    if configured is not None:
        return configured
    reserved = int(ray_reserved_cpus())
    return reserved if reserved >= 1 else usable_cores()


def set_cpu_threads(threads: int) -> None:
    """Set torch's intra-op threads for the calling thread and the threads it starts."""
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
