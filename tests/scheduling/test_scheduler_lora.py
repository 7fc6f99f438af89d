"""Admission with LoRA slots: resident adapters overtake a request waiting for a slot, within a bound.

One slot, a steady stream of requests for the resident adapter ``a``, and one
request for ``b``: the ``a`` requests behind ``b`` are admitted while ``b``
waits (no idle slot-bound queue), ``b`` is overtaken in at most
``LORA_MAX_OVERTAKES`` steps and then blocks the queue until ``a`` drains,
so it runs, and every page and slot is free at the end.
"""

from __future__ import annotations

from scheduling.policy import LORA_MAX_OVERTAKES
from scheduling.request import Request
from scheduling.sampling_params import SamplingParams
from scheduling.scheduler_config import SchedulerConfig
from tests.scheduling.driver import assert_pool_clean, make, step

CONFIG = SchedulerConfig(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64, max_loras=1)


def _req(rid: str, lora: str | None, max_tokens: int = 4) -> Request:
    return Request(rid, [3, 1, 4, 1, 5, int(rid.split("-")[-1]) % 90], SamplingParams(max_tokens=max_tokens, lora=lora))


def test_resident_adapter_requests_overtake_one_waiting_for_a_slot() -> None:
    run = make(CONFIG, num_pages=64)
    s = run.policy
    for rid, lora in (("a-0", "a"), ("b-1", "b"), ("a-2", "a"), ("base-3", None)):
        s.add(_req(rid, lora))
    batch = step(run)
    assert batch is not None
    assert {r.request_id for r in s.running} == {"a-0", "a-2", "base-3"}
    assert [r.request_id for r in s.waiting] == ["b-1"] and s.waiting[0].lora.overtakes == 1
    for _ in range(20):
        if not s.has_work:
            break
        step(run)
    assert set(run.finished) == {"a-0", "b-1", "a-2", "base-3"}
    assert_pool_clean(run)
    assert s.lora is not None and s.lora.pins == [0]


def test_a_request_waiting_for_a_slot_is_overtaken_a_bounded_number_of_steps() -> None:
    run = make(CONFIG, num_pages=64)
    s = run.policy
    s.add(_req("a-0", "a", max_tokens=8))
    s.add(_req("b-1", "b"))
    admitted_b_at = None
    for i in range(LORA_MAX_OVERTAKES + 40):  # a new request for ``a`` every step: ``a`` never drains by itself
        s.add(_req(f"a-{i + 2}", "a", max_tokens=8))
        step(run)
        b = s.requests.get("b-1")
        if b is None or b.lora.slot is not None:
            admitted_b_at = i
            break
    assert admitted_b_at is not None, "the request for b starved"
    b_req = run.finished.get("b-1") or s.requests["b-1"]
    assert b_req.lora.overtakes == LORA_MAX_OVERTAKES
    for _ in range(200):
        if not s.has_work:
            break
        step(run)
    assert "b-1" in run.finished and not s.has_work
    assert_pool_clean(run)
