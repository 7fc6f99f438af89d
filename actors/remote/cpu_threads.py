"""How many torch intra-op threads an engine's forward uses on CPU.

Ray starts its workers with ``OMP_NUM_THREADS=1`` unless an actor reserves
CPUs, so without this a scheduler actor would run its forward on one core
however many the node has. The rule (``engine_cpu_threads``): the configured
number; else the whole CPUs Ray reserved for this actor; else every core this
process may run on, which is torch's own default outside Ray.

One OpenMP team per process: torch's CPU kernels run on the OpenMP thread
team of the thread that calls them, and each thread that runs parallel work
keeps its own team for life. Once a process holds more team threads than
cores (GNU OpenMP counts idle teams too), the library cuts its spin-wait
from about 300,000 rounds to 1,000, so the forward's workers sleep and are
woken at every op. So the thread that runs the forward also loads the model
(``SchedulerService``), or the loading runs on a thread that then ends
(``call_on_new_thread``, for shards). ``scripts/bench_openmp_team.py``
measures what a second team costs a decode step (docs/benchmarks.md, "One OpenMP team per process").
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


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


def set_os_thread_name(name: str) -> None:
    """Name the calling thread for the OS (``top -H``, ``/proc/<pid>/task/*/comm``; 15 bytes on Linux).

    Threads it starts afterwards, torch's OpenMP workers among them, inherit
    the name, so the forward's CPU shows under one name (``flotilla bench
    serve --cpu-breakdown``). Python 3.11 names threads for itself only. Off
    Linux this does nothing: the name is a label for tools, not behaviour.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def engine_thread_init(threads: int, name: str) -> None:
    """Initializer of a thread that runs forwards: its torch threads and its OS name."""
    set_os_thread_name(name)
    set_cpu_threads(threads)


def call_on_new_thread(fn: Callable[[], T], threads: int) -> T:
    """``fn()`` on a new thread using ``threads`` torch threads; returns its value or raises its error.

    The thread, and the OpenMP team it started, end before this returns, so a
    forward on another thread later is the process's only team (see above).
    """
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        set_cpu_threads(threads)
        try:
            result.append(fn())
        except BaseException as err:  # noqa: BLE001 - re-raised on the calling thread
            error.append(err)

    worker = threading.Thread(target=run, name="torch-setup")
    worker.start()
    worker.join()
    if error:
        raise error[0]
    return result[0]
