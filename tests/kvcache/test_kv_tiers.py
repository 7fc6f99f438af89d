"""KV tiers below the pool: block keys, block bytes and their checks, the host and disk tiers within bounds."""

from __future__ import annotations

import errno
import os
import stat
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvcache.errors import CacheConfigError
from kvcache.kv_blocks import (
    KEY_BYTES,
    BlockBytes,
    block_keys,
    block_salt,
    decode_block,
    encode_pages,
    page_block,
    payloads_of,
)
from kvcache.kv_pool import KVPool
from kvcache.kv_tiers import (
    ABANDONED_AFTER_S,
    BlockStore,
    DiskTier,
    StoreState,
    TieredKV,
    TierStats,
    sweep_abandoned,
)
from kvcache.kv_tiers_config import KVTiersConfig
from kvcache.kv_transfer import KVLayout, RankPayloads

SHAPE: dict[str, Any] = {"num_layers": 2, "page_size": 4, "num_kv_heads": 2, "head_dim": 8}


def _pool(dtype: torch.dtype = torch.float32, kv_dtype: str = "auto", seed: int = 0) -> KVPool:
    pool = KVPool(num_pages=16, dtype=dtype, kv_dtype=kv_dtype, **SHAPE)
    gen = torch.Generator().manual_seed(seed)
    for caches in (pool.k_caches, pool.v_caches):
        for c in caches:
            c.copy_(torch.randn(c.shape, generator=gen).to(c.dtype))
    for scales in (pool.k_scales or [], pool.v_scales or []):
        for s in scales:
            s.copy_(torch.rand(s.shape, generator=gen).to(s.dtype))
    return pool


def _pages(pool: KVPool, pages: list[int]) -> RankPayloads:
    return (pool.read_pages(pages),)


def _equal(a: RankPayloads, b: RankPayloads) -> bool:
    return all(
        torch.equal(x, y)
        for pa, pb in zip(a, b, strict=True)
        for x, y in zip(pa.k + pa.v + (pa.k_scales or ()), pb.k + pb.v + (pb.k_scales or ()), strict=True)
    )


def test_keys_chain_every_token_before_them() -> None:
    layout = KVLayout.of(_pool())
    salt = block_salt("m", None, layout, 1)
    tokens = list(range(20))
    keys = block_keys(salt, tokens, 5, 4)
    assert len(keys) == 5 and len(set(keys)) == 5 and all(len(k) == KEY_BYTES for k in keys)
    changed = block_keys(salt, [99, *tokens[1:]], 5, 4)
    assert all(a != b for a, b in zip(keys, changed, strict=True))  # the first token reaches every key
    late = block_keys(salt, [*tokens[:12], 99, *tokens[13:]], 5, 4)
    assert late[:3] == keys[:3] and all(a != b for a, b in zip(keys[3:], late[3:], strict=True))
    for other in (block_salt("m2", None, layout, 1), block_salt("m", "adapter-a", layout, 1),
                  block_salt("m", None, KVLayout.of(_pool(torch.bfloat16)), 1), block_salt("m", None, layout, 2)):
        assert block_keys(other, tokens, 5, 4)[0] != keys[0]
    with pytest.raises(ValueError, match="need 24 tokens"):
        block_keys(salt, tokens, 6, 4)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_blocks_round_trip_and_refuse_anything_else(kv_dtype: str) -> None:
    pool = _pool(kv_dtype=kv_dtype)
    layout = KVLayout.of(pool)
    block = _pages(pool, [3])
    key, other_key = b"k" * KEY_BYTES, b"o" * KEY_BYTES
    data = encode_pages([key], layout, block)[0]
    back = decode_block(data, key, layout, 1)
    assert back is not None and _equal(payloads_of([back]), block)
    assert decode_block(data, other_key, layout, 1) is None  # someone else's block under this name
    assert decode_block(data, key, layout, 2) is None  # another tensor-parallel size
    for pos in (len(data) // 2, len(data) - 1, 3, 40):
        corrupt = bytearray(data)
        corrupt[pos] ^= 0x10
        assert decode_block(bytes(corrupt), key, layout, 1) is None, pos
    assert decode_block(data[:-5], key, layout, 1) is None
    assert decode_block(b"", key, layout, 1) is None
    # A whole, well-formed block of another model dtype, filed under this key: refused by its layout.
    bf16 = _pool(torch.bfloat16)
    foreign = encode_pages([key], KVLayout.of(bf16), _pages(bf16, [3]))[0]
    assert decode_block(foreign, key, layout, 1) is None


def test_split_and_join_are_inverse() -> None:
    pool = _pool()
    payload = _pages(pool, [5, 1, 9])
    layout = KVLayout.of(pool)
    keys = _keys(3)
    blocks = [decode_block(d, k, layout, 1) for k, d in zip(keys, encode_pages(keys, layout, payload), strict=True)]
    assert all(b is not None and b.kv[0].shape == (4, 4, 2, 8) for b in blocks)  # 2 layers' k and v
    whole = [b for b in blocks if b is not None]
    assert _equal(payloads_of(whole), payload)
    assert _equal(payloads_of([whole[1]]), _pages(pool, [1]))
    assert _equal(payloads_of([page_block(payload, 2)]), _pages(pool, [9]))


def test_config_is_checked_by_name() -> None:
    assert KVTiersConfig.parse('{"host_bytes": 2e6}') == KVTiersConfig(host_bytes=2_000_000)
    assert KVTiersConfig.parse(None) is None
    for bad, words in [({}, "every tier is off"), ({"host_bytes": -1}, "host_bytes"), ({"hots_bytes": 1}, "unknown"),
                       ({"disk_path": "/tmp/x"}, "disk_bytes is 0"), ("{nope", "not valid JSON"),
                       ({"cluster": "yes"}, "cluster must be"), ({"host_bytes": 1, "load_wait_s": 90}, "load_wait_s"),
                       ([1], "must be an object"), ({"host_bytes": 1, "save_queue_bytes": -1}, "save_queue_bytes"),
                       ({"cluster": True, "cluster_app": ""}, "cluster_app must be")]:  # fmt: skip
        with pytest.raises(CacheConfigError, match=words) as info:
            KVTiersConfig.parse(bad)  # type: ignore[arg-type]
        assert info.value.param == "kv_offload"


def _tiers(tmp_path: Path, *, host: int = 0, disk: int = 0, store: BlockStore | None = None) -> TieredKV:
    config = KVTiersConfig(host_bytes=host, disk_bytes=disk, cluster=store is not None)
    return TieredKV(config, KVLayout.of(_pool()), 1, disk_path=tmp_path / "blocks" if disk else None, store=store)


def _encoded_bytes(pool: KVPool) -> int:
    return len(encode_pages([b"k" * KEY_BYTES], KVLayout.of(pool), _pages(pool, [0]))[0])


def _keys(n: int, seed: int = 0) -> list[bytes]:
    return block_keys(bytes([seed]) * 16, list(range(4 * n)), n, 4)


def test_host_tier_keeps_the_newest_blocks_within_its_bytes(tmp_path: Path) -> None:
    pool = _pool()
    block_bytes = _encoded_bytes(pool)  # the host tier keeps blocks encoded, as disk and store do
    tiers = _tiers(tmp_path, host=3 * block_bytes)
    keys = _keys(5)
    tiers.save(keys, _pages(pool, [0, 1, 2, 3, 4]))
    host = tiers.stats["host"]
    assert host.bytes <= 3 * block_bytes and host.blocks == 3
    assert tiers.fetch(keys) is None  # the first two were evicted: the chain starts with a miss
    got = tiers.fetch(keys[2:])
    assert got is not None and _equal(got, _pages(pool, [2, 3, 4]))


def test_disk_tier_spills_from_host_and_stays_within_bytes(tmp_path: Path) -> None:
    pool = _pool()
    file_bytes = _encoded_bytes(pool)
    tiers = _tiers(tmp_path, host=2 * file_bytes, disk=4 * file_bytes + file_bytes // 2)
    keys = _keys(8)
    tiers.save(keys, _pages(pool, list(range(8))))
    disk = tiers.stats["disk"]
    files = list((tmp_path / "blocks").glob("*.kvb"))
    assert len(files) == 4 and sum(f.stat().st_size for f in files) == disk.bytes <= 4 * file_bytes + file_bytes // 2
    # The newest six: two in host memory, four on disk; the first two are gone.
    got = tiers.fetch(keys[2:])
    assert got is not None and _equal(got, _pages(pool, list(range(2, 8))))
    assert disk.hits == 4 and tiers.stats["host"].hits >= 2


def test_disk_blocks_are_found_again_by_a_new_engine(tmp_path: Path) -> None:
    pool = _pool()
    keys = _keys(3)
    first = _tiers(tmp_path, disk=1 << 20)
    first.save(keys, _pages(pool, [7, 8, 9]))
    first.close()  # the folder is one engine's at a time
    again = _tiers(tmp_path, disk=1 << 20)
    got = again.fetch(keys)
    assert got is not None and _equal(got, _pages(pool, [7, 8, 9]))


def test_a_corrupt_disk_block_is_a_miss_and_is_removed(tmp_path: Path) -> None:
    pool = _pool()
    keys = _keys(3)
    tiers = _tiers(tmp_path, disk=1 << 20)
    tiers.save(keys, _pages(pool, [0, 1, 2]))
    victim = tiers.disk.file(keys[1]) if tiers.disk is not None else None
    assert victim is not None
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    got = tiers.fetch(keys)
    assert got is not None and got[0].num_pages == 1  # only the block before the corrupt one
    assert tiers.stats["disk"].errors == 1 and not victim.exists()


def test_a_full_disk_drops_blocks_without_raising(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DiskTier, "write", staticmethod(full))
    pool = _pool()
    tiers = _tiers(tmp_path, disk=1 << 20)
    keys = _keys(2)
    tiers.save(keys, _pages(pool, [0, 1]))
    disk = tiers.stats["disk"]
    assert disk.errors == 2 and disk.blocks == 0 and disk.bytes == 0
    assert [f.name for f in (tmp_path / "blocks").iterdir()] == [DiskTier.LOCK]  # no temporary file left behind
    assert tiers.fetch(keys) is None


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_disk_folder_is_private_and_one_engines(tmp_path: Path) -> None:
    """Created 0700 with 0600 blocks; a second engine on the folder is refused by name until the first closes."""
    pool = _pool()
    tiers = _tiers(tmp_path, disk=1 << 20)
    folder = tmp_path / "blocks"
    tiers.save(_keys(2), _pages(pool, [0, 1]))
    assert _mode(folder) == 0o700
    blocks = list(folder.glob("*.kvb"))
    assert len(blocks) == 2 and all(_mode(f) == 0o600 for f in blocks)
    with pytest.raises(CacheConfigError, match="disk_path .* is in use by another engine") as info:
        _tiers(tmp_path, disk=1 << 20)
    assert info.value.param == "kv_offload"
    tiers.close()
    again = _tiers(tmp_path, disk=1 << 20)
    assert again.stats["disk"].blocks == 2
    again.close()


def test_a_folder_of_another_user_or_open_to_others_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "blocks"
    folder.mkdir(mode=0o700)
    folder.chmod(0o777)
    with pytest.raises(CacheConfigError, match="disk_path .* may be written by other users"):
        _tiers(tmp_path, disk=1 << 20)
    folder.chmod(0o700)
    owner = folder.stat().st_uid
    monkeypatch.setattr(os, "geteuid", lambda: owner + 1)
    with pytest.raises(CacheConfigError, match=f"disk_path .* is owned by uid {owner}, not by this process's user"):
        _tiers(tmp_path, disk=1 << 20)


def test_a_planted_link_is_not_followed_and_stray_temporary_files_are_swept(tmp_path: Path) -> None:
    """A link at a block's temporary name (another user's trap, or a crashed writer's file) is never written
    through: the block is dropped and counted. Temporary files found at start are removed."""
    folder = tmp_path / "blocks"
    folder.mkdir(mode=0o700)
    stray = folder / ".0123.99.tmp"
    stray.write_bytes(b"half a block")
    tiers = _tiers(tmp_path, disk=1 << 20)
    assert not stray.exists()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    keys = _keys(1)
    (folder / f".{keys[0].hex()}.{os.getpid()}{DiskTier.TMP_SUFFIX}").symlink_to(victim)
    tiers.save(keys, _pages(_pool(), [0]))
    assert victim.read_bytes() == b"precious"
    assert tiers.stats["disk"].errors == 1 and tiers.stats["disk"].blocks == 0
    tiers.close()


def test_crashed_engines_folders_are_swept_and_live_ones_kept(tmp_path: Path) -> None:
    parent = tmp_path / "kv_blocks"
    live = DiskTier(parent / "live", 1 << 20, TierStats())
    crashed = parent / "crashed"  # its engine died holding the lock: the kernel dropped it
    crashed.mkdir()
    (crashed / DiskTier.LOCK).touch()
    (crashed / "ab.kvb").write_bytes(b"x")
    unlocked_old = parent / "old"  # died before it locked its folder
    unlocked_old.mkdir()
    os.utime(unlocked_old, (time.time() - 2 * ABANDONED_AFTER_S,) * 2)
    starting = parent / "starting"  # an engine between creating its folder and locking it
    starting.mkdir()
    assert sweep_abandoned(parent) == 2
    assert sorted(p.name for p in parent.iterdir()) == ["live", "starting"]
    live.close()
    assert sweep_abandoned(parent) == 1 and not (parent / "live").exists()


class _DeadStore:
    def holds(self, key: bytes) -> bool:
        return True  # its index says so; the calls fail

    def fetch(self, keys: Sequence[bytes]) -> list[BlockBytes]:
        raise ConnectionError("store gone")

    def put(self, items: Sequence[tuple[bytes, np.ndarray]]) -> StoreState:
        raise ConnectionError("store gone")

    def take_faults(self) -> int:
        return 0  # its calls fail instead


def test_a_dead_cluster_store_is_a_miss(tmp_path: Path) -> None:
    tiers = _tiers(tmp_path, store=_DeadStore())
    keys = _keys(2)
    tiers.save(keys, _pages(_pool(), [0, 1]))
    assert tiers.fetch(keys) is None
    assert tiers.stats["cluster"].errors == 2


def test_stats_are_plain_numbers() -> None:
    assert set(TierStats().to_dict()) >= {"lookups", "hits", "bytes_read", "bytes_written", "load_seconds", "errors"}


class _MemStore:
    """A ``BlockStore`` in this process: the cluster tier's protocol without Ray."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, np.ndarray] = {}
        self.faults = 0  # outages "seen" by its index thread (a real client's)

    def holds(self, key: bytes) -> bool:
        return key in self.blocks

    def fetch(self, keys: Sequence[bytes]) -> list[BlockBytes]:
        out = []
        for key in keys:
            if key not in self.blocks:
                break
            out.append(self.blocks[key])
        return out

    def put(self, items: Sequence[tuple[bytes, np.ndarray]]) -> StoreState:
        added = sum(len(d) for k, d in items if k not in self.blocks)
        self.blocks.update(items)
        return StoreState(added, len(self.blocks), sum(len(d) for d in self.blocks.values()))

    def take_faults(self) -> int:
        faults, self.faults = self.faults, 0
        return faults


def test_the_cluster_tier_serves_another_engine_and_refuses_a_corrupt_block(tmp_path: Path) -> None:
    store = _MemStore()
    pool = _pool()
    keys = _keys(3)
    _tiers(tmp_path, store=store).save(keys, _pages(pool, [4, 5, 6]))
    other = _tiers(tmp_path, store=store)  # another replica: nothing local
    got = other.fetch(keys)
    assert got is not None and _equal(got, _pages(pool, [4, 5, 6]))
    assert other.stats["cluster"].hits == 3 and other.stats["cluster"].errors == 0
    data = store.blocks[keys[2]].copy()
    data[-1] ^= 1
    store.blocks[keys[2]] = data
    third = _tiers(tmp_path, store=store)
    got = third.fetch(keys)
    assert got is not None and got[0].num_pages == 2 and third.stats["cluster"].errors == 1
    # An outage the client's index thread saw counts once, at the next lookup, even one that needs no call.
    store.faults = 1
    third.fetch(keys)
    assert third.stats["cluster"].errors == 3  # the corrupt block again, and the outage


def test_the_cluster_tier_counts_what_the_store_holds(tmp_path: Path) -> None:
    """``blocks``/``bytes`` (``kv_tier_blocks``/``kv_tier_bytes``) are what the store holds after the last put,
    and ``bytes_written`` only what it took: saving blocks it holds already adds nothing."""
    store = _MemStore()
    tiers = _tiers(tmp_path, store=store)
    keys = _keys(3)
    pool = _pool()
    tiers.save(keys, _pages(pool, [0, 1, 2]))
    tiers.save(keys, _pages(pool, [0, 1, 2]))  # another replica's copy of the same prefix, say
    held = sum(len(d) for d in store.blocks.values())
    cluster = tiers.stats["cluster"]
    assert (cluster.blocks, cluster.bytes, cluster.bytes_written) == (3, held, held)


class _OutageStore(_DeadStore):
    """A dead store whose client also saw an outage before each lookup, and whose ``take_faults`` waits on its
    lock long enough for another thread to run (as a real client's may)."""

    def take_faults(self) -> int:
        time.sleep(0)  # gives up the GIL: the save thread counts its failed write meanwhile
        return 1


def test_counters_lose_no_update_across_threads(tmp_path: Path) -> None:
    """The load and save threads both count faults of one store: none is lost."""
    tiers = _tiers(tmp_path, store=_OutageStore())
    keys, payload = _keys(1), _pages(_pool(), [0])
    rounds = 300
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as it can: a lost update shows at once

    def work(i: int) -> None:
        for _ in range(rounds):
            if i % 2:
                tiers.save(keys, payload)  # a failed write: one error
            else:
                tiers.fetch(keys)  # an outage taken, then a failed read: two

    try:
        workers = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        sys.setswitchinterval(switch)
    assert tiers.stats["cluster"].errors == 2 * rounds * 2 + 2 * rounds
