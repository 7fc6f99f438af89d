"""The engine's link to its KV tiers (``kvcache.kv_tiers``): lookups at intake, saves after steps.

Each runs on a worker thread of its own, so a load never waits behind a
save, and a step never waits for either.
A new request whose prefix goes past what the radix tree holds asks the
tiers for the rest of its full prompt pages (``start_load``); it waits in
the queue (``Request.kv_moves.loading``) until they answer or ``load_wait_s`` has
passed, whichever is first, and ``deliver`` (before each plan) hands it
whatever arrived. A waiting engine is woken when a load ends (``wake``).
Pages new to the radix tree are picked for saving here (``select``, the
scheduler's ``KVSaver``: the ones no tier is known to hold), copied out by
the next step, and handed to the tiers when it returns (``store``).
"""

from __future__ import annotations

import contextlib
import queue
import shutil
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actors.config import EngineConfig
from actors.kv_store import RayBlockStore, store_scope
from actors.load.model_cache import cache_dir
from actors.load.weights_digest import model_digest
from actors.log import get_logger
from kvcache.kv_blocks import BlockKey, block_keys, block_salt
from kvcache.kv_tiers import TieredKV, sweep_abandoned
from kvcache.kv_tiers_config import KVTiersConfig
from kvcache.kv_transfer import KVLayout, RankPayloads
from scheduling.policy import BatchPolicy
from scheduling.request import Request, RequestStatus, TierHit

logger = get_logger(__name__.rsplit(".", 1)[-1])


@dataclass(slots=True)
class _Load:
    req: Request
    first_page: int
    future: Future[RankPayloads | None]
    deadline: float


class _Worker:
    """One daemon thread running jobs in submission order."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        self._queue.put((future, job))
        return future

    def stop(self, timeout_s: float) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, job = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(job())
                except BaseException as e:  # noqa: BLE001 - handed to whoever reads the future
                    future.set_exception(e)


class KVTiersLink:
    """One engine's tiers, its loads in flight, and the ``KVSaver`` its batch policy asks."""

    def __init__(self, config: EngineConfig, offload: KVTiersConfig, layout: KVLayout, model_path: Path,
                 policy: BatchPolicy) -> None:  # fmt: skip
        self.page_size = config.page_size
        self.load_wait_s = offload.load_wait_s
        self.world_size = config.tensor_parallel_size
        self.layout = layout
        self.model_id = model_identity(config, model_path)
        self._own_disk: Path | None = None
        disk_path: Path | None = None
        if offload.disk_bytes:
            if offload.disk_path is not None:
                disk_path = Path(offload.disk_path).expanduser()
            else:  # a folder of this engine's own, removed when it stops (or, if it crashes, by the next start)
                parent = cache_dir() / "kv_blocks"
                sweep_abandoned(parent)
                disk_path = self._own_disk = parent / uuid.uuid4().hex[:12]
        self._store = None
        if offload.cluster:
            scope = store_scope(offload.cluster_app, self.model_id)
            self._store = RayBlockStore(scope, offload.cluster_bytes, max(offload.load_wait_s, 0.1))
        self.tiers = TieredKV(offload, layout, self.world_size, disk_path=disk_path, store=self._store)
        self.policy = policy
        policy.kv.saver = self
        self._salts: dict[str | None, bytes] = {}
        self._loads: dict[str, _Load] = {}
        self._loader = _Worker("kv-tier-loads")
        self._saver = _Worker("kv-tier-saves")
        # Appended here with their bytes, taken by the saver; ``_pending_bytes`` (under ``_pending_lock``: the
        # saver lowers it) counts every page handed over and not filed yet, at most ``save_queue_bytes``.
        self._to_save: deque[tuple[list[BlockKey], RankPayloads, int]] = deque()
        self.save_queue_bytes = offload.save_queue_bytes
        self._pending_bytes = 0
        self._pending_lock = threading.Lock()
        self.wake: Callable[[], None] = _nothing
        self.load_timeouts = 0  # loads that outlasted load_wait_s (the request computed its prefix)
        self.dropped_saves = 0  # pages not saved because the tiers lagged behind (save_queue_bytes)

    # ------------------------------------------------------------------ saves
    def select(self, namespace: str | None, token_ids: list[int], first_page: int,
               num_pages: int) -> list[tuple[int, bytes]]:  # fmt: skip
        keys = block_keys(self._salt(namespace), token_ids, first_page + num_pages, self.page_size)
        known = self.tiers.known
        return [(i, keys[i]) for i in range(first_page, first_page + num_pages) if not known(keys[i])]

    def store(self, keys: list[BlockKey], payloads: RankPayloads) -> None:
        """Hand a step's copied-out pages to the tiers (on the worker); dropped, never waited for, when the
        pages not filed yet would pass ``save_queue_bytes``."""
        size = sum(p.nbytes for p in payloads)
        with self._pending_lock:
            if self._pending_bytes + size > self.save_queue_bytes:
                self.dropped_saves += len(keys)
                return
            self._pending_bytes += size
        self.tiers.stage(keys, payloads)
        self._to_save.append((keys, payloads, size))
        self._saver.submit(self._save_queued).add_done_callback(_log_failure)

    def _save_queued(self) -> None:
        # Every step's pages handed over since the last run, in one batch (one call to the cluster
        # store); a job that finds the queue empty (an earlier one took its pages) does nothing.
        groups = []
        while self._to_save:
            groups.append(self._to_save.popleft())
        if not groups:
            return
        try:
            self.tiers.save_many([(keys, payloads) for keys, payloads, _ in groups])
        finally:
            with self._pending_lock:
                self._pending_bytes -= sum(size for _, _, size in groups)

    def wait_for_saves(self, timeout_s: float = 60.0) -> None:
        """Block until every save handed over so far is filed (what the tests wait on)."""
        self._saver.submit(_nothing).result(timeout_s)

    def keys_for(self, namespace: str | None, token_ids: list[int]) -> list[BlockKey]:
        """The block keys of ``token_ids``' full pages in ``namespace`` (tests forge blocks under them)."""
        return block_keys(self._salt(namespace), token_ids, len(token_ids) // self.page_size, self.page_size)

    # ------------------------------------------------------------------ loads
    def start_load(self, req: Request) -> None:
        """Ask the tiers for ``req``'s full prompt pages past the radix match, if any tier may hold them."""
        ps = self.page_size
        num_blocks = (req.num_tokens - 1) // ps
        cache = self.policy.cache
        matched = 0 if cache is None else cache.match_prefix(req.all_token_ids, req.cache_namespace).num_tokens // ps
        if matched >= num_blocks:
            return
        keys = block_keys(self._salt(req.cache_namespace), req.all_token_ids, num_blocks, ps)[matched:]
        if not self.tiers.known(keys[0]):  # no tier holds its first block, as far as this process knows
            return
        future = self._loader.submit(lambda: self.tiers.fetch(keys))
        future.add_done_callback(lambda _: self.wake())
        req.kv_moves.loading = True
        self._loads[req.request_id] = _Load(req, matched, future, time.monotonic() + self.load_wait_s)

    def deliver(self) -> None:
        """Hand the waiting requests what their loads brought; release those that waited long enough."""
        if not self._loads:
            return
        now = time.monotonic()
        for rid, load in list(self._loads.items()):
            req = load.req
            if req.status is not RequestStatus.WAITING:  # aborted while it waited
                del self._loads[rid]
            elif load.future.done():
                del self._loads[rid]
                req.kv_moves.loading = False
                try:
                    payload = load.future.result()
                except Exception:
                    logger.exception("a KV tier load failed; the request computes its prefix")
                    payload = None
                if payload is not None:
                    req.kv_moves.loaded = TierHit(load.first_page, payload)
            elif now >= load.deadline:
                del self._loads[rid]
                req.kv_moves.loading = False
                self.load_timeouts += 1

    def wait_for_loads(self) -> None:
        """Block until a load ends or the earliest one's wait runs out (the offline loop, with nothing to run)."""
        if not self._loads:
            return
        first = min(self._loads.values(), key=lambda load: load.deadline)
        with contextlib.suppress(Exception):  # a timeout or a failed load: deliver() sorts it out
            first.future.result(timeout=max(first.deadline - time.monotonic(), 0.0))

    def seconds_to_deadline(self) -> float | None:
        """How long until the earliest waiting request's ``load_wait_s`` runs out (None: no load waits).

        An idle loop sleeps at most this long: a load that never answers still ends in a recompute.
        """
        if not self._loads:
            return None
        return max(min(load.deadline for load in self._loads.values()) - time.monotonic(), 0.0)

    @property
    def has_loads(self) -> bool:
        return bool(self._loads)

    # ---------------------------------------------------------------- the rest
    def stats(self) -> tuple[tuple[str, tuple[tuple[str, float], ...]], ...]:
        """Per tier, its counters (``TierStats``), for ``EngineStats.kv_tiers``."""
        out = [(name, tuple(s.to_dict().items())) for name, s in self.tiers.stats.items()]
        out.append(("engine", (("load_timeouts", self.load_timeouts), ("dropped_saves", self.dropped_saves),
                               ("tier_hit_tokens", self.policy.stats.tier_hit_tokens))))  # fmt: skip
        return tuple(out)

    def shutdown(self) -> None:
        self._loader.stop(5.0)
        self._saver.stop(5.0)
        if self._store is not None:
            self._store.close()
        if self._own_disk is not None:  # removed while still locked: no sweep of another engine races it
            shutil.rmtree(self._own_disk, ignore_errors=True)
        self.tiers.close()

    def _salt(self, namespace: str | None) -> bytes:
        salt = self._salts.get(namespace)
        if salt is None:
            salt = self._salts[namespace] = block_salt(self.model_id, namespace, self.layout, self.world_size)
        return salt


def model_identity(config: EngineConfig, model_path: Path) -> str:
    """What names the weights in a block key: the digest of the model's files, and how they are quantized.

    Not its path nor its ``model`` setting: replicas on other nodes load the same model from other
    folders, and a fine-tune copied over the old files at the same path (with the same ``config.json``)
    must not meet the old weights' blocks on disk or in the cluster store.
    """
    return f"{model_digest(model_path)}|{config.quantization}|{config.quantization_group_size}"


def _nothing() -> None:
    return None


def _log_failure(future: Future[Any]) -> None:
    exc = future.exception()
    if exc is not None:
        logger.error("saving KV blocks to the tiers failed: %r", exc)
