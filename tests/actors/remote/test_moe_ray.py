"""MoE models on Ray shard actors: TP=2 (every expert sliced) and EP=2 (experts spread whole) equal TP=1,
in tokens and in the expert counts the executor reads from rank 0.

One local Ray cluster for the module; every engine started here is shut down by its test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from actors.commands import ReadExpertTokens
from actors.load.embedded import build_tokenizer
from apps.llm import LLM
from scheduling.sampling_params import SamplingParams
from tests.actors.checkpoints import FAMILY_CONFIGS, write_checkpoint
from tests.actors.engine.test_engine_oracle import PROMPTS

pytestmark = pytest.mark.ray  # on the session's shared cluster: run with the other Ray modules, last (tests/conftest.py)

ENGINE: dict[str, Any] = {"max_model_len": 128, "max_num_seqs": 8, "max_num_batched_tokens": 256,
                          "num_kv_pages": 96, "dtype": "float32", "device": "cpu"}
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:6], GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_tp2_and_ep2_on_ray_equal_tp1(ray_cluster: None, tmp_path: Path, family: str) -> None:
    folder = write_checkpoint(tmp_path / family, FAMILY_CONFIGS[family](), seed=2)
    build_tokenizer().save_pretrained(folder)
    reference = LLM(str(folder), **ENGINE)
    try:
        expected = _tokens(reference)
        expected_counts = reference.engine.executor.command(ReadExpertTokens())
    finally:
        reference.shutdown()
    for expert_parallel in (False, True):
        llm = LLM(str(folder), tensor_parallel_size=2, executor="ray", expert_parallel=expert_parallel, **ENGINE)
        try:
            assert _tokens(llm) == expected, f"expert_parallel={expert_parallel}"
            # Every rank routes every token: rank 0's counts (read through the executor) are TP=1's.
            assert llm.engine.executor.command(ReadExpertTokens()) == expected_counts, f"expert_parallel={expert_parallel}"
            sched = llm.engine.policy
            if sched.cache is not None:
                sched.cache.reset()
            assert sched.allocator.num_free_pages == sched.allocator.num_pages
        finally:
            llm.shutdown()
