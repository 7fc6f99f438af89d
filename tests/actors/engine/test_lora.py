"""Multi-LoRA in the engine against PEFT on transformers, and its bookkeeping.

Adapters are made by PEFT itself (``tests/actors/lora_fixtures.py``) with
seeded random weights, on the embedded ``tiny`` model and on the real
SmolLM2-135M, for every projection set. The oracle is PEFT's own forward in
float32; a batch that mixes adapters and the base must give each request what
it gets alone; KV computed under one adapter never serves another; slots
and the host cache evict and reload; unloading waits for the requests in
flight; every page is free after aborts and preemption.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from actors.config import EngineConfig
from apps.llm import LLM
from scheduling.errors import InvalidParameterError
from scheduling.sampling_params import SamplingParams
from tests.actors.engine.test_engine_oracle import assert_pool_clean
from tests.actors.lora_fixtures import PROJECTION_SETS, GreedyResult, make_peft_adapter, peft_greedy
from tests.kvcache import flashinfer_emulator

MAX_TOKENS = 8
TOLERANCE = 1e-4
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _prompts(seed: int, n: int, low: int = 3, high: int = 250) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(rng.randint(4, 40))] for _ in range(n)]


def _engine(model: Path, **overrides: Any) -> LLM:
    kw: dict[str, Any] = {"max_model_len": 256, "max_num_seqs": 16, "max_num_batched_tokens": 256,
                          "dtype": "float32", "device": "cpu", "enable_lora": True, "max_lora_rank": 16,
                          **overrides}  # fmt: skip
    return LLM(str(model), **kw)


@pytest.fixture(scope="module")
def adapters(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A PEFT adapter of ``tiny`` per projection set (ranks 8 and 16, alphas 16 and 8), plus rsLoRA."""
    root = tmp_path_factory.mktemp("lora")
    made = {name: make_peft_adapter(tiny_dir, root / name, targets=targets, rank=8 if i % 2 else 16,
                                    alpha=16 if i % 2 else 8, seed=i)
            for i, (name, targets) in enumerate(PROJECTION_SETS.items())}  # fmt: skip
    rs = make_peft_adapter(tiny_dir, root / "rslora", targets=PROJECTION_SETS["all"], rank=4, alpha=8, seed=9)
    config = json.loads((rs / "adapter_config.json").read_text())
    (rs / "adapter_config.json").write_text(json.dumps({**config, "use_rslora": True}))
    made["rslora"] = rs
    return made


def assert_matches_peft(outs: list[Any], expected: list[GreedyResult]) -> None:
    """Greedy tokens equal and each step's top-20 logprobs within the tolerance of PEFT's."""
    for out, (tokens, tops) in zip(outs, expected, strict=True):
        got = out.outputs[0]
        assert got.token_ids == tokens
        assert got.logprobs is not None
        for step, want in zip(got.logprobs, tops, strict=True):
            want_ids = [t for t, _ in want]
            assert step.top_token_ids[:5] == want_ids[:5] or torch.allclose(
                torch.tensor(step.top_logprobs[:5]), torch.tensor([v for _, v in want[:5]]), atol=TOLERANCE
            )  # the order of near-ties may differ; their values may not
            want_of = dict(want)
            for t, v in zip(step.top_token_ids, step.top_logprobs, strict=True):
                if t in want_of:
                    assert abs(v - want_of[t]) < TOLERANCE, (t, v, want_of[t])


def test_every_projection_set_matches_peft_and_a_mixed_batch_matches_each_alone(
    tiny_dir: Path, adapters: dict[str, Path]
) -> None:
    prompts = _prompts(1, 4)
    llm = _engine(tiny_dir, max_loras=len(adapters))
    for name, path in adapters.items():
        info = llm.load_lora(name, str(path))
        assert info.name == name and set(info.targets) <= set(PROJECTION_SETS["all"])
    params = replace(GREEDY, logprobs=20)
    expected = {name: peft_greedy(tiny_dir, path, prompts, MAX_TOKENS) for name, path in adapters.items()}
    expected[""] = peft_greedy(tiny_dir, None, prompts, MAX_TOKENS)
    alone = {}
    for name in expected:
        outs = llm.generate(prompts, params, use_tqdm=False, lora=name or None)
        assert_matches_peft(outs, expected[name])
        alone[name] = [o.outputs[0].token_ids for o in outs]
    assert len({str(v) for v in alone.values()}) == len(alone)  # every adapter changes the tokens
    # One batch: each prompt under every adapter and the base, interleaved.
    names = list(expected)
    mixed_prompts = [p for p in prompts for _ in names]
    mixed_params = [replace(GREEDY, lora=name or None) for _ in prompts for name in names]
    outs = llm.generate(mixed_prompts, mixed_params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == [alone[name][i] for i in range(len(prompts)) for name in names]
    # Mostly base rows (the step scatters its few LoRA rows instead of reading every row back).
    few = [replace(GREEDY, lora="all" if i == 1 else None) for i in range(len(prompts))]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, few, use_tqdm=False)]
    assert got == [alone["all" if i == 1 else ""][i] for i in range(len(prompts))]
    assert_pool_clean(llm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_mixed_batch_matches_peft(tiny_dir: Path, adapters: dict[str, Path]) -> None:
    """The CUDA path (scripts/gpu_check.sh): two adapters and the base in one batch, each request as PEFT
    gives it on the host in float32 (the device's float32 products sum in another order, well inside
    the tolerance)."""
    prompts = _prompts(5, 3)
    names = ["all", "qv", ""]
    llm = _engine(tiny_dir, device="cuda", attention_backend="torch", max_loras=2)
    for name in names[:2]:
        llm.load_lora(name, str(adapters[name]))
    expected = {name: peft_greedy(tiny_dir, adapters[name] if name else None, prompts, MAX_TOKENS)
                for name in names}  # fmt: skip
    batch = [(p, name) for p in range(len(prompts)) for name in names]
    outs = llm.generate([prompts[p] for p, _ in batch], [replace(GREEDY, logprobs=20, lora=name or None)
                                                          for _, name in batch], use_tqdm=False)
    for out, (p, name) in zip(outs, batch, strict=True):
        assert_matches_peft([out], [expected[name][p]])
    assert_pool_clean(llm)


@pytest.mark.parametrize("targets", ["all"])  # the seeded tiny models run every set; the real model costs ~25 s a set
def test_smollm2_adapters_match_peft(smollm2_dir: Path, tmp_path: Path, targets: str) -> None:
    adapter = make_peft_adapter(smollm2_dir, tmp_path / targets, targets=PROJECTION_SETS[targets], rank=16,
                                alpha=32, seed=3, scale=0.02)  # fmt: skip
    prompts = _prompts(2, 3, high=40000)
    expected = peft_greedy(smollm2_dir, adapter, prompts, MAX_TOKENS)
    base = peft_greedy(smollm2_dir, None, prompts, MAX_TOKENS)
    assert [t for t, _ in expected] != [t for t, _ in base]  # the adapter shows
    llm = _engine(smollm2_dir)
    llm.load_lora("task", str(adapter))
    assert_matches_peft(llm.generate(prompts, replace(GREEDY, logprobs=20), use_tqdm=False, lora="task"), expected)
    assert_matches_peft(llm.generate(prompts, replace(GREEDY, logprobs=20), use_tqdm=False), base)
    assert_pool_clean(llm)


def test_adapters_never_share_cached_kv(tiny_dir: Path, adapters: dict[str, Path]) -> None:
    llm = _engine(tiny_dir, max_loras=2)
    llm.load_lora("a", str(adapters["all"]))
    llm.load_lora("b", str(adapters["attention"]))
    prompt = _prompts(3, 1)[0] * 3  # a few full pages
    first = llm.generate([prompt], GREEDY, use_tqdm=False, lora="a")[0]
    other = llm.generate([prompt], GREEDY, use_tqdm=False, lora="b")[0]
    again = llm.generate([prompt], GREEDY, use_tqdm=False, lora="a")[0]
    base = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    fresh = _engine(tiny_dir, max_loras=2)
    fresh.load_lora("b", str(adapters["attention"]))
    assert other.outputs[0].token_ids == fresh.generate([prompt], GREEDY, use_tqdm=False, lora="b")[0].outputs[0].token_ids
    assert_pool_clean(llm)


def test_an_adapter_loaded_again_from_other_files_never_meets_its_old_kv(
    tiny_dir: Path, adapters: dict[str, Path]
) -> None:
    """Unload ``a`` and load ``a`` again from another folder: the same prompt reuses nothing cached under the
    old weights and matches PEFT with the new ones (before, ``a``'s KV was keyed by its name and served
    again). Unloading drops the adapter's pages at once; the same files under two names share their KV."""
    prompt = _prompts(11, 1)[0] * 3  # a few full pages
    expected = peft_greedy(tiny_dir, adapters["attention"], [prompt], MAX_TOKENS)
    llm = _engine(tiny_dir, max_loras=2)
    cache = llm.engine.policy.cache
    assert cache is not None
    llm.load_lora("a", str(adapters["all"]))
    old = llm.generate([prompt], GREEDY, use_tqdm=False, lora="a")[0]
    assert old.outputs[0].token_ids != expected[0][0] and cache.num_cached_pages > 0
    llm.unload_lora("a")
    assert cache.num_cached_pages == 0  # the old weights' pages went with them (nothing else was cached)
    llm.load_lora("a", str(adapters["attention"]))
    new = llm.generate([prompt], replace(GREEDY, logprobs=20), use_tqdm=False, lora="a")
    assert new[0].num_cached_tokens == 0
    assert_matches_peft(new, expected)
    llm.load_lora("b", str(adapters["attention"]))  # the same files under another name: the same KV
    shared = llm.generate([prompt], GREEDY, use_tqdm=False, lora="b")[0]
    assert shared.num_cached_tokens > 0 and shared.outputs[0].token_ids == expected[0][0]
    llm.unload_lora("a")  # b still reads those pages: they stay
    kept = llm.generate([prompt], GREEDY, use_tqdm=False, lora="b")[0]
    assert kept.num_cached_tokens == shared.num_cached_tokens and kept.outputs[0].token_ids == expected[0][0]
    assert_pool_clean(llm)


def test_kv_tiers_serve_blocks_only_to_the_weights_that_computed_them(
    tiny_dir: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """Host and disk blocks are keyed by the weights' digests. In one engine, ``a``'s pages evicted from the
    pool never serve another adapter nor the base. A later engine on the same disk folder (another app on the
    node) with an adapter of the same name and other weights gets no block of the first's (before, blocks were
    keyed by the adapter's name and served); the first's files under another name get every full page."""
    prompt = _prompts(12, 1)[0] * 3  # a few full pages
    full_pages = (len(prompt) - 1) // 16 * 16
    want = {which: peft_greedy(tiny_dir, None if which == "base" else adapters[which], [prompt], MAX_TOKENS)[0][0]
            for which in ("all", "attention", "base")}  # fmt: skip

    def run(llm: LLM, lora: str | None) -> tuple[list[int], int]:
        out = llm.generate([prompt], GREEDY, use_tqdm=False, lora=lora)[0]
        assert llm.engine.kv_tiers is not None and llm.engine.policy.cache is not None
        llm.engine.kv_tiers.wait_for_saves()
        llm.engine.policy.cache.reset()  # what comes back next comes from a tier or is computed
        return out.outputs[0].token_ids, out.num_cached_tokens

    disk = {"disk_bytes": 1 << 24, "disk_path": str(tmp_path / "blocks")}  # disk only: blocks outlive the engine
    for offload in ({"host_bytes": 1 << 24}, disk):
        first = _engine(tiny_dir, max_loras=2, kv_offload=offload)
        first.load_lora("a", str(adapters["all"]))
        first.load_lora("b", str(adapters["attention"]))
        assert run(first, "a") == (want["all"], 0)
        assert run(first, "b") == (want["attention"], 0)
        assert run(first, None) == (want["base"], 0)
        assert run(first, "a") == (want["all"], full_pages), offload  # its own blocks do come back
        assert first.engine.policy.stats.tier_hit_tokens == full_pages
        assert_pool_clean(first)
        first.shutdown()

    second = _engine(tiny_dir, max_loras=2, kv_offload=disk)
    second.load_lora("a", str(adapters["attention"]))
    second.load_lora("c", str(adapters["all"]))
    assert run(second, "a") == (want["attention"], full_pages)  # the first's "b": these weights' blocks
    second.unload_lora("a")
    second.load_lora("a", str(adapters["rslora"]))  # the name again, weights no engine here computed with
    assert run(second, "a")[1] == 0
    assert run(second, "c") == (want["all"], full_pages)  # the first's "a", under another name
    assert second.engine.policy.stats.tier_hit_tokens == 2 * full_pages
    assert_pool_clean(second)
    second.shutdown()


def test_more_adapters_than_slots_and_host_cache_evict_and_reload(tiny_dir: Path, adapters: dict[str, Path]) -> None:
    """Five adapters through 2 slots and a host cache of 2: every request still gets its own adapter."""
    names = list(adapters)
    prompts = _prompts(4, 15)
    reference = _engine(tiny_dir, max_loras=len(names))
    for name in names:
        reference.load_lora(name, str(adapters[name]))
    params = [replace(GREEDY, lora=names[i % len(names)]) for i in range(len(prompts))]
    want = [o.outputs[0].token_ids for o in reference.generate(prompts, params, use_tqdm=False)]
    tight = _engine(tiny_dir, max_loras=2, max_cpu_loras=2)
    for name in names:
        tight.load_lora(name, str(adapters[name]))
    assert [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)] == want
    runner = tight.engine.executor.runner  # type: ignore[attr-defined]
    assert runner.lora is not None and len(runner.lora._host) == 2
    assert_pool_clean(tight)


def test_preemption_and_abort_with_adapters_free_every_page(tiny_dir: Path, adapters: dict[str, Path]) -> None:
    llm = _engine(tiny_dir, max_loras=2, num_kv_pages=24, page_size=4, max_model_len=64)
    llm.load_lora("a", str(adapters["all"]))
    llm.load_lora("b", str(adapters["mlp"]))
    prompts = _prompts(5, 10)
    params = [replace(GREEDY, max_tokens=16, lora=[None, "a", "b"][i % 3]) for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.policy.stats.num_preemptions > 0
    roomy = _engine(tiny_dir, max_loras=2)
    roomy.load_lora("a", str(adapters["all"]))
    roomy.load_lora("b", str(adapters["mlp"]))
    assert [o.outputs[0].token_ids for o in outs] == [
        o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    assert_pool_clean(llm)
    engine = llm.engine
    for i, prompt in enumerate(prompts[:4]):
        engine.add_request(f"abort-{i}", prompt, params[i], prompt_token_ids=prompt)
    for _ in range(3):
        engine.step()
    for i in range(4):
        engine.abort(f"abort-{i}")
    assert not engine.has_unfinished and engine.policy.lora is not None and not any(engine.policy.lora.pins)
    assert_pool_clean(llm)


def test_unloading_finishes_requests_in_flight_first(tiny_dir: Path, adapters: dict[str, Path]) -> None:
    llm = _engine(tiny_dir, max_loras=1)
    llm.load_lora("a", str(adapters["all"]))
    prompts = _prompts(6, 3)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora="a")]
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, replace(GREEDY, lora="a"), prompt_token_ids=prompt)
    got: dict[str, list[int]] = {}
    for d in engine.step():
        got.setdefault(d.request_id, []).extend(d.token_ids)
    llm.unload_lora("a")
    with pytest.raises(InvalidParameterError) as err:  # new requests are refused at once
        engine.add_request("late", prompts[0], replace(GREEDY, lora="a"), prompt_token_ids=prompts[0])
    assert err.value.param == "lora"
    assert "a" in engine.loras.adapters  # its requests still run on it
    for _ in range(4 * MAX_TOKENS):  # bounded: each step advances every running request
        if not engine.has_unfinished:
            break
        for d in engine.step():
            got.setdefault(d.request_id, []).extend(d.token_ids)
    assert [got[f"r{i}"] for i in range(3)] == want
    assert "a" not in engine.loras.adapters and engine.policy.lora is not None
    assert engine.policy.lora.slot_of == {}
    with pytest.raises(InvalidParameterError):
        llm.unload_lora("a")
    llm.load_lora("a", str(adapters["attention"]))  # the name is free again
    assert_pool_clean(llm)


def _write(folder: Path, config: dict[str, Any] | str | None, weights: bytes | None = None) -> Path:
    folder.mkdir(parents=True)
    if config is not None:
        (folder / "adapter_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if weights is not None:
        (folder / "adapter_model.safetensors").write_bytes(weights)
    return folder


def test_bad_adapters_are_refused_naming_the_field(
    tiny_dir: Path, smollm2_dir: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    llm = _engine(tiny_dir, max_lora_rank=8)
    good_config = json.loads((adapters["qv"] / "adapter_config.json").read_text())
    weights = (adapters["qv"] / "adapter_model.safetensors").read_bytes()
    other_base = make_peft_adapter(smollm2_dir, tmp_path / "smollm2", targets=("q_proj",), rank=4, alpha=8, seed=1)
    cases: list[tuple[str, str, str]] = [
        (str(tmp_path / "missing"), "lora_path", "no such folder"),
        (str(_write(tmp_path / "no_config", None, weights)), "lora_path", "no adapter_config.json"),
        (str(_write(tmp_path / "bad_json", "{not json", weights)), "lora_path", "not valid JSON"),
        (str(_write(tmp_path / "no_weights", good_config)), "lora_path", "no adapter_model.safetensors"),
        (str(_write(tmp_path / "garbage", good_config, b"\x00" * 64)), "lora_path", "not a readable safetensors"),
        (str(_write(tmp_path / "dora", {**good_config, "use_dora": True}, weights)), "lora_path", "DoRA"),
        (str(_write(tmp_path / "bias", {**good_config, "bias": "all"}, weights)), "lora_path", "biases"),
        (str(adapters["attention"]), "max_lora_rank", "rank 16, above max_lora_rank 8"),
        (str(other_base), "lora_path", "another base model"),
    ]
    for path, param, words in cases:
        with pytest.raises(InvalidParameterError) as err:
            llm.load_lora("x", path)
        assert err.value.param == param and words in err.value.message, (path, err.value.message)
    assert llm.engine.loras.adapters == {}
    with pytest.raises(InvalidParameterError) as err:
        llm.generate([[5, 6]], GREEDY, use_tqdm=False, lora="x")
    assert err.value.param == "lora" and "no adapter named 'x'" in err.value.message
    for name in ("", "has space", "x" * 200):
        with pytest.raises(InvalidParameterError):
            llm.load_lora(name, str(adapters["qv"]))
    plain = _engine(tiny_dir, enable_lora=False)
    with pytest.raises(InvalidParameterError) as err:
        plain.load_lora("x", str(adapters["qv"]))
    assert err.value.param == "enable_lora"
    with pytest.raises(InvalidParameterError) as err:
        plain.generate([[5, 6]], GREEDY, use_tqdm=False, lora="x")
    assert err.value.param == "lora"


def test_engine_config_refuses_what_lora_cannot_run_with() -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"enable_lora": True, "speculative_config": {"method": "draft", "num_speculative_tokens": 2, "layers": 1}},
         "speculative_config"),
        ({"max_loras": 0}, "max_loras"),
        ({"max_lora_rank": 512}, "max_lora_rank"),
        ({"max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras"),
        ({"enable_lora": True, "cuda_graphs": True, "attention_backend": "flashinfer",
          "attention_kernels": flashinfer_emulator}, "cuda_graphs"),
    ]  # fmt: skip
    for kwargs, param in cases:
        with pytest.raises(InvalidParameterError) as err:
            EngineConfig(device="cpu", **kwargs)
        assert err.value.param == param, kwargs
    ngram = EngineConfig(device="cpu", enable_lora=True,
                         speculative_config={"method": "ngram", "num_speculative_tokens": 2})  # fmt: skip
    assert ngram.scheduler_config().max_loras == 4 and ngram.resolved_cuda_graphs() is False
    assert EngineConfig(device="cpu").scheduler_config().max_loras == 0


def test_ngram_speculation_with_adapters_keeps_their_tokens(tiny_dir: Path, adapters: dict[str, Path]) -> None:
    """Drafts are verified by the target with each sequence's adapter: the same greedy tokens as without them."""
    prompts = [p * 3 for p in _prompts(7, 6)]  # repeats give the n-gram proposer something to draft
    params = [replace(GREEDY, max_tokens=16, lora=[None, "a", "b"][i % 3]) for i in range(len(prompts))]
    outs = {}
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3}):
        llm = _engine(tiny_dir, max_loras=2, speculative_config=spec)
        llm.load_lora("a", str(adapters["all"]))
        llm.load_lora("b", str(adapters["qv"]))
        outs[spec is None] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if spec is not None:
            assert llm.engine.policy.stats.spec_num_drafts > 0
        assert_pool_clean(llm)
    assert outs[True] == outs[False]
