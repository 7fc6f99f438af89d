"""The object-store bandwidth between two actors, the denominator of ``bench pd``'s expected transfer time.

What a KV payload's trip costs at least: one actor puts ``num_bytes`` of
numpy into Ray's object store (``ray.put``: a serialisation and a copy), a
second actor gets it (``ray.get``: mapped out of shared memory) and copies
it into a buffer of its own (as ``KVPool.write_pages`` copies a payload into
the pool). Each side times its own part, so RPC latency stays out: bandwidth
is ``num_bytes / (put + get and copy)``, the median over ``runs`` runs.

The real path makes more hops (prefill scheduler actor -> prefill replica
-> decode replica -> decode scheduler actor) and pays Serve's and Ray's
call latency; the measured ``kv_transfer_ms`` set beside the expected
figure shows how much more than one hop's data movement that costs.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from scheduling.errors import InvalidParameterError


@ray.remote(num_cpus=0)
class _Sender:
    def __init__(self, num_bytes: int) -> None:
        self.array = np.ones(num_bytes, dtype=np.uint8)  # touched: no page faults in the timed put

    def put(self) -> tuple[list[Any], float]:
        start = time.perf_counter()
        ref = ray.put(self.array)
        return [ref], time.perf_counter() - start  # in a list, so Ray passes the ref and not its value


@ray.remote(num_cpus=0)
class _Receiver:
    def __init__(self, num_bytes: int) -> None:
        self.buffer = np.zeros(num_bytes, dtype=np.uint8)

    def get(self, refs: list[Any]) -> float:
        start = time.perf_counter()
        np.copyto(self.buffer, ray.get(refs[0]))
        return time.perf_counter() - start


@dataclass(frozen=True, slots=True)
class Bandwidth:
    """``num_bytes`` moved actor to actor in ``seconds`` (median run)."""

    num_bytes: int
    seconds: float
    runs: int

    @property
    def bytes_per_s(self) -> float:
        return self.num_bytes / self.seconds

    def transfer_ms(self, num_bytes: float) -> float:
        """The time ``num_bytes`` take at this bandwidth."""
        return num_bytes / self.bytes_per_s * 1e3


def measure_bandwidth(num_bytes: int, runs: int = 5) -> Bandwidth:
    """Time ``runs`` put/get-and-copy trips of ``num_bytes`` between two fresh actors (Ray must be up)."""
    if num_bytes < 1:
        raise InvalidParameterError("num_bytes", f"must be >= 1, got {num_bytes}")
    if runs < 1:
        raise InvalidParameterError("runs", f"must be >= 1, got {runs}")
    sender, receiver = _Sender.remote(num_bytes), _Receiver.remote(num_bytes)  # type: ignore[attr-defined]
    try:
        times = []
        for _ in range(runs + 1):  # the first trip is a warm-up (the object store's first mapping)
            refs, put_s = ray.get(sender.put.remote())
            get_s = ray.get(receiver.get.remote(refs))
            times.append(put_s + get_s)
            del refs  # frees the object before the next trip
    finally:
        ray.kill(sender)
        ray.kill(receiver)
    return Bandwidth(num_bytes, statistics.median(times[1:]), runs)
