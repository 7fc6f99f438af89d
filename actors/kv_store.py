"""The cluster KV tier on Ray: one store actor per node, and the client every engine reads them with.

``KVStoreActor`` keeps encoded blocks (``kvcache.kv_blocks``) in its own
memory, LRU within its bound, and a log of the keys it added and dropped.
There is one per node, Serve app and model, named
``flotilla-kv-store-<app>/<model digest>/<node id>`` in the ``flotilla``
namespace (``<app>`` is ``-`` for engines outside Serve) and detached (it
outlives the replica that started it, so a replica that autoscaling adds
later finds it warm; it ends with the cluster, or when ``drop_stores``
(``flotilla kv drop --app NAME``) ends it). An app's bound is its own: another
app, or another model, never evicts its blocks. The engine of each replica
writes its blocks to its own node's store and reads from every node's of
its app and model (``RayBlockStore``, the ``BlockStore`` of
``kvcache.kv_tiers``).

The index: each client mirrors which keys every store holds, following the
stores' logs from a thread of its own by long-poll (a store answers as soon
as it has news, or after ``INDEX_POLL_S``: an idle cluster costs a call per
store and client every two seconds, a busy one five a second at most). A lookup is
then a set membership in the engine's process: a block no store holds costs
a request no round trip, and a hit costs one call, to the store whose run of
the request's keys is longest. The mirror lags by up to ``INDEX_MIN_INTERVAL_S``
and a round trip (a block stored that recently is a miss: computed again), or names a block
the store has since evicted (the store answers the run it still holds).

Faults: a call that fails or times out raises, and ``TieredKV`` turns it
into a miss (or a dropped write) and a warning metric. After a failure the
client looks the stores up again on its next call; the local store, if it
died, is started anew (empty), and a store that restarted is mirrored anew
(each incarnation has its own id).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from typing import cast

import numpy as np
import ray
from ray.actor import ActorHandle
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.log import get_logger
from kvcache.kv_blocks import BlockBytes, BlockKey
from kvcache.kv_tiers import StoreState

logger = get_logger(__name__.rsplit(".", 1)[-1])

NAMESPACE = "flotilla"
NAME_PREFIX = "flotilla-kv-store-"
NO_APP = "-"  # the app part of the name of an engine outside Serve (offline ``LLM``)
REFRESH_S = 10.0  # how often a client looks for stores on nodes it has not seen yet
INDEX_POLL_S = 2.0  # the longest a store holds a client's index long-poll with no news
INDEX_MIN_INTERVAL_S = 0.2  # between two polls: a busy store's news is read at most five times a second
STARTUP_TIMEOUT_S = 120.0  # a new store actor's process start on a busy node

# (incarnation, version after these events, the whole key set when the caller must start over else None,
# the (added?, key) events since the caller's version)
IndexUpdate = tuple[str, int, list[BlockKey] | None, list[tuple[bool, BlockKey]]]


@ray.remote(num_cpus=0)
class KVStoreActor:
    """Encoded KV blocks of every replica on one node, LRU within ``max_bytes``, and the log of its keys."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        # Encoded blocks (uint8 arrays: Ray hands them out without pickling their bytes).
        self._blocks: OrderedDict[BlockKey, np.ndarray] = OrderedDict()
        self._bytes = 0
        self._incarnation = uuid.uuid4().hex
        self._log: list[tuple[bool, BlockKey]] = []  # events from version _log_start on
        self._log_start = 0
        self._changed = asyncio.Event()  # set (and replaced) by each put that changes the log

    # Async methods: ``index_since`` waits for news without holding up fetches and puts. None of them
    # awaits between reading and changing the state, so each runs whole on the actor's event loop.
    async def fetch(self, keys: Sequence[BlockKey]) -> list[np.ndarray]:
        """The blocks of the longest run of ``keys``, from the first on, that this store holds."""
        out: list[np.ndarray] = []
        for key in keys:
            data = self._blocks.get(key)
            if data is None:
                break
            self._blocks.move_to_end(key)
            out.append(data)
        return out

    async def put(self, items: Sequence[tuple[BlockKey, np.ndarray]]) -> StoreState:
        """Keep ``items`` (LRU within ``max_bytes``); returns the bytes taken and what is held after."""
        before = len(self._log)
        added = 0
        for key, data in items:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                continue
            if data.nbytes > self.max_bytes:
                continue
            while self._bytes + data.nbytes > self.max_bytes:
                old_key, old = self._blocks.popitem(last=False)
                self._bytes -= old.nbytes
                self._log.append((False, old_key))
            # A copy of its own: the argument is a read-only view of the object store's copy, which
            # Ray may free once this call returns.
            self._blocks[key] = np.array(data, copy=True)
            self._bytes += data.nbytes
            added += data.nbytes
            self._log.append((True, key))
        if len(self._log) > 2 * len(self._blocks) + 1024:  # compact: late readers get the whole set
            self._log_start += len(self._log)
            self._log = []
        if len(self._log) != before:
            self._changed.set()
            self._changed = asyncio.Event()
        return StoreState(added, len(self._blocks), self._bytes)

    async def index_since(self, incarnation: str, version: int, wait_s: float = 0.0) -> IndexUpdate:
        """What changed since ``version`` of ``incarnation`` (waiting up to ``wait_s`` for news); the whole
        key set if that cannot be told."""
        end = self._log_start + len(self._log)
        if wait_s > 0 and incarnation == self._incarnation and version == end:
            with contextlib.suppress(TimeoutError):  # no news within wait_s: answer that
                await asyncio.wait_for(self._changed.wait(), wait_s)
            end = self._log_start + len(self._log)
        if incarnation != self._incarnation or not self._log_start <= version <= end:
            return self._incarnation, end, list(self._blocks), []
        return self._incarnation, end, None, self._log[version - self._log_start :]

    async def stats(self) -> dict[str, int]:
        return {"blocks": len(self._blocks), "bytes": self._bytes, "max_bytes": self.max_bytes}


def store_scope(app: str | None, model_id: str) -> str:
    """The name prefix of the stores of ``app``'s engines of the model ``model_id`` (one per node)."""
    digest = hashlib.sha256(model_id.encode()).hexdigest()[:12]
    return f"{NAME_PREFIX}{app or NO_APP}/{digest}/"


def store_name(scope: str, node_id: str) -> str:
    return f"{scope}{node_id}"


def app_of(name: str) -> str | None:
    """The app part of a store's actor name (None: not a store's name)."""
    if not name.startswith(NAME_PREFIX):
        return None
    parts = name[len(NAME_PREFIX) :].rsplit("/", 2)  # an app's name may hold "/"; digest and node id do not
    return parts[0] if len(parts) == 3 else None


def local_store(scope: str, max_bytes: int) -> ActorHandle:
    """This node's store of ``scope``, started if there is none (pinned to the node, detached)."""
    node_id = ray.get_runtime_context().get_node_id()
    return KVStoreActor.options(  # type: ignore[attr-defined]  # ray.remote class
        name=store_name(scope, node_id), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(max_bytes)  # fmt: skip


def drop_stores(app: str | None) -> list[str]:
    """End every node's store of ``app`` (``None``: of engines outside Serve), whatever its model; their
    blocks are gone. Returns the names of the stores ended. Replicas still running start empty ones anew."""
    dropped = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if entry["namespace"] == NAMESPACE and app_of(name) == (app or NO_APP):
            with contextlib.suppress(ValueError):  # gone since listed
                ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
                dropped.append(name)
    return dropped


class _Mirror:
    """One store's key set as this client last read it."""

    def __init__(self) -> None:
        self.incarnation = ""
        self.version = 0
        self.keys: set[BlockKey] = set()

    def apply(self, update: IndexUpdate) -> None:
        incarnation, version, snapshot, events = update
        if snapshot is not None:
            self.keys = set(snapshot)
        for added, key in events:
            if added:
                self.keys.add(key)
            else:
                self.keys.discard(key)
        self.incarnation, self.version = incarnation, version


class RayBlockStore:
    """``BlockStore`` over every node's ``KVStoreActor`` of one app and model (``scope``, ``store_scope``):
    writes go to this node's, reads to the one holding the longest run, found in this client's mirror of
    their indexes.

    Ray lookups (listing the stores, finding or starting one) run outside ``_lock``: they have no timeout,
    and the load thread must not wait behind one another thread started (its wait is ``load_wait_s``).
    """

    def __init__(self, scope: str, max_bytes: int, timeout_s: float) -> None:
        if not ray.is_initialized():
            raise RuntimeError("kv_offload.cluster needs Ray: start the engine inside a Ray cluster")
        self.scope = scope
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self._local: ActorHandle | None = None
        self._stores: dict[str, ActorHandle] = {}
        self._mirrors: dict[str, _Mirror] = {}
        self._refreshed = 0.0
        self._lock = threading.Lock()  # the load, save and index threads all use the handles
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._faults = 0  # outages the index thread saw, not yet taken into the tier's errors (take_faults)
        # Started (or found) now, while the engine starts: a store's start-up is not a request's wait.
        ray.get(self._local_store().stats.remote(), timeout=STARTUP_TIMEOUT_S)
        self.refresh_index()
        self._thread = threading.Thread(target=self._follow, name="kv-store-index", daemon=True)
        self._thread.start()

    def take_faults(self) -> int:
        """Outages the index thread saw since the last call (one per outage), then 0."""
        with self._lock:
            faults, self._faults = self._faults, 0
        return faults

    def holds(self, key: BlockKey) -> bool:
        """Whether some store held ``key`` at the last refresh (or this client put it since)."""
        return any(key in m.keys for m in list(self._mirrors.values()))

    def fetch(self, keys: Sequence[BlockKey]) -> list[BlockBytes]:
        """From the store whose mirrored run of ``keys`` is longest; no call when none holds the first."""
        best, run = None, 0
        for name, mirror in list(self._mirrors.items()):
            n = 0
            for key in keys:
                if key not in mirror.keys:
                    break
                n += 1
            if n > run:
                best, run = name, n
        store = self._all().get(best) if best is not None else None
        if store is None:
            return []
        try:
            return list(ray.get(store.fetch.remote(list(keys[:run])), timeout=self.timeout_s))
        except Exception:
            self._forget()
            raise

    def put(self, items: Sequence[tuple[BlockKey, np.ndarray]]) -> StoreState:
        store = self._local_store()
        try:
            state = cast(StoreState, ray.get(store.put.remote(list(items)), timeout=max(self.timeout_s, 5.0)))
        except Exception:
            self._forget()
            raise
        mirror = self._mirrors.get(self._local_name())
        if mirror is not None:  # its own writes are visible to it at once
            mirror.keys.update(key for key, _ in items)
        return state

    def refresh_index(self, wait_s: float = 0.0) -> None:
        """Follow every store's log once, waiting up to ``wait_s`` for news (the index thread's long-poll)."""
        stores = self._all()
        mirrors = {name: self._mirrors.get(name) or _Mirror() for name in stores}
        updates: list[IndexUpdate] = ray.get([s.index_since.remote(mirrors[n].incarnation, mirrors[n].version, wait_s)
                                              for n, s in stores.items()], timeout=wait_s + max(self.timeout_s, 5.0))  # fmt: skip
        for name, update in zip(stores, updates, strict=True):
            mirrors[name].apply(update)
        self._mirrors = mirrors

    def close(self) -> None:
        """Stop following the indexes (the thread ends when its long-poll returns; it is a daemon)."""
        self._closed.set()

    def _follow(self) -> None:
        failing = False
        while not self._closed.is_set():
            try:
                self.refresh_index(INDEX_POLL_S)
            except Exception as e:  # noqa: BLE001 - a store that cannot answer: look again next time
                if self._closed.is_set():
                    return
                if not failing:  # once per outage
                    logger.warning("KV cluster tier: reading the stores' indexes failed (%s: %s); retrying",
                                   type(e).__name__, e)
                    with self._lock:
                        self._faults += 1
                failing = True
                self._forget()
                self._closed.wait(1.0)  # a store that is down: look again in a second
            else:
                failing = False
                self._closed.wait(INDEX_MIN_INTERVAL_S)

    def _local_name(self) -> str:
        return store_name(self.scope, ray.get_runtime_context().get_node_id())

    def _local_store(self) -> ActorHandle:
        local = self._local
        if local is None:
            # Found or started outside the lock (two threads may both look: get_if_exists gives one actor).
            local = local_store(self.scope, self.max_bytes)
            with self._lock:
                self._local = local
        return local

    def _all(self) -> dict[str, ActorHandle]:
        now = time.monotonic()
        stores = self._stores
        if stores and now - self._refreshed <= REFRESH_S:
            return stores
        # Looked up outside the lock (these calls have no timeout); the lock guards only the swap.
        stores = {self._local_name(): self._local_store()}
        for entry in ray.util.list_named_actors(all_namespaces=True):
            name = entry["name"]
            if entry["namespace"] == NAMESPACE and name.startswith(self.scope) and name not in stores:
                try:
                    stores[name] = ray.get_actor(name, namespace=NAMESPACE)
                except ValueError:  # gone since listed
                    continue
        with self._lock:
            self._refreshed = now
            self._stores = stores
        return stores

    def _forget(self) -> None:
        # A store failed: look them up again (restarting the local one) on the next call, and trust no
        # mirror meanwhile (what the dead store held is gone; blocks are saved anew).
        with self._lock:
            self._local = None
            self._stores = {}
            self._mirrors = {}
