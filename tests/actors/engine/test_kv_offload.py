"""KV tiers in an engine: pages evicted from the pool come back from host memory or disk with the same greedy
tokens, and every fault (a corrupt block, a full disk, a block of another model or dtype) ends in recompute with
the same tokens and every page free."""

from __future__ import annotations

import asyncio
import errno
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import ray

from actors.api import SequenceDelta
from actors.config import EngineConfig, scoped_to_app
from actors.engine import kv_tiers
from actors.engine.llm_engine import LLMEngine
from actors.kv_store import app_of, store_name, store_scope
from actors.scheduler.step_loop import StepLoop
from apps.llm import LLM
from kvcache.errors import CacheConfigError
from kvcache.kv_tiers import DiskTier
from scheduling.errors import InvalidParameterError
from scheduling.sampling_params import SamplingParams
from tests.actors.checkpoints import write_llama_with_tokenizer

ENGINE: dict[str, Any] = {"max_model_len": 256, "max_num_seqs": 8, "max_num_batched_tokens": 64,
                          "dtype": "float32", "device": "cpu", "num_kv_pages": 64}  # fmt: skip
# Shared 40-token heads (several full pages of 16), then per-prompt tails: chunked prefills.
PROMPTS = [[7 + (j * 5) % 190 for j in range(40)] + [9 + (i * 11 + j * 3) % 180 for j in range(20 + 17 * i)]
           for i in range(4)]  # fmt: skip
# One page's KV in the test model: 2 layers' k and v, 16 tokens of 2 heads of 16 floats.
PAGE_BYTES = 2 * 2 * 16 * 2 * 16 * 4
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama_with_tokenizer(tmp_path_factory.mktemp("kv_tiers"))


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[list[int]]:
    """Greedy tokens of every prompt without tiers."""
    return _generate(LLM(model=str(model_dir), **ENGINE), PROMPTS)


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _evict_all(engine: LLMEngine) -> None:
    cache = engine.policy.cache
    assert cache is not None
    cache.reset()
    assert engine.allocator.num_free_pages == engine.allocator.num_pages


def _assert_all_free(engine: LLMEngine) -> None:
    cache = engine.policy.cache
    assert cache is not None and not engine.has_unfinished and cache.num_locked_pages == 0
    assert len(engine.policy.kv.saves) == 0
    assert engine.allocator.num_free_pages + cache.num_evictable_pages == engine.allocator.num_pages
    cache.check_integrity()


def _tier(engine: LLMEngine, name: str) -> dict[str, float]:
    assert engine.kv_tiers is not None
    return engine.kv_tiers.tiers.stats[name].to_dict()


def _cached(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs]


@pytest.mark.parametrize("offload", [
    {"host_bytes": 1 << 24},
    {"disk_bytes": 1 << 24},
    {"host_bytes": 3 * 16 * 4096, "disk_bytes": 1 << 24},  # three pages in memory, the rest spilled to disk
], ids=["host", "disk", "host+disk"])  # fmt: skip
def test_evicted_pages_come_back_with_the_same_tokens(
    model_dir: Path, reference: list[list[int]], offload: dict[str, int], tmp_path: Path
) -> None:
    if "disk_bytes" in offload:
        offload = {**offload, "disk_path": str(tmp_path / "blocks")}
    llm = LLM(model=str(model_dir), kv_offload=offload, **ENGINE)
    engine = llm.engine
    assert _generate(llm, PROMPTS) == reference
    _evict_all(engine)
    tokens, cached = _cached(llm, PROMPTS)
    assert tokens == reference
    # Every full page of each prompt but the one holding its last token came from a tier.
    assert cached == [(len(p) - 1) // 16 * 16 for p in PROMPTS]
    assert engine.policy.stats.tier_hit_tokens == sum(cached)
    hits = sum(_tier(engine, t)["hits"] for t in ("host", "disk"))
    assert hits == sum(cached) // 16
    _assert_all_free(engine)
    llm.shutdown()


def test_a_pool_under_pressure_reloads_what_it_evicted(model_dir: Path, reference: list[list[int]]) -> None:
    """A pool of 24 pages cannot keep four conversations: each new one evicts the last's pages, which the
    host tier brings back when the conversation returns."""
    engine = {**ENGINE, "num_kv_pages": 24, "max_model_len": 128, "max_num_seqs": 2}
    llm_off = LLM(model=str(model_dir), **engine)
    llm_on = LLM(model=str(model_dir), kv_offload={"host_bytes": 1 << 24}, **engine)
    prompts = [[3 + (i * 37 + j * 13) % 190 for j in range(100)] for i in range(4)]  # 7 pages each, none shared
    for _ in range(2):  # round two finds round one's pages gone from the pool
        off, off_cached = _cached(llm_off, prompts)
        on, on_cached = _cached(llm_on, prompts)
        assert on == off
    assert sum(on_cached) > sum(off_cached)
    assert llm_on.engine.policy.stats.tier_hit_tokens > 0
    _assert_all_free(llm_on.engine)
    llm_on.shutdown()
    llm_off.shutdown()


def _corrupt_every_block(folder: Path) -> int:
    files = list(folder.glob("*.kvb"))
    for f in files:
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x5A
        f.write_bytes(bytes(data))
    return len(files)


def test_corrupt_disk_blocks_are_recomputed(model_dir: Path, reference: list[list[int]], tmp_path: Path) -> None:
    folder = tmp_path / "blocks"
    llm = LLM(model=str(model_dir), kv_offload={"disk_bytes": 1 << 24, "disk_path": str(folder)}, **ENGINE)
    assert _generate(llm, PROMPTS) == reference
    assert llm.engine.kv_tiers is not None
    llm.engine.kv_tiers.wait_for_saves()
    assert _corrupt_every_block(folder) > 0
    _evict_all(llm.engine)
    tokens, cached = _cached(llm, PROMPTS)
    assert tokens == reference and cached == [0] * len(PROMPTS)
    assert _tier(llm.engine, "disk")["errors"] >= 1
    _assert_all_free(llm.engine)
    llm.shutdown()


def test_a_full_disk_ends_in_recompute(
    model_dir: Path, reference: list[list[int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DiskTier, "write", staticmethod(full))
    folder = tmp_path / "blocks"
    llm = LLM(model=str(model_dir), kv_offload={"disk_bytes": 1 << 24, "disk_path": str(folder)}, **ENGINE)
    assert _generate(llm, PROMPTS) == reference
    assert llm.engine.kv_tiers is not None
    llm.engine.kv_tiers.wait_for_saves()
    _evict_all(llm.engine)
    tokens, cached = _cached(llm, PROMPTS)
    assert tokens == reference and cached == [0] * len(PROMPTS)
    disk = _tier(llm.engine, "disk")
    assert disk["errors"] > 0 and disk["bytes"] == 0 and [f.name for f in folder.iterdir()] == [DiskTier.LOCK]
    _assert_all_free(llm.engine)
    llm.shutdown()


def test_blocks_of_another_dtype_or_model_are_never_used(
    model_dir: Path, reference: list[list[int]], tmp_path: Path
) -> None:
    """A bfloat16 engine fills the disk folder first; the float32 engine sharing it finds none of its blocks
    under its own keys, and a bfloat16 block renamed to a float32 key is refused by its header."""
    folder = tmp_path / "blocks"
    offload = {"disk_bytes": 1 << 24, "disk_path": str(folder)}
    other = LLM(model=str(model_dir), kv_offload=offload, **{**ENGINE, "dtype": "bfloat16"})
    _generate(other, PROMPTS)
    assert other.engine.kv_tiers is not None
    other.engine.kv_tiers.wait_for_saves()
    foreign = sorted(folder.glob("*.kvb"))
    assert foreign
    other.shutdown()

    llm = LLM(model=str(model_dir), kv_offload=offload, **ENGINE)
    offload_engine = llm.engine.kv_tiers
    assert offload_engine is not None
    # Forge: the float32 engine's keys for PROMPTS[0], each filed with a bfloat16 block's bytes.
    keys = offload_engine.keys_for(None, PROMPTS[0])
    for key, src in zip(keys, foreign, strict=False):
        (folder / f"{key.hex()}.kvb").write_bytes(src.read_bytes())
    llm.shutdown()  # one engine per folder
    llm2 = LLM(model=str(model_dir), kv_offload=offload, **ENGINE)  # indexes the folder as it is now
    tokens, cached = _cached(llm2, PROMPTS)
    assert tokens == reference and cached == [0] * len(PROMPTS)
    assert _tier(llm2.engine, "disk")["errors"] >= 1
    _assert_all_free(llm2.engine)
    llm2.shutdown()


def test_kv_offload_is_refused_where_it_cannot_work(model_dir: Path) -> None:
    with pytest.raises(InvalidParameterError, match="enable_prefix_caching") as info:
        LLM(model=str(model_dir), kv_offload={"host_bytes": 1 << 20}, enable_prefix_caching=False, **ENGINE)
    assert info.value.param == "kv_offload"
    with pytest.raises(InvalidParameterError, match="every tier is off"):
        LLM(model=str(model_dir), kv_offload={}, **ENGINE)


def test_the_cluster_tier_outside_ray_is_refused(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a Ray cluster to hold the store, the cluster tier is an error naming it, not a tier dropped."""
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="kv_offload.cluster needs Ray"):
        LLM(model=str(model_dir), kv_offload={"cluster": True}, **ENGINE)


def test_pending_saves_are_bounded_by_bytes(model_dir: Path, reference: list[list[int]]) -> None:
    """With the saver stuck (a slow disk or store), the pages handed over wait within ``save_queue_bytes``; the
    rest are dropped and counted, the steps go on, and once the saver runs it files only what was kept."""
    llm = LLM(model=str(model_dir), kv_offload={"host_bytes": 1 << 24, "save_queue_bytes": 3 * PAGE_BYTES}, **ENGINE)
    offload = llm.engine.kv_tiers
    assert offload is not None
    layout = llm.engine.executor.kv_layout
    assert 2 * layout.num_layers * layout.page_size * layout.num_kv_heads * layout.head_dim * 4 == PAGE_BYTES
    gate = threading.Event()
    offload._saver.submit(lambda: gate.wait(60))  # the saver is busy until the gate opens
    assert _generate(llm, PROMPTS) == reference  # never blocked by the stuck saver
    assert offload.dropped_saves > 0
    assert offload._pending_bytes <= 3 * PAGE_BYTES
    gate.set()
    offload.wait_for_saves()
    assert offload._pending_bytes == 0
    assert 0 < _tier(llm.engine, "host")["blocks"] <= 3
    _assert_all_free(llm.engine)
    llm.shutdown()


def test_an_engine_folder_is_its_own_and_crashed_ones_are_swept(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second engine on a given folder is refused by name; an engine's default folder sweeps the folders of
    engines that crashed (their locks are free) and is gone once it stops."""
    folder = tmp_path / "blocks"
    given = {"disk_bytes": 1 << 24, "disk_path": str(folder)}
    first = LLM(model=str(model_dir), kv_offload=given, **ENGINE)
    with pytest.raises(CacheConfigError, match="is in use by another engine") as info:
        LLM(model=str(model_dir), kv_offload=given, **ENGINE)
    assert info.value.param == "kv_offload"
    first.shutdown()

    monkeypatch.setattr(kv_tiers, "cache_dir", lambda: tmp_path / "cache")
    crashed = tmp_path / "cache" / "kv_blocks" / "0123456789ab"
    crashed.mkdir(parents=True)
    (crashed / DiskTier.LOCK).touch()
    (crashed / "ab.kvb").write_bytes(b"a crashed replica's block")
    llm = LLM(model=str(model_dir), kv_offload={"disk_bytes": 1 << 24}, **ENGINE)
    assert llm.engine.kv_tiers is not None
    own = llm.engine.kv_tiers._own_disk
    assert own is not None and not crashed.exists()
    assert list((tmp_path / "cache" / "kv_blocks").iterdir()) == [own]
    llm.shutdown()
    assert not own.exists()


def test_an_idle_loop_releases_a_load_that_never_ends(model_dir: Path, reference: list[list[int]]) -> None:
    """On an idle replica (the step loop asleep, nothing else to run) a load that never answers holds its
    request no longer than ``load_wait_s``: it then computes its prefix, with the same tokens."""
    llm = LLM(model=str(model_dir), kv_offload={"host_bytes": 1 << 24, "load_wait_s": 0.2}, **ENGINE)
    engine, offload = llm.engine, llm.engine.kv_tiers
    assert offload is not None
    assert _generate(llm, PROMPTS[:1]) == reference[:1]
    offload.wait_for_saves()
    _evict_all(engine)
    gate = threading.Event()
    real_fetch = offload.tiers.fetch
    offload.tiers.fetch = lambda keys: (gate.wait(60), real_fetch(keys))[1]  # type: ignore[method-assign]
    deltas: list[SequenceDelta] = []

    async def serve_one() -> None:
        with ThreadPoolExecutor(1) as thread:
            loop = StepLoop(engine, thread, deltas.extend, lambda: None)
            loop.start()
            async with loop.lock:
                engine.add_request("r", PROMPTS[0], GREEDY)
            loop.wake()
            deadline = time.monotonic() + 20.0  # a load held to 60 s would pass it
            delay = 0.01
            while not any(d.finish_reason for d in deltas) and time.monotonic() < deadline:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)
            loop.stop()
            loop.wake()
            await loop.wait_stopped(10.0)

    try:
        asyncio.run(serve_one())
    finally:
        gate.set()
    assert [t for d in deltas for t in d.token_ids] == reference[0]
    assert offload.load_timeouts == 1
    _assert_all_free(engine)
    llm.shutdown()


def test_a_serve_replica_scopes_the_cluster_tier_to_its_app() -> None:
    """``LLMServer`` and ``PrefillServer`` pass their app's name: the stores are that app's (``flotilla kv drop``)."""
    cluster = EngineConfig.from_kwargs(model="tiny", kv_offload={"cluster": True})
    offload = scoped_to_app(cluster, "chat").kv_offload
    assert offload is not None and offload.cluster_app == "chat"
    named = EngineConfig.from_kwargs(model="tiny", kv_offload={"cluster": True, "cluster_app": "mine"})
    assert scoped_to_app(named, "chat") == named  # the user's choice stands
    host = EngineConfig.from_kwargs(model="tiny", kv_offload={"host_bytes": 1})
    assert scoped_to_app(host, "chat") == host  # no cluster tier: nothing to scope
    assert store_scope("chat", "m") != store_scope("chat", "m2") != store_scope("other", "m2")
    assert app_of(store_name(store_scope("a/b", "m"), "node")) == "a/b"
