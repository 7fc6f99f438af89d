"""KV tiers in an engine: pages evicted from the pool come back from host memory or disk with the same greedy
tokens, and every fault (a corrupt block, a full disk, a block of another model or dtype) ends in recompute with
the same tokens and every page free."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest
import ray

from actors.engine.llm_engine import LLMEngine
from apps.llm import LLM
from kvcache.kv_tiers import DiskTier
from scheduling.errors import InvalidParameterError
from scheduling.sampling_params import SamplingParams
from tests.actors.checkpoints import write_llama_with_tokenizer

ENGINE: dict[str, Any] = {"max_model_len": 256, "max_num_seqs": 8, "max_num_batched_tokens": 64,
                          "dtype": "float32", "device": "cpu", "num_kv_pages": 64}  # fmt: skip
# Shared 40-token heads (several full pages of 16), then per-prompt tails: chunked prefills.
PROMPTS = [[7 + (j * 5) % 190 for j in range(40)] + [9 + (i * 11 + j * 3) % 180 for j in range(20 + 17 * i)]
           for i in range(4)]  # fmt: skip
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
    cache = engine.scheduler.cache
    assert cache is not None
    cache.reset()
    assert engine.allocator.num_free_pages == engine.allocator.num_pages


def _assert_all_free(engine: LLMEngine) -> None:
    cache = engine.scheduler.cache
    assert cache is not None and not engine.has_unfinished and cache.num_locked_pages == 0
    assert len(engine.scheduler.kv.saves) == 0
    assert engine.allocator.num_free_pages + cache.num_evictable_pages == engine.allocator.num_pages
    cache.check_integrity()


def _tier(engine: LLMEngine, name: str) -> dict[str, float]:
    assert engine.offload is not None
    return engine.offload.tiers.stats[name].to_dict()


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
    assert engine.scheduler.stats.tier_hit_tokens == sum(cached)
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
    assert llm_on.engine.scheduler.stats.tier_hit_tokens > 0
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
    assert llm.engine.offload is not None
    llm.engine.offload.wait_for_saves()
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
    assert llm.engine.offload is not None
    llm.engine.offload.wait_for_saves()
    _evict_all(llm.engine)
    tokens, cached = _cached(llm, PROMPTS)
    assert tokens == reference and cached == [0] * len(PROMPTS)
    disk = _tier(llm.engine, "disk")
    assert disk["errors"] > 0 and disk["bytes"] == 0 and not list(folder.iterdir())
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
    assert other.engine.offload is not None
    other.engine.offload.wait_for_saves()
    foreign = sorted(folder.glob("*.kvb"))
    assert foreign
    other.shutdown()

    llm = LLM(model=str(model_dir), kv_offload=offload, **ENGINE)
    offload_engine = llm.engine.offload
    assert offload_engine is not None
    # Forge: the float32 engine's keys for PROMPTS[0], each filed with a bfloat16 block's bytes.
    keys = offload_engine.keys_for(None, PROMPTS[0])
    for key, src in zip(keys, foreign, strict=False):
        (folder / f"{key.hex()}.kvb").write_bytes(src.read_bytes())
    llm2 = LLM(model=str(model_dir), kv_offload=offload, **ENGINE)  # indexes the folder as it is now
    llm.shutdown()
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
