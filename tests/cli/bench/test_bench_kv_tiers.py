"""``bench kv-tiers``: the seeded conversations, and one whole small run on ``tiny`` printing exactly the keys the
issue names (six replica actors on a private local Ray cluster; well under a minute on two cores)."""

from __future__ import annotations

import json

import pytest

from actors.load.loader import load_tokenizer, resolve_model_path
from cli.bench.kv_tiers.conversations import conversations, unique_prompts
from cli.main import main

pytestmark = pytest.mark.ray  # on the session's shared cluster: run with the other Ray modules, last (tests/conftest.py)

SET_KEYS = {"turn2plus_prefill_tokens", "turn2plus_ttft_p50_ms", "turn2plus_ttft_p95_ms", "no_reuse_output_tok_per_s",
            "new_replica_cluster_hits"}  # fmt: skip


def test_conversations_are_seeded_and_grow_turn_by_turn() -> None:
    tokenizer = load_tokenizer(resolve_model_path("tiny"))
    a, b = conversations(3, 3, 2, seed=1), conversations(3, 3, 2, seed=1)
    assert [c.questions for c in a] == [c.questions for c in b]
    assert conversations(3, 3, 2, seed=2)[0].questions != a[0].questions
    conv = a[0]
    first = conv.next_prompt(tokenizer)
    conv.answer(tokenizer, first[:5])
    second = conv.next_prompt(tokenizer)
    assert conv.turn == 3 and len(second) > len(first)
    prompts = unique_prompts(tokenizer, 4, 64, seed=0)
    assert all(len(p) == 64 for p in prompts) and len({tuple(p[:16]) for p in prompts}) == 4


def test_a_small_run_prints_both_sets(ray_cluster: None, capsys: pytest.CaptureFixture[str]) -> None:
    # On the session's cluster: the command uses the one this process runs (cli.bench.harness.ray_running).
    code = main(["bench", "kv-tiers", "--model", "tiny", "--conversations", "3", "--turns", "2", "--passages", "4",
                 "--max-tokens", "8", "--think-s", "1.0", "--no-reuse-requests", "2", "--no-reuse-prompt-len", "64",
                 "--no-reuse-max-tokens", "4", "--no-reuse-min-s", "0", "--runs", "1", "--json"])  # fmt: skip
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out["tiers_off"]) >= SET_KEYS and set(out["tiers_on"]) >= SET_KEYS
    assert out["same_tokens"] is True and out["differing_turns"] == []
    off, on = out["tiers_off"], out["tiers_on"]
    assert off["new_replica_cluster_hits"] == 0 and off["turn2plus_prompt_tokens"] == on["turn2plus_prompt_tokens"]
    # Each second turn resends its first: with the cluster tier only its new tail is computed, wherever it lands.
    assert on["turn2plus_prefill_tokens"] < off["turn2plus_prompt_tokens"] / 2
    assert on["new_replica_cluster_hits"] > 0 and on["tiers"]["cluster"]["errors"] == 0
    assert on["engine"]["dropped_saves"] == 0
