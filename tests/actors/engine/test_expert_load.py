"""Expert load of mixture-of-experts models: the counts an engine reads, and what reaches ``/metrics``.

Each MoE layer counts every token it routes once per expert the token picks
(``SparseMoE.expert_tokens``). After a batch, every layer's counts must add up
to top_k x the tokens forwarded (prompt and generated, less the last token,
which is sampled but never fed; prefix caching off so no prompt token is
skipped), and equal, expert by expert, the picks of transformers' own router
over the same tokens. On the static decode path (``cuda_graphs``, run eagerly
on the CPU) a batch of 6 runs padded to 8 rows: the padding must not count.
The Ray path (rank 0's counts through ``RayExecutor``) is checked in
test_moe_ray.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from actors.api import LatencyWindow
from actors.commands import ReadExpertTokens
from actors.config import EngineConfig
from actors.engine.stats import snapshot
from actors.load.embedded import build_tokenizer
from actors.scheduler.actor import SchedulerService
from apps.llm import LLM
from cluster.metrics import ReplicaMetrics
from scheduling.sampling_params import SamplingParams
from tests.actors.checkpoints import FAMILY_CONFIGS, build_hf_model, write_checkpoint
from tests.actors.engine.test_engine_oracle import BACKENDS, PROMPTS
from tests.cluster.test_metrics import samples

SEED = 5
ENGINE: dict[str, Any] = {"max_model_len": 128, "max_num_seqs": 8, "max_num_batched_tokens": 512,
                          "dtype": "float32", "device": "cpu", "enable_prefix_caching": False}
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
NUM_PROMPTS = 6  # decode steps of 6 sequences: padded to 8 on the static path


def _checkpoint(tmp_path: Path, family: str) -> Path:
    folder = write_checkpoint(tmp_path / family, FAMILY_CONFIGS[family](), seed=SEED)
    build_tokenizer().save_pretrained(folder)
    return folder


def _hf_counts(family: str, sequences: list[list[int]]) -> list[list[int]]:
    """Per MoE layer, per expert, the picks of transformers' router over every token of ``sequences``."""
    config = FAMILY_CONFIGS[family]()
    hf = build_hf_model(config, SEED)
    top_k = config.num_experts_per_tok
    picks: list[list[torch.Tensor]] = []  # per sequence, per MoE layer
    with torch.inference_mode():
        for ids in sequences:
            logits = hf(torch.tensor([ids]), output_router_logits=True).router_logits
            # As the router picks: top-k of the float32 softmax.
            picks.append([torch.topk(torch.softmax(x.float(), dim=-1), top_k, dim=-1).indices for x in logits])
    num_experts = logits[0].shape[-1]
    return [torch.bincount(torch.cat([p.flatten() for p in layer]), minlength=num_experts).tolist()
            for layer in zip(*picks, strict=True)]


@pytest.mark.parametrize("backend", ["torch", "flashinfer_static_decode"])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])  # one MoE layer of two / both layers MoE
def test_expert_counts_are_the_routed_tokens(tmp_path: Path, family: str, backend: str) -> None:
    llm = LLM(str(_checkpoint(tmp_path, family)), **ENGINE, **BACKENDS[backend])
    try:
        before = llm.engine.executor.command(ReadExpertTokens())
        prompts = PROMPTS[:NUM_PROMPTS]
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        counts = llm.engine.executor.command(ReadExpertTokens())
        stats = snapshot(llm.engine, LatencyWindow(), counts)
    finally:
        llm.shutdown()
    fed = [p + o.outputs[0].token_ids[:-1] for p, o in zip(prompts, outs, strict=True)]
    num_moe_layers = 1 if family == "qwen3_moe" else 2
    assert before == ((0,) * 8,) * num_moe_layers  # loading routes nothing
    assert len(counts) == num_moe_layers and all(len(layer) == 8 for layer in counts)
    top_k = 2
    assert [sum(layer) for layer in counts] == [top_k * sum(map(len, fed))] * num_moe_layers
    assert [list(layer) for layer in counts] == _hf_counts(family, fed)
    assert all(max(layer) < sum(layer) / top_k for layer in counts)  # spread: no expert takes every token

    # The exposition: one counter per expert, summed over the layers.
    assert stats.moe_expert_tokens == counts
    metrics = ReplicaMetrics(family, "r0", export_to_ray=False)
    metrics.update(stats)
    s = samples(metrics.render())
    per_expert = {labels: v for (name, labels), v in s.items() if name == "flotilla:moe_expert_tokens_total"}
    assert per_expert == {(("expert", str(e)),): sum(layer[e] for layer in counts) for e in range(8)}


def test_a_dense_model_exposes_no_expert_series(tiny_dir: Path) -> None:
    llm = LLM(str(tiny_dir), **ENGINE)
    try:
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
        counts = llm.engine.executor.command(ReadExpertTokens())
        stats = snapshot(llm.engine, LatencyWindow(), counts)
    finally:
        llm.shutdown()
    assert counts == () and stats.moe_expert_tokens == ()
    metrics = ReplicaMetrics("tiny", "r0", export_to_ray=False)
    metrics.update(stats)
    names = {name for name, _ in samples(metrics.render())}
    assert "flotilla:generation_tokens_total" in names  # the exposition is there, without MoE samples
    assert not any(name.startswith("flotilla:moe_") for name in names)


def test_scheduler_stats_carry_the_counts(tmp_path: Path) -> None:
    """``SchedulerService.stats`` reads them off the engine thread, equal to the executor's own read."""
    config = EngineConfig(model=str(_checkpoint(tmp_path, "mixtral")), **ENGINE)

    async def scenario() -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
        svc = SchedulerService(config)
        try:
            await svc.generate("a", PROMPTS[0], GREEDY)
            return (await svc.stats()).moe_expert_tokens, svc._engine.executor.command(ReadExpertTokens())
        finally:
            await svc.shutdown()

    from_stats, direct = asyncio.run(scenario())
    assert from_stats == direct and sum(direct[0]) == 2 * (len(PROMPTS[0]) + GREEDY.max_tokens - 1)
