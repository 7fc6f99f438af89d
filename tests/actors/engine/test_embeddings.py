"""Embedding requests through the engine's prefill, against Hugging Face transformers as the oracle.

The oracle: the seeded tiny Llama's ``hidden_states[-1]`` (the decoder's output
after its final norm) pooled in float32, last token or mean, L2-normalised or
not. Every case also checks what an embedding leaves behind: no KV page, in
the pool or the prefix cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from actors.config import EngineConfig
from apps.llm import LLM
from scheduling.batch import Batch, StepOutput
from scheduling.errors import InvalidParameterError
from scheduling.pooling import DEFAULT_POOLING, Pooling
from scheduling.sampling_params import SamplingParams
from scheduling.structured_output import StructuredOutput
from tests.actors.checkpoints import (
    build_hf_model,
    hf_greedy,
    llama_config,
    write_llama_with_tokenizer,
)
from tests.kvcache import flashinfer_emulator

TOL = 1e-5
ENGINE: dict[str, Any] = {"max_model_len": 128, "max_num_seqs": 8, "max_num_batched_tokens": 128,
                          "num_kv_pages": 64, "dtype": "float32", "device": "cpu"}
# Eight texts of different lengths (the byte-level tokenizer: about one token a character).
TEXTS = [
    "hi", "an embedding", "the quick brown fox", "jumps over the lazy dog, twice",
    "pooled hidden states of a decoder model", "a", "Embeddings through the engine's prefill path, chunked",
    "0123456789 " * 6,
]
POOLINGS = {"last": Pooling("last"), "mean": Pooling("mean"), "mean_raw": Pooling("mean", normalize=False)}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PreTrainedModel]:
    """The seeded tiny Llama as an engine folder (with the byte-level tokenizer), and the same weights in HF."""
    return write_llama_with_tokenizer(tmp_path_factory.mktemp("embed_llama"), seed=0), build_hf_model(llama_config(), 0)


@pytest.fixture(scope="module")
def llm(llama: tuple[Path, PreTrainedModel]) -> Iterator[LLM]:
    engine = LLM(str(llama[0]), **ENGINE)
    yield engine
    engine.shutdown()


def hf_embedding(hf: PreTrainedModel, ids: list[int], pooling: Pooling) -> torch.Tensor:
    """The oracle: HF's final hidden states of ``ids``, pooled in float32."""
    with torch.inference_mode():
        hidden = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].float()
    vector = hidden[-1] if pooling.mode == "last" else hidden.mean(0)
    return F.normalize(vector, dim=0) if pooling.normalize else vector


def max_error(got: list[float], want: torch.Tensor) -> float:
    assert len(got) == want.numel()
    return float((torch.tensor(got, dtype=torch.float32) - want).abs().max())


def assert_no_kv_left(llm: LLM) -> None:
    """Nothing running, no page held by a request, and none in the prefix cache."""
    engine = llm.engine
    assert not engine.has_unfinished and len(engine.embeddings) == 0
    cache = engine.policy.cache
    assert cache is None or cache.num_cached_pages == 0
    engine.allocator.check_integrity()
    assert engine.allocator.num_free_pages == engine.allocator.num_pages


def record_batches(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[Batch]:
    """Every ``Batch`` the engine runs from now on (the executor is wrapped, not replaced)."""
    batches: list[Batch] = []
    execute = llm.engine.executor.execute

    def spy(batch: Batch) -> StepOutput:
        batches.append(batch)
        return execute(batch)

    monkeypatch.setattr(llm.engine.executor, "execute", spy)
    return batches


@pytest.mark.parametrize("name", list(POOLINGS))
def test_embed_matches_hf_batched_and_one_by_one(llm: LLM, llama: tuple[Path, PreTrainedModel], name: str) -> None:
    pooling, hf = POOLINGS[name], llama[1]
    want = [hf_embedding(hf, llm.engine.tokenize(t), pooling) for t in TEXTS]
    batched = llm.embed(TEXTS, pooling=pooling, use_tqdm=False)
    one_by_one = [llm.embed(t, pooling=pooling, use_tqdm=False)[0] for t in TEXTS]
    for got in (batched, one_by_one):
        assert len(got) == len(TEXTS)
        assert max(max_error(g, w) for g, w in zip(got, want, strict=True)) < TOL
    if pooling.normalize:
        assert all(abs(float(torch.tensor(v).norm()) - 1.0) < TOL for v in batched)
    else:
        assert any(abs(float(torch.tensor(v).norm()) - 1.0) > 0.1 for v in batched)  # really unnormalised
    assert_no_kv_left(llm)


def test_embed_defaults_to_the_engine_configs_pooling(llama: tuple[Path, PreTrainedModel]) -> None:
    folder, hf = llama
    assert EngineConfig().pooling == DEFAULT_POOLING == Pooling("last", True)
    llm = LLM(str(folder), embedding_pooling="mean", embedding_normalize=False, **ENGINE)
    assert llm.config.pooling == Pooling("mean", normalize=False)
    ids = llm.engine.tokenize(TEXTS[4])
    (got,) = llm.embed([ids], use_tqdm=False)  # token ids work as prompts too
    assert max_error(got, hf_embedding(hf, ids, Pooling("mean", normalize=False))) < TOL
    assert_no_kv_left(llm)


@pytest.mark.parametrize("mode", ["last", "mean"])
def test_a_prompt_longer_than_the_token_budget_is_pooled_across_chunks(
    llama: tuple[Path, PreTrainedModel], mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, hf = llama
    llm = LLM(str(folder), **{**ENGINE, "max_num_batched_tokens": 16, "max_num_seqs": 4})
    batches = record_batches(llm, monkeypatch)
    ids = [(i * 37) % 500 + 3 for i in range(100)]
    pooling = Pooling(mode)  # type: ignore[arg-type]
    (got,) = llm.embed([ids], pooling=pooling, use_tqdm=False)
    assert len(batches) == 7  # 100 tokens in chunks of 16
    assert max_error(got, hf_embedding(hf, ids, pooling)) < TOL
    assert_no_kv_left(llm)


def test_an_embedding_beside_generation_changes_no_token_and_gets_its_vector(
    llm: LLM, llama: tuple[Path, PreTrainedModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    hf = llama[1]
    prompts: list[str | list[int]] = [llm.engine.tokenize(t) for t in TEXTS[:4]]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = [hf_greedy(hf, p, 8) for p in prompts if isinstance(p, list)]
    embed_ids = llm.engine.tokenize(TEXTS[6])
    batches = record_batches(llm, monkeypatch)
    pooling = Pooling("mean")
    outs = llm.generate([prompts[0], embed_ids, *prompts[1:]],
                        [greedy, SamplingParams(pooling=pooling), greedy, greedy, greedy], use_tqdm=False)
    assert [o.outputs[0].token_ids for i, o in enumerate(outs) if i != 1] == expected
    emb = outs[1].outputs[0]
    assert (emb.token_ids, emb.text, emb.finish_reason) == ([], "", "stop") and emb.embedding is not None
    assert max_error(emb.embedding, hf_embedding(hf, embed_ids, pooling)) < TOL
    # It shared a step with sampled sequences, and was never one of them.
    mixed = [b for b in batches if b.pooling.indices and b.sample_indices]
    assert mixed and all(not set(b.pooling.indices or ()) & set(b.sample_indices) for b in batches)
    assert all(o.outputs[0].embedding is None for i, o in enumerate(outs) if i != 1)
    llm.engine.policy.cache.reset()  # type: ignore[union-attr]  # the generations' cached prompts
    assert_no_kv_left(llm)


def test_prefix_caching_neither_serves_nor_keeps_an_embedding(llm: LLM, llama: tuple[Path, PreTrainedModel]) -> None:
    hf, cache, stats = llama[1], llm.engine.policy.cache, llm.engine.policy.stats
    assert cache is not None and cache.num_cached_pages == 0
    text = TEXTS[7]  # 66 tokens: four full pages of 16
    first = llm.embed(text, use_tqdm=False)
    assert cache.num_cached_pages == 0
    second = llm.embed(text, use_tqdm=False)
    assert first == second
    assert max_error(first[0], hf_embedding(hf, llm.engine.tokenize(text), DEFAULT_POOLING)) < TOL
    hits = stats.prefix_hit_tokens
    (out,) = llm.generate(text, SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    assert out.num_cached_tokens == 0 and stats.prefix_hit_tokens == hits
    assert cache.num_locked_pages == 0 and cache.num_cached_pages > 0  # the generation's prompt, cached
    # With the text's pages now cached, an embedding still computes (and mean-pools) every row.
    mean = Pooling("mean")
    (again,) = llm.embed(text, pooling=mean, use_tqdm=False)
    assert stats.prefix_hit_tokens == hits
    assert max_error(again, hf_embedding(hf, llm.engine.tokenize(text), mean)) < TOL
    cache.reset()
    assert_no_kv_left(llm)


def test_a_preempted_embedding_pools_from_scratch(llama: tuple[Path, PreTrainedModel]) -> None:
    folder, hf = llama
    # 32 pages of 4 tokens: g (20 + 10 tokens, 8 pages) and a 110-token embedding (28 pages) do not fit
    # together, so the embedding, the newest, is preempted part-way and recomputed from its first token.
    llm = LLM(str(folder), **{**ENGINE, "num_kv_pages": 32, "page_size": 4, "max_num_batched_tokens": 24,
                             "max_num_seqs": 4})
    g_ids = [(j * 5) % 500 + 3 for j in range(20)]
    e_ids = [[(i * 13 + j * 7) % 500 + 3 for j in range(length)] for i, length in enumerate((110, 90))]
    pooling = Pooling("mean", normalize=False)  # a chunk counted twice would show, unscaled
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = llm.generate([g_ids, *e_ids], [greedy, SamplingParams(pooling=pooling), SamplingParams(pooling=pooling)],
                        use_tqdm=False)
    assert llm.engine.policy.stats.num_preemptions > 0
    assert outs[0].outputs[0].token_ids == hf_greedy(hf, g_ids, 10)
    for out, ids in zip(outs[1:], e_ids, strict=True):
        assert out.outputs[0].embedding is not None
        assert max_error(out.outputs[0].embedding, hf_embedding(hf, ids, pooling)) < TOL
    assert llm.engine.policy.cache is not None
    llm.engine.policy.cache.reset()  # g's cached prompt
    assert_no_kv_left(llm)


def test_an_embedding_yields_exactly_one_delta(llm: LLM) -> None:
    engine, ids = llm.engine, list(range(3, 43))
    engine.add_request("one", ids, SamplingParams(pooling=DEFAULT_POOLING))
    deltas = []
    while engine.has_unfinished:
        deltas += engine.step()
    (d,) = deltas
    assert (d.request_id, d.index, d.token_ids, d.text, d.logprobs, d.finish_reason, d.num_prompt_tokens,
            d.num_cached_tokens, d.error) == ("one", 0, [], "", None, "stop", 40, 0, None)
    assert d.embedding is not None and len(d.embedding) == 64 and all(isinstance(v, float) for v in d.embedding)
    assert d.timing is not None and d.timing.num_output_tokens == 0
    assert d.timing.ttft_s is None and d.timing.e2e_s is not None and d.timing.e2e_s >= 0  # no token: no TTFT
    assert_no_kv_left(llm)


def test_an_aborted_embedding_frees_its_pages_and_its_sum(llama: tuple[Path, PreTrainedModel]) -> None:
    llm = LLM(str(llama[0]), **{**ENGINE, "max_num_batched_tokens": 16, "max_num_seqs": 4})
    engine = llm.engine
    engine.add_request("e", list(range(3, 63)), SamplingParams(pooling=Pooling("mean")))
    assert engine.step() == []  # the first of four chunks
    assert len(engine.embeddings) == 1 and engine.allocator.num_free_pages < engine.allocator.num_pages
    (delta,) = engine.abort("e")
    assert (delta.finish_reason, delta.embedding) == ("abort", None)
    assert_no_kv_left(llm)


@pytest.mark.parametrize("length", [1, 17])
def test_an_embedding_in_a_decode_only_step_on_the_static_decode_buffers(
    llama: tuple[Path, PreTrainedModel], length: int
) -> None:
    """A 1-token prompt, or a 1-token last chunk (17 = 16 + 1), makes a decode-only step: with
    ``cuda_graphs`` (eager on the CPU under the FlashInfer emulator) it runs on the static decode buffers."""
    folder, hf = llama
    llm = LLM(str(folder), **{**ENGINE, "max_num_batched_tokens": 16, "max_num_seqs": 4,
                             "attention_backend": "flashinfer", "attention_kernels": flashinfer_emulator,
                             "cuda_graphs": True})
    graphs = llm.engine.executor.runner.graphs  # type: ignore[attr-defined]
    assert graphs is not None and graphs.replays == 0
    ids = [(j * 11) % 500 + 3 for j in range(length)]
    for pooling in (Pooling("last"), Pooling("mean")):
        (got,) = llm.embed([ids], pooling=pooling, use_tqdm=False)
        assert max_error(got, hf_embedding(hf, ids, pooling)) < TOL
    assert graphs.replays == 2
    assert_no_kv_left(llm)


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"n": 2}, "n"), ({"logprobs": 1}, "logprobs"), ({"temperature": 0.0}, "temperature"),
     ({"stop": ["x"]}, "stop"), ({"ignore_eos": True}, "ignore_eos"), ({"seed": 1}, "seed"),
     ({"presence_penalty": 0.5}, "presence_penalty"), ({"logit_bias": {3: 1.0}}, "logit_bias"),
     # A constraint is named as its caller spelled it (``StructuredOutput.param``), as elsewhere.
     ({"structured_output": StructuredOutput("json_object", param="response_format")}, "response_format")],
)
def test_generation_only_params_are_refused_on_an_embedding_by_name(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidParameterError, match="embedding") as err:
        SamplingParams(pooling=DEFAULT_POOLING, **fields)
    assert err.value.param == param
    SamplingParams(max_tokens=500, lora="adapter", pooling=DEFAULT_POOLING)  # ignored, and allowed


def test_bad_pooling_settings_are_refused_by_name() -> None:
    with pytest.raises(InvalidParameterError, match="'max'") as err:
        EngineConfig(embedding_pooling="max")
    assert err.value.param == "embedding_pooling"
    with pytest.raises(InvalidParameterError) as err:
        EngineConfig(embedding_normalize="yes")  # type: ignore[arg-type]
    assert err.value.param == "embedding_normalize"
    with pytest.raises(InvalidParameterError, match="'max'") as err:
        Pooling("max")  # type: ignore[arg-type]
    assert err.value.param == "pooling"
    with pytest.raises(InvalidParameterError) as err:
        SamplingParams(pooling="mean")  # type: ignore[arg-type]
    assert err.value.param == "pooling"
