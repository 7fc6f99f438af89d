"""The KV tiers below an engine's pool: host memory, local disk, and a cluster store.

Pages that join an engine's prefix cache are copied out (one step's
``Batch.kv_moves.saves``) and kept here as blocks (``kvcache.kv_blocks``): in host
memory (LRU, at most ``host_bytes``), spilling to a local disk folder (LRU,
at most ``disk_bytes``), and written through to the cluster store when
``cluster`` is on, so that every replica of the cluster can read them. A
request's admission then finds its prefix in the radix tree first, then
here: host, disk, cluster, in that order, block by block from the first
block the tree lacks, stopping at the first block no tier holds.

Every tier is a cache: a block that is missing, corrupt, from another model,
dtype or layout, a store that died, a disk that is full or unwritable, each
ends as a miss (the KV is computed again) and a count in ``TierStats.errors``
with one warning per kind of fault, never as an exception to the engine or
as wrong KV. Memory and disk stay within their bounds: a block is admitted
only after older ones are evicted to make room for it.

Thread safety: one thread calls ``fetch`` and another ``save`` (a load never
waits behind a save); each tier's index is changed under its own lock, held
for dict operations and, on disk, a file's read or write; the counters
(``TierStats``) under theirs. The engine's
thread calls ``stage`` and ``known``, which only read or set
single dict entries (atomic operations under the GIL).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import BinaryIO, NamedTuple, Protocol

import numpy as np

from kvcache.errors import CacheConfigError
from kvcache.kv_blocks import (
    Block,
    BlockBytes,
    BlockKey,
    decode_block,
    encode_pages,
    page_block,
    payloads_of,
)
from kvcache.kv_tiers_config import KVTiersConfig
from kvcache.kv_transfer import KVLayout, RankPayloads

logger = logging.getLogger("flotilla.kv_tiers")

TIER_NAMES = ("host", "disk", "cluster")
# An engine folder with no lock file this long after it was made is a crashed start's (``sweep_abandoned``).
ABANDONED_AFTER_S = 60.0


@dataclass
class TierStats:
    """One tier's counters since the engine started (``/metrics`` and ``stats``).

    The load and save threads both count (a disk or store fault shows up on either): every change goes
    through ``add`` or ``hold``, under the counters' own lock, and ``to_dict`` reads them under it.
    """

    lookups: int = 0  # blocks asked for
    hits: int = 0  # blocks found and whole
    bytes_read: int = 0
    bytes_written: int = 0
    load_seconds: float = 0.0
    errors: int = 0  # faults turned into misses or dropped writes (corrupt block, dead store, full disk)
    blocks: int = 0  # blocks held now (the cluster tier: this node's store of this app and model, at the last put)
    bytes: int = 0  # bytes held now (likewise)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, *, lookups: int = 0, hits: int = 0, bytes_read: int = 0, bytes_written: int = 0,
            load_seconds: float = 0.0, errors: int = 0, blocks: int = 0, bytes: int = 0) -> None:  # fmt: skip
        """Add to the counters (from any thread)."""
        with self._lock:
            self.lookups += lookups
            self.hits += hits
            self.bytes_read += bytes_read
            self.bytes_written += bytes_written
            self.load_seconds += load_seconds
            self.errors += errors
            self.blocks += blocks
            self.bytes += bytes

    def hold(self, blocks: int, num_bytes: int) -> None:
        """Set what the tier holds now."""
        with self._lock:
            self.blocks, self.bytes = blocks, num_bytes

    def to_dict(self) -> dict[str, float]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}


class StoreState(NamedTuple):
    """What a store answers a put with: the bytes it took (not those it held already or had no room for),
    and what it holds after it."""

    bytes_added: int
    blocks: int
    bytes: int


class BlockStore(Protocol):
    """The cluster tier as a client sees it (``actors.kv_store``). Any failure raises."""

    def holds(self, key: BlockKey) -> bool:
        """Whether some store holds ``key``, as far as this client knows (no call: its mirror of the index)."""

    def fetch(self, keys: Sequence[BlockKey]) -> list[BlockBytes]:
        """The encoded blocks of the longest run of ``keys``, from the first on, that one store holds."""

    def put(self, items: Sequence[tuple[BlockKey, np.ndarray]]) -> StoreState:
        """Hand encoded blocks to the store (it may drop them to stay within its bound)."""

    def take_faults(self) -> int:
        """Outages the client saw on its own since the last call (its index could not be read), then 0."""


class HostTier:
    """Encoded blocks in this process's memory, LRU within ``max_bytes``."""

    def __init__(self, max_bytes: int, stats: TierStats) -> None:
        self.max_bytes = max_bytes
        self.stats = stats
        self._blocks: OrderedDict[BlockKey, np.ndarray] = OrderedDict()
        self._bytes = 0  # of the blocks held (under _lock; mirrored in stats)
        self._lock = threading.Lock()

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._blocks

    def get(self, key: BlockKey) -> np.ndarray | None:
        with self._lock:
            block = self._blocks.get(key)
            if block is not None:
                self._blocks.move_to_end(key)
            return block

    def put(self, key: BlockKey, block: np.ndarray) -> list[tuple[BlockKey, np.ndarray]]:
        """Keep ``block``; returns the blocks evicted to make room (or ``block`` itself, if it cannot fit)."""
        with self._lock:
            return self._put(key, block)

    def _put(self, key: BlockKey, block: np.ndarray) -> list[tuple[BlockKey, np.ndarray]]:
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return []
        size = block.nbytes
        if size > self.max_bytes:
            return [(key, block)]
        evicted = []
        while self._bytes + size > self.max_bytes:
            old_key, old = self._blocks.popitem(last=False)
            self._bytes -= old.nbytes
            evicted.append((old_key, old))
        self._blocks[key] = block
        self._bytes += size
        self.stats.add(bytes_written=size)
        self.stats.hold(len(self._blocks), self._bytes)
        return evicted


class DiskTier:
    """Encoded blocks as files ``<key hex>.kvb`` in one folder, LRU within ``max_bytes``.

    The folder's existing blocks are indexed at start (oldest first by
    modification time), so a restarted engine finds them again. Writes go to
    a temporary name and are renamed into place, so a reader never sees half
    a block; a write that fails (full disk, no permission) drops the block.

    The folder is this engine's alone while it runs: it is created 0700 and
    refused unless this process's user owns it and no other user may write
    it (a block planted there would be served as KV), and an exclusive lock on
    its ``.lock`` file (``flock``: the kernel drops it when the process dies)
    refuses a second engine, by name. Blocks are 0600; temporary files are
    opened ``O_EXCL | O_NOFOLLOW`` (a planted link is not followed). With the
    lock held, any temporary file found is a crashed writer's and is removed.
    """

    SUFFIX = ".kvb"
    TMP_SUFFIX = ".tmp"
    LOCK = ".lock"

    def __init__(self, path: Path, max_bytes: int, stats: TierStats) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.stats = stats
        self._files: OrderedDict[BlockKey, int] = OrderedDict()
        self._bytes = 0  # of the files indexed (under _lock; mirrored in stats)
        self._lock = threading.Lock()
        self._held = lock_folder(path)
        for f in path.glob(f".*{self.TMP_SUFFIX}"):
            f.unlink(missing_ok=True)
        found = []
        for f in path.glob(f"*{self.SUFFIX}"):
            try:
                key = bytes.fromhex(f.stem)
                st = f.stat()
            except (ValueError, OSError):
                continue
            found.append((st.st_mtime, key, st.st_size))
        for _, key, size in sorted(found):
            self._files[key] = size
            self._bytes += size
        stats.hold(len(self._files), self._bytes)
        self._make_room(0)

    def close(self) -> None:
        """Release the folder (another engine may take it now)."""
        self._held.close()

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._files

    def file(self, key: BlockKey) -> Path:
        return self.path / f"{key.hex()}{self.SUFFIX}"

    def get(self, key: BlockKey) -> bytes | None:
        with self._lock:
            if key not in self._files:
                return None
            try:
                data = self.file(key).read_bytes()
            except OSError:
                self._forget(key)
                return None
            self._files.move_to_end(key)
            return data

    def put(self, key: BlockKey, data: np.ndarray) -> bool:
        with self._lock:
            return self._put(key, data)

    def _put(self, key: BlockKey, data: np.ndarray) -> bool:
        if key in self._files:
            self._files.move_to_end(key)
            return True
        if len(data) > self.max_bytes:
            return False
        self._make_room(len(data))
        tmp = self.path / f".{key.hex()}.{os.getpid()}{self.TMP_SUFFIX}"
        try:
            self.write(tmp, data)
            os.replace(tmp, self.file(key))
        except OSError as e:
            tmp.unlink(missing_ok=True)
            self.stats.add(errors=1)
            _warn_once(f"disk-{e.errno}", "KV disk tier: writing a block to %s failed (%s); the block is dropped",
                       self.path, errno.errorcode.get(e.errno or 0, str(e)))  # fmt: skip
            return False
        self._files[key] = len(data)
        self._bytes += len(data)
        self.stats.add(bytes_written=len(data))
        self.stats.hold(len(self._files), self._bytes)
        return True

    @staticmethod
    def write(path: Path, data: np.ndarray) -> None:
        """Write one new file, 0600 (the one place a full or unwritable disk shows up)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with open(fd, "wb") as f:
            f.write(memoryview(data.data))

    def remove(self, key: BlockKey) -> None:
        """Drop a block (found corrupt or foreign)."""
        with self._lock:
            self.file(key).unlink(missing_ok=True)
            self._forget(key)

    def _forget(self, key: BlockKey) -> None:
        size = self._files.pop(key, None)
        if size is not None:
            self._bytes -= size
            self.stats.hold(len(self._files), self._bytes)

    def _make_room(self, size: int) -> None:
        while self._files and self._bytes + size > self.max_bytes:
            key = next(iter(self._files))
            self.file(key).unlink(missing_ok=True)
            self._forget(key)


def lock_folder(path: Path) -> BinaryIO:
    """Create ``path`` (0700) if need be, check it is this user's alone, and lock it for this engine.

    Returns the open lock file: the folder stays locked until it is closed (or the process ends).
    Raises ``CacheConfigError`` naming ``disk_path`` when another user owns the folder, others may
    write it, or another engine holds it.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = path.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise CacheConfigError("kv_offload", f"disk_path {str(path)!r} is not a folder")
    if st.st_uid != os.geteuid():
        raise CacheConfigError("kv_offload", f"disk_path {str(path)!r} is owned by uid {st.st_uid}, not by this "
                                             f"process's user (uid {os.geteuid()}): give a folder of its own")
    if st.st_mode & 0o022:
        raise CacheConfigError("kv_offload", f"disk_path {str(path)!r} may be written by other users (mode "
                                             f"{stat.S_IMODE(st.st_mode):o}): chmod it 0700 or give a folder of its own")
    try:
        held = _try_lock(path / DiskTier.LOCK, create=True)
    except OSError as e:  # a link planted as the lock file (O_NOFOLLOW), or no permission
        raise CacheConfigError("kv_offload", f"disk_path {str(path)!r}: cannot open its lock file {DiskTier.LOCK} "
                                             f"({e.strerror})") from None
    if held is None:
        raise CacheConfigError("kv_offload", f"disk_path {str(path)!r} is in use by another engine (it holds "
                                             f"{DiskTier.LOCK} there): give each engine a folder of its own")
    return held


def sweep_abandoned(parent: Path) -> int:
    """Remove the engine folders under ``parent`` that no live engine holds (crashed ones'); returns how many.

    A folder whose lock can be taken has no engine: its engine died (a clean stop removes its own). One
    with no lock file yet is spared for ``ABANDONED_AFTER_S``: its engine may be between creating and
    locking it. Only this user's folders are touched.
    """
    removed = 0
    with contextlib.suppress(FileNotFoundError):
        for child in parent.iterdir():
            try:
                st = child.lstat()
            except OSError:
                continue
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                continue
            lock_file = child / DiskTier.LOCK
            if not lock_file.exists():
                if time.time() - st.st_mtime > ABANDONED_AFTER_S:
                    shutil.rmtree(child, ignore_errors=True)
                    removed += 1
                continue
            try:
                held = _try_lock(lock_file, create=False)
            except OSError:  # a link planted as the lock file, say: not ours to judge
                continue
            if held is None:  # a live engine's
                continue
            with held:  # removed while locked: no engine can take it meanwhile
                shutil.rmtree(child, ignore_errors=True)
            removed += 1
    return removed


def _try_lock(lock_file: Path, *, create: bool) -> BinaryIO | None:
    """``lock_file`` open and exclusively locked, or None when another open file holds its lock."""
    flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT if create else 0)
    try:
        fd = os.open(lock_file, flags, 0o600)
    except FileNotFoundError:
        if create:
            raise
        return None  # the folder went meanwhile
    f = open(fd, "r+b")  # noqa: SIM115 - held open for the engine's life: the lock lives as long as it
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    return f


class TieredKV:
    """Host, disk and cluster tiers of one engine (each optional), read and written in that order."""

    def __init__(self, config: KVTiersConfig, layout: KVLayout, world_size: int, *,
                 disk_path: Path | None, store: BlockStore | None) -> None:  # fmt: skip
        self.layout = layout
        self.world_size = world_size
        self.stats = {name: TierStats() for name in TIER_NAMES}
        self.host = HostTier(config.host_bytes, self.stats["host"]) if config.host_bytes else None
        self.disk = None
        if config.disk_bytes:
            assert disk_path is not None
            self.disk = DiskTier(disk_path, config.disk_bytes, self.stats["disk"])
        self.store = store
        # Blocks handed over (``stage``) whose ``save`` has not run yet: found by loads meanwhile.
        self.staged: dict[BlockKey, tuple[RankPayloads, int]] = {}

    def close(self) -> None:
        """Release what the tiers hold outside this process (the disk folder's lock)."""
        if self.disk is not None:
            self.disk.close()

    def stage(self, keys: Sequence[BlockKey], payloads: RankPayloads) -> None:
        """Make the pages of ``payloads`` findable now; ``save`` (on the worker) files them later."""
        for i, key in enumerate(keys):
            self.staged[key] = (payloads, i)

    def fetch(self, keys: Sequence[BlockKey]) -> RankPayloads | None:
        """The blocks of ``keys`` from the first up to the first no tier holds, joined; None if the first is missing."""
        blocks: list[Block] = []
        for key in keys:
            block = self._local(key)
            if block is None:
                break
            blocks.append(block)
        if self.store is not None:
            # A store the client found dead between lookups (then it makes no call, holding no index of it)
            # counts as the fault a failed read would have been.
            self.stats["cluster"].add(errors=self.store.take_faults())
        if len(blocks) < len(keys) and self.store is not None:
            blocks += self._cluster(keys[len(blocks) :])
        return payloads_of(blocks) if blocks else None

    def save(self, keys: Sequence[BlockKey], payloads: RankPayloads) -> None:
        """Keep the pages of ``payloads`` (one per key, in order) in every tier that is on."""
        self.save_many([(keys, payloads)])

    def save_many(self, groups: Sequence[tuple[Sequence[BlockKey], RankPayloads]]) -> None:
        """``save`` for several steps' pages at once: one call to the cluster store for all of them."""
        try:
            self._save([item for keys, payloads in groups
                        for item in zip(keys, encode_pages(keys, self.layout, payloads), strict=True)])  # fmt: skip
        finally:
            for keys, _ in groups:
                for key in keys:
                    self.staged.pop(key, None)

    def known(self, key: BlockKey) -> bool:
        """Whether a tier holds ``key`` or it waits to be saved: no need to copy it out again.

        For the cluster tier, as far as the client's mirror of the stores' index knows (no call).
        """
        return (key in self.staged or (self.host is not None and key in self.host)
                or (self.disk is not None and key in self.disk) or (self.store is not None and self.store.holds(key)))

    def _save(self, items: list[tuple[BlockKey, np.ndarray]]) -> None:
        spill = items
        if self.host is not None:
            spill = [old for key, data in items for old in self.host.put(key, data)]
        if self.disk is not None:
            for key, data in spill:
                self.disk.put(key, data)
        if self.store is not None:
            try:
                state = self.store.put(items)
            except Exception as e:  # noqa: BLE001 - a dead or unreachable store is a dropped write
                self._store_failed("put", e)
            else:
                stats = self.stats["cluster"]
                stats.add(bytes_written=state.bytes_added)
                stats.hold(state.blocks, state.bytes)

    def _local(self, key: BlockKey) -> Block | None:
        staged = self.staged.get(key)
        if staged is not None:
            self.stats["host"].add(lookups=1, hits=1)
            return page_block(*staged)
        if self.host is not None:
            stats = self.stats["host"]
            held = self.host.get(key)
            block = None if held is None else decode_block(held, key, self.layout, self.world_size)
            if block is not None and held is not None:
                stats.add(lookups=1, hits=1, bytes_read=held.nbytes)
                return block
            # memory that went bad under it is a miss like any corrupt block
            stats.add(lookups=1, errors=int(held is not None))
        if self.disk is None or key not in self.disk:
            if self.disk is not None:
                self.stats["disk"].add(lookups=1)
            return None
        stats = self.stats["disk"]
        start = time.perf_counter()
        data = self.disk.get(key)
        block = None if data is None else decode_block(data, key, self.layout, self.world_size)
        stats.add(lookups=1, load_seconds=time.perf_counter() - start)
        if block is None:
            if data is not None:
                stats.add(errors=1)
                _warn_once("disk-corrupt", "KV disk tier: block %s in %s is corrupt or from another model or "
                                           "layout; it is dropped and recomputed", key.hex(), self.disk.path)
                self.disk.remove(key)
            return None
        stats.add(hits=1, bytes_read=len(data or b""))
        # Not promoted to host memory: what that pushed out would go to disk and could evict the very
        # blocks later in this chain. The load puts it into the pool; the pool's radix tree is its cache.
        return block

    def _cluster(self, keys: Sequence[BlockKey]) -> list[Block]:
        assert self.store is not None
        stats = self.stats["cluster"]
        start = time.perf_counter()
        blocks: list[Block] = []
        try:
            datas = self.store.fetch(keys)
        except Exception as e:  # noqa: BLE001 - a dead or unreachable store is a miss
            self._store_failed("read", e)
            return []
        finally:
            stats.add(lookups=len(keys), load_seconds=time.perf_counter() - start)
        for key, data in zip(keys, datas, strict=False):
            block = decode_block(data, key, self.layout, self.world_size)
            if block is None:
                stats.add(errors=1)
                _warn_once("cluster-corrupt", "KV cluster tier: block %s is corrupt or from another model "
                                              "or layout; it is recomputed", key.hex())
                break
            stats.add(bytes_read=len(data))
            blocks.append(block)
        stats.add(hits=len(blocks))
        return blocks

    def _store_failed(self, what: str, e: Exception) -> None:
        self.stats["cluster"].add(errors=1)
        _warn_once(f"cluster-{what}", "KV cluster tier: %s failed (%s: %s); the KV is recomputed until the "
                                      "store answers again", what, type(e).__name__, e)


_WARNED: set[str] = set()


def _warn_once(kind: str, message: str, *args: object) -> None:
    # One warning per kind of fault per process: a dead store would otherwise log on every request.
    # The counts keep going up in ``TierStats.errors``.
    if kind not in _WARNED:
        _WARNED.add(kind)
        logger.warning(message, *args)
