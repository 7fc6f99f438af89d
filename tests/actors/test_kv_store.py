"""The cluster KV tier on a real local Ray cluster: an engine that never saw a prompt starts from the blocks
another engine stored; a killed store actor ends in recompute with the same tokens and every page free, and the
next save starts a fresh store."""

from __future__ import annotations

from pathlib import Path

import ray

from actors.kv_store import NAMESPACE, store_name
from apps.llm import LLM
from tests.actors.checkpoints import write_llama_with_tokenizer
from tests.actors.test_kv_offload import (
    ENGINE,
    PROMPTS,
    _assert_all_free,
    _cached,
    _evict_all,
    _generate,
    _tier,
)

CLUSTER = {"cluster": True, "load_wait_s": 30.0}  # a busy CI box: a load never times out into a recompute here


def _store_stats() -> dict[str, int]:
    store = ray.get_actor(store_name(ray.get_runtime_context().get_node_id()), namespace=NAMESPACE)
    return ray.get(store.stats.remote(), timeout=60)


def test_engines_share_blocks_through_the_cluster_store(ray_cluster: None, tmp_path: Path) -> None:
    model = str(write_llama_with_tokenizer(tmp_path / "model"))
    reference = _generate(LLM(model=model, **ENGINE), PROMPTS)

    first = LLM(model=model, kv_offload=CLUSTER, **ENGINE)
    assert _generate(first, PROMPTS) == reference
    assert first.engine.offload is not None
    first.engine.offload.wait_for_saves()
    held = _store_stats()
    assert held["blocks"] > 0 and held["bytes"] <= held["max_bytes"]
    assert _tier(first.engine, "cluster")["errors"] == 0
    first.shutdown()

    # A new engine (a replica autoscaling just added) starts warm.
    second = LLM(model=model, kv_offload=CLUSTER, **ENGINE)
    tokens, cached = _cached(second, PROMPTS)
    assert tokens == reference
    assert cached == [(len(p) - 1) // 16 * 16 for p in PROMPTS]
    assert _tier(second.engine, "cluster")["hits"] == sum(cached) // 16
    _assert_all_free(second.engine)

    # The store dies under it: the engine recomputes, same tokens, every page free, the fault counted.
    store = ray.get_actor(store_name(ray.get_runtime_context().get_node_id()), namespace=NAMESPACE)
    ray.kill(store, no_restart=True)
    _evict_all(second.engine)
    hits_before = _tier(second.engine, "cluster")["hits"]
    tokens, cached = _cached(second, PROMPTS)
    # No block comes from the dead store: every lookup that reaches it is a miss and a counted error. (Which
    # request computes the shared head first, and so which ones reuse it from the radix cache, depends on when
    # each lookup ends; no order is assumed.)
    assert tokens == reference
    assert _tier(second.engine, "cluster")["hits"] == hits_before
    assert _tier(second.engine, "cluster")["errors"] >= 1
    _assert_all_free(second.engine)
    # Its saves of the recomputed pages start a fresh store on the node, from which a new engine starts warm.
    assert second.engine.offload is not None
    second.engine.offload.wait_for_saves()
    second.shutdown()
    third = LLM(model=model, kv_offload=CLUSTER, **ENGINE)
    tokens, cached = _cached(third, PROMPTS)
    assert tokens == reference and sum(cached) > 0
    _assert_all_free(third.engine)
    third.shutdown()


def test_two_shards_save_and_load_their_own_heads(ray_cluster: None, tmp_path: Path) -> None:
    """With tensor_parallel_size 2 each rank copies out and loads back its own share of the KV heads (blocks
    hold both ranks' halves): evicted pages come back from host memory with the same greedy tokens."""
    model = str(write_llama_with_tokenizer(tmp_path / "model"))
    reference = _generate(LLM(model=model, **ENGINE), PROMPTS)
    llm = LLM(model=model, tensor_parallel_size=2, executor="ray", kv_offload={"host_bytes": 1 << 26}, **ENGINE)
    assert _generate(llm, PROMPTS) == reference
    _evict_all(llm.engine)
    tokens, cached = _cached(llm, PROMPTS)
    assert tokens == reference and cached == [(len(p) - 1) // 16 * 16 for p in PROMPTS]
    _assert_all_free(llm.engine)
    llm.shutdown()
