"""Timed decode steps of a full batch, shared by the benches that compare step times (``lora``, ``moe``).

A pass adds one greedy request per prompt, steps the engine until every
request has its first token (the prefill: timed as a whole, not per step),
then times ``steps`` decode steps, each one checked: decode-only, every
sequence of the batch, one token each, and exactly the adapters asked for
(``loras``; none when it is None) with none written into a slot. Then it
aborts the batch, so the engine is idle again. The engine is stepped by hand
(``schedule``, ``execute``, ``finish_step``: what ``LLMEngine.step`` does)
and each step timed whole.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from actors.engine.llm_engine import LLMEngine
from scheduling.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class DecodeTimes:
    """One pass: the prefill's seconds (adding the batch until every request has a token), and each timed
    decode step's wall and forward seconds."""

    prefill_s: float
    prompt_tokens: int
    step_s: list[float]
    forward_s: list[float]


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``length`` token ids drawn uniformly from ``vocab`` (seeded)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def median_ms(values: list[float]) -> float:
    """The median of ``values`` (seconds) in milliseconds, to the microsecond."""
    return round(statistics.median(values) * 1e3, 3)


def check_idle(engine: LLMEngine, label: str) -> None:
    if engine.has_unfinished:
        raise RuntimeError(f"{label}: the engine still has requests from an earlier pass")


def decode_pass(engine: LLMEngine, label: str, prompts: list[list[int]], steps: int,
                loras: Sequence[str | None] | None = None) -> DecodeTimes:
    """Prefill the batch, then time ``steps`` full decode steps (module docstring); aborts the batch."""
    check_idle(engine, label)
    adapters = list(loras) if loras is not None else [None] * len(prompts)
    distinct = len({name for name in adapters if name is not None})
    rids = [f"{label}-{i}" for i in range(len(prompts))]
    # A chunked prefill gives the first requests tokens while the last still prefill: each may run to the
    # end of its context, so none ends inside the timed steps (checked once the batch is decoding).
    max_tokens = engine.config.max_model_len - max(len(ids) for ids in prompts)
    t0 = time.perf_counter()
    for rid, ids, lora in zip(rids, prompts, adapters, strict=True):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, lora=lora)
        engine.add_request(rid, ids, params, prompt_token_ids=ids)
    try:
        produced = dict.fromkeys(rids, 0)
        max_prefill_steps = sum(len(ids) for ids in prompts)  # each step computes at least one prompt token
        for _ in range(max_prefill_steps):
            if all(produced.values()):
                break
            for d in engine.step():
                produced[d.request_id] += len(d.token_ids)
        else:
            raise RuntimeError(f"{label}: {sum(not n for n in produced.values())} requests had no token after "
                               f"{max_prefill_steps} steps")
        prefill_s = time.perf_counter() - t0
        if max(produced.values()) + steps >= max_tokens:
            raise RuntimeError(f"{label}: {steps} decode steps do not fit in max_model_len "
                               f"{engine.config.max_model_len} after the prefill")
        step_s: list[float] = []
        forward_s: list[float] = []
        for k in range(steps):
            f0, t0 = engine.forward_seconds_total, time.perf_counter()
            batch = engine.schedule()
            if batch is None:
                raise RuntimeError(f"{label}: decode step {k} scheduled nothing")
            deltas = engine.finish_step(batch, engine.execute(batch))
            step_s.append(time.perf_counter() - t0)
            forward_s.append(engine.forward_seconds_total - f0)
            slots = set(batch.lora.slots) if batch.lora.slots is not None else set()
            if not (batch.is_decode_only and batch.num_seqs == len(rids)):
                raise RuntimeError(f"{label}: decode step {k} ran {batch.num_seqs} sequences, "
                                   f"{batch.num_tokens} tokens; expected {len(rids)} decoding")
            if sorted(d.request_id for d in deltas) != sorted(rids) or any(len(d.token_ids) != 1 for d in deltas):
                raise RuntimeError(f"{label}: decode step {k} did not advance every sequence by one token")
            if len(slots) != distinct or batch.lora.loads:
                raise RuntimeError(f"{label}: decode step {k} ran slots {sorted(slots)} (expected {distinct} "
                                   f"distinct) and loads {batch.lora.loads}")
        return DecodeTimes(prefill_s, sum(len(ids) for ids in prompts), step_s, forward_s)
    finally:
        for rid in rids:
            engine.abort(rid)
