"""The cluster KV tier on Ray: one store actor per node, and the client every engine reads them with.

``KVStoreActor`` keeps encoded blocks (``kvcache.kv_blocks``) in its own
memory, LRU within its bound, and answers which of a chain of keys it holds.
There is one per node, named ``flotilla-kv-store-<node id>`` in the
``flotilla`` namespace and detached (it outlives the replica that started it,
so a replica that autoscaling adds later finds it warm; it ends with the
cluster). The engine of each replica writes its blocks to its own node's
store and reads from every node's (``RayBlockStore``, the ``BlockStore`` of
``kvcache.kv_tiers``).

Faults: a call that fails or times out raises, and ``TieredKV`` turns it
into a miss (or a dropped write) and a warning metric. After a failure the
client looks the stores up again on its next call; the local store, if it
died, is started anew (empty).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import ray
from ray.actor import ActorHandle
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvcache.kv_blocks import BlockBytes, BlockKey

NAMESPACE = "flotilla"
NAME_PREFIX = "flotilla-kv-store-"
# How often a client looks for stores on nodes it has not seen yet (seconds).
REFRESH_S = 10.0
STARTUP_TIMEOUT_S = 120.0  # a new store actor's process start on a busy node


@ray.remote(num_cpus=0)
class KVStoreActor:
    """Encoded KV blocks of every replica on one node, LRU within ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        # Encoded blocks (uint8 arrays: Ray hands them out without pickling their bytes).
        self._blocks: OrderedDict[BlockKey, np.ndarray] = OrderedDict()
        self._bytes = 0

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """How many of ``keys``, from the first on, this store holds."""
        n = 0
        for key in keys:
            if key not in self._blocks:
                break
            n += 1
        return n

    def fetch(self, keys: Sequence[BlockKey]) -> list[np.ndarray]:
        """The blocks of the longest run of ``keys``, from the first on, that this store holds."""
        out: list[np.ndarray] = []
        for key in keys:
            data = self._blocks.get(key)
            if data is None:
                break
            self._blocks.move_to_end(key)
            out.append(data)
        return out

    def put(self, items: Sequence[tuple[BlockKey, np.ndarray]]) -> None:
        for key, data in items:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                continue
            if data.nbytes > self.max_bytes:
                continue
            while self._bytes + data.nbytes > self.max_bytes:
                _, old = self._blocks.popitem(last=False)
                self._bytes -= old.nbytes
            # A copy of its own: the argument is a read-only view of the object store's copy, which
            # Ray may free once this call returns.
            self._blocks[key] = np.array(data, copy=True)
            self._bytes += data.nbytes

    def stats(self) -> dict[str, int]:
        return {"blocks": len(self._blocks), "bytes": self._bytes, "max_bytes": self.max_bytes}


def store_name(node_id: str) -> str:
    return f"{NAME_PREFIX}{node_id}"


def local_store(max_bytes: int) -> ActorHandle:
    """This node's store, started if there is none (pinned to the node, detached)."""
    node_id = ray.get_runtime_context().get_node_id()
    return KVStoreActor.options(  # type: ignore[attr-defined]  # ray.remote class
        name=store_name(node_id), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(max_bytes)  # fmt: skip


class RayBlockStore:
    """``BlockStore`` over every node's ``KVStoreActor``: writes go to this node's, reads ask them all."""

    def __init__(self, max_bytes: int, timeout_s: float) -> None:
        if not ray.is_initialized():
            raise RuntimeError("kv_offload.cluster needs Ray: start the engine inside a Ray cluster")
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self._local: ActorHandle | None = None
        self._stores: dict[str, ActorHandle] = {}
        self._refreshed = 0.0
        # Started (or found) now, while the engine starts: a store's start-up is not a request's wait.
        ray.get(self._local_store().stats.remote(), timeout=STARTUP_TIMEOUT_S)

    def fetch(self, keys: Sequence[BlockKey]) -> list[BlockBytes]:
        """From the one store on this cluster in one call; with several, the one holding the longest run."""
        stores = list(self._all().values())
        keys = list(keys)
        try:
            if len(stores) == 1:
                return list(ray.get(stores[0].fetch.remote(keys), timeout=self.timeout_s))
            counts: list[int] = ray.get([s.lookup.remote(keys) for s in stores], timeout=self.timeout_s)
            best = max(range(len(counts)), key=counts.__getitem__)
            if not counts[best]:
                return []
            return list(ray.get(stores[best].fetch.remote(keys[: counts[best]]), timeout=self.timeout_s))
        except Exception:
            self._forget()
            raise

    def put(self, items: Sequence[tuple[BlockKey, np.ndarray]]) -> None:
        try:
            ray.get(self._local_store().put.remote(list(items)), timeout=max(self.timeout_s, 5.0))
        except Exception:
            self._forget()
            raise

    def stats(self) -> dict[str, dict[str, int]]:
        """Every store's holdings, by node id (the bench and tests read it)."""
        stores = self._all()
        return dict(zip(stores, ray.get([s.stats.remote() for s in stores.values()], timeout=self.timeout_s),
                        strict=True))  # fmt: skip

    def _local_store(self) -> ActorHandle:
        if self._local is None:
            self._local = local_store(self.max_bytes)
        return self._local

    def _all(self) -> dict[str, ActorHandle]:
        now = time.monotonic()
        if not self._stores or now - self._refreshed > REFRESH_S:
            self._refreshed = now
            stores = {store_name(ray.get_runtime_context().get_node_id()): self._local_store()}
            for entry in ray.util.list_named_actors(all_namespaces=True):
                name = entry["name"]
                if entry["namespace"] == NAMESPACE and name.startswith(NAME_PREFIX) and name not in stores:
                    try:
                        stores[name] = ray.get_actor(name, namespace=NAMESPACE)
                    except ValueError:  # gone since listed
                        continue
            self._stores = stores
        return self._stores

    def _forget(self) -> None:
        # A store failed: look them up again (restarting the local one) on the next call.
        self._local = None
        self._stores = {}
