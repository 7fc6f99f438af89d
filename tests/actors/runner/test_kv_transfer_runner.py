"""KV export/import through the model runner and executors: a decode runner fed another runner's
prompt KV continues exactly as the prefill runner would have, at tensor_parallel_size 1 and 2.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from actors.config import EngineConfig
from actors.engine.executor import Executor, LocalExecutor, with_rank_exports
from actors.errors import ExecutorFailure
from actors.remote.ray_executor import RayExecutor
from actors.remote.shard_actor import ModelShardActor
from kvcache.kv_transfer import KVPayload, KVPayloadMismatchError
from scheduling.batch import Batch, BatchKVMoves, StepOutput
from scheduling.sampling_params import SamplingParams

pytestmark = pytest.mark.ray  # on the session's shared cluster: run with the other Ray modules, last (tests/conftest.py)

GREEDY = SamplingParams(temperature=0.0, logprobs=5).sampler_view()
PROMPT = [(7 * i + 3) % 250 + 3 for i in range(37)]  # 3 pages of 16, the last one partly full
NUM_DECODE = 4
ENGINE: dict[str, Any] = {"max_model_len": 128, "max_num_seqs": 4, "max_num_batched_tokens": 256,
                          "num_kv_pages": 24, "dtype": "float32", "device": "cpu"}


def _batch(step: int, seqs: list[tuple[list[int], int, list[int]]], kv: BatchKVMoves | None = None) -> Batch:
    """Every sequence ``(new_tokens, num_computed, pages)`` samples its last token greedily."""
    return Batch(
        step=step,
        input_ids=[t for toks, _, _ in seqs for t in toks],
        positions=[n + i for toks, n, _ in seqs for i in range(len(toks))],
        query_lens=[len(toks) for toks, _, _ in seqs],
        context_lens=[n + len(toks) for toks, n, _ in seqs],
        page_tables=[pages for _, _, pages in seqs],
        sample_indices=list(range(len(seqs))),
        sampling_params=[GREEDY] * len(seqs),
        num_output_tokens=[0] * len(seqs),
        prompt_token_ids=[None] * len(seqs),
        output_token_ids=[None] * len(seqs),
        kv_moves=kv or BatchKVMoves(),
    )


def _prefill(executor: Executor, pages: list[int]) -> tuple[int, tuple[KVPayload, ...]]:
    """Prompt through ``executor`` at ``pages``, exporting them: the first token and every rank's payload."""
    out = executor.execute(_batch(0, [(PROMPT, 0, pages)], BatchKVMoves(exports=[(0, pages)])))
    assert out.kv_exports is not None and len(out.kv_exports) == 1
    payloads = out.kv_exports[0]
    assert isinstance(payloads, tuple) and all(isinstance(p, KVPayload) for p in payloads)
    return out.token_ids[0], payloads


def _decode(executor: Executor, first: int, pages: list[int], imported: tuple[KVPayload, ...] | None) -> list[StepOutput]:
    """``NUM_DECODE`` greedy steps after the prompt; the first step imports ``imported`` into ``pages``."""
    outs, token = [], first
    for i in range(NUM_DECODE):
        kv = BatchKVMoves(imports=[(pages, imported)]) if i == 0 and imported is not None else None
        out = executor.execute(_batch(1 + i, [([token], len(PROMPT) + i, pages)], kv))
        assert out.kv_exports is None
        outs.append(out)
        token = out.token_ids[0]
    return outs


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_imported_prompt_decodes_like_the_prefill_runner(llama_dir: Path, kv_cache_dtype: str) -> None:
    config = EngineConfig(model=str(llama_dir), kv_cache_dtype=kv_cache_dtype, **ENGINE)
    prefill, decode = LocalExecutor(config), LocalExecutor(config)
    first, payloads = _prefill(prefill, [0, 1, 2])
    assert len(payloads) == 1 and payloads[0].num_pages == 3 and payloads[0].kv_dtype == kv_cache_dtype
    expected = _decode(prefill, first, [0, 1, 2], None)  # the prefill runner continuing itself

    # Other page ids, out of order, in a pool whose other pages hold stale data.
    got = _decode(decode, first, [9, 4, 17], payloads)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.logprobs for o in got] == [o.logprobs for o in expected]  # bit for bit
    for layer in range(decode.runner.pool.num_layers):
        assert torch.equal(decode.runner.pool.k_caches[layer][[9, 4, 17]], prefill.runner.pool.k_caches[layer][[0, 1, 2]])

    # Without the import the same step sees no prompt: the check above is not vacuous.
    blind = LocalExecutor(config)
    assert [o.logprobs for o in _decode(blind, first, [9, 4, 17], None)] != [o.logprobs for o in expected]


def test_import_beside_a_prefill_and_an_export_in_one_step(llama_dir: Path) -> None:
    """A mixed step: one sequence imports and decodes, another prefills and exports."""
    config = EngineConfig(model=str(llama_dir), **ENGINE)
    prefill, decode = LocalExecutor(config), LocalExecutor(config)
    first, payloads = _prefill(prefill, [0, 1, 2])
    expected = prefill.execute(_batch(1, [([first], len(PROMPT), [0, 1, 2])]))
    other = PROMPT[::-1]
    out = decode.execute(_batch(
        1, [(other, 0, [5, 6, 7]), ([first], len(PROMPT), [10, 11, 12])],
        BatchKVMoves(imports=[([10, 11, 12], payloads)], exports=[(0, [5, 6, 7])]),
    ))
    got, want = out.logprobs[1], expected.logprobs[0]
    assert out.token_ids[1] == expected.token_ids[0]
    assert got is not None and want is not None and got.top_token_ids == want.top_token_ids
    # Batched with a prefill the matmuls change shape: equal up to float32 rounding.
    assert got.top_logprobs == pytest.approx(want.top_logprobs, abs=1e-5)
    assert out.kv_exports is not None and len(out.kv_exports) == 1
    exported = out.kv_exports[0][0]
    for layer in range(exported.num_layers):
        assert torch.equal(exported.k[layer], decode.runner.pool.k_caches[layer][[5, 6, 7]])


def test_runner_refuses_payloads_of_another_layout(llama_dir: Path) -> None:
    int8 = LocalExecutor(EngineConfig(model=str(llama_dir), kv_cache_dtype="int8", **ENGINE))
    auto = LocalExecutor(EngineConfig(model=str(llama_dir), **ENGINE))
    first, payloads = _prefill(int8, [0, 1, 2])
    with pytest.raises(KVPayloadMismatchError, match="'int8' but this pool stores 'auto'") as info:
        _decode(auto, first, [3, 4, 5], payloads)
    assert info.value.param == "kv_cache_dtype"
    _, auto_payloads = _prefill(auto, [0, 1, 2])
    with pytest.raises(KVPayloadMismatchError, match="from 2 rank") as info:
        _decode(auto, first, [3, 4, 5], auto_payloads * 2)
    assert info.value.param == "tensor_parallel_size"


def _payload(value: float) -> KVPayload:
    page = torch.full((1, 2, 1, 4), value)
    return KVPayload((page,), (page,), None, None, "auto", "float32")


def test_rank_exports_are_zipped_in_rank_order() -> None:
    a0, b0, a1, b1 = (_payload(v) for v in range(4))
    rank0 = StepOutput([5], [None], kv_exports=[a0, b0])
    rank1 = StepOutput([], [], kv_exports=[a1, b1])
    merged = with_rank_exports(rank0, [rank0, rank1])
    assert merged.kv_exports == [(a0, a1), (b0, b1)]
    assert merged.token_ids == [5]
    with pytest.raises(AssertionError, match="rank 1"):
        with_rank_exports(rank0, [rank0, None])


class _FakeRunner:
    def execute(self, batch: Batch) -> StepOutput:
        return StepOutput([], [], kv_exports=["payload"] if batch.kv_moves.exports else None)


def test_shard_other_than_rank0_returns_only_steps_with_exports() -> None:
    shard = ModelShardActor(EngineConfig(**ENGINE), rank=1, world_size=2)
    shard._runner = _FakeRunner()  # type: ignore[assignment]
    assert shard.execute(_batch(0, [(PROMPT, 0, [0, 1, 2])])) is None
    out = shard.execute(_batch(0, [(PROMPT, 0, [0, 1, 2])], BatchKVMoves(exports=[(0, [0, 1, 2])])))
    assert out is not None and out.kv_exports == ["payload"]


def test_tp2_exports_every_rank_and_imports_its_own_share(ray_cluster: None, llama_dir: Path) -> None:
    """llama's 2 KV heads split 1 per rank: each rank exports its head; both import theirs."""
    local = LocalExecutor(EngineConfig(model=str(llama_dir), **ENGINE))
    _, whole = _prefill(local, [0, 1, 2])
    tp2 = RayExecutor(EngineConfig(model=str(llama_dir), tensor_parallel_size=2, executor="ray", **ENGINE))
    try:
        first, payloads = _prefill(tp2, [0, 1, 2])
        assert len(payloads) == 2 and [p.page_shape[1] for p in payloads] == [1, 1]
        for layer in range(whole[0].num_layers):  # rank r holds head r of the whole
            joined = torch.cat([p.k[layer] for p in payloads], dim=2)
            assert torch.allclose(joined, whole[0].k[layer], atol=1e-5)
        expected = _decode(tp2, first, [0, 1, 2], None)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            via_store = ray.get(ray.put(payloads))  # through the object store, as between replicas
        got = _decode(tp2, first, [20, 13, 8], via_store)  # the same group, fresh pages
        assert [o.token_ids for o in got] == [o.token_ids for o in expected]
        assert [o.logprobs for o in got] == [o.logprobs for o in expected]
        # Whole-model pages (2 heads) into ranks holding 1 head each: refused (and the group goes down).
        with pytest.raises(ExecutorFailure, match="tensor_parallel_size: the KV pages hold 2 kv heads per rank"):
            _decode(tp2, first, [3, 4, 5], whole * 2)
    finally:
        tp2.shutdown()
