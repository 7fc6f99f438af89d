"""``flotilla bench structured overhead``: what constrained decoding adds to an engine step, in one process.

One engine, one batch of ``batch_size`` chat requests (default 32), the
prompts of the schema set in turn. Two runs of the same requests:

- *mixed* (A): every odd request is constrained by its schema
  (``response_format`` json_schema's ``StructuredOutput``), the others not;
- *unconstrained* (B): none is.

Every request is greedy with the same ``max_tokens``; the unconstrained ones
ignore EOS (a constrained one may not: its grammar ends it), so B's batch is
full until all end together. The constrained replies of the default schema
set are longer than the default ``max_tokens`` (32), so A's batch stays full
too; ``constrained_finished_early`` counts those that ended first anyway.

The fair comparison is per step, at equal batch: only *full* steps count,
decode-only steps with all ``batch_size`` sequences running (``full_steps``
per run). The loop drives the engine itself (``schedule``, ``execute``,
``finish_step``: what ``LLMEngine.step`` does) and times each step whole,
so the grammar's work on the critical path (filling masks before the
forward, advancing matchers after it) and the masks applied in the sampler
are all inside. A and B alternate ``runs`` times (default 3) after one
warm-up each (compiles the grammars); each figure is the median over runs
of the run's median over its full steps.

Figures: ``overhead_frac = (mixed_step_ms - unconstrained_step_ms) /
unconstrained_step_ms`` (the step's target is <= 0.10); ``grammar_ms_per_step``,
the engine's ``grammar_seconds_total`` added per full step of A (mask filling
and matcher advance); ``mask_apply_ms``, ``actors.grammar.masks.apply_token_masks``
alone on a (batch_size, vocab) logits tensor of the model's dtype and device
with the constrained rows masked (the sampler's share); each also as a
fraction of ``unconstrained_step_ms``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from actors.api import FinishReason
from actors.engine.llm_engine import LLMEngine
from actors.grammar.masks import apply_token_masks
from actors.tokenizing import chat_ids
from apps.llm import LLM
from cli.bench.harness import OFFLINE_ENGINE_DEFAULTS
from cli.bench.stats import median_of_known, ratio
from cli.bench.structured.schemas import SchemaCase
from scheduling.batch import TokenMasks
from scheduling.errors import InvalidParameterError
from scheduling.sampling_params import SamplingParams
from scheduling.structured_output import StructuredOutput

TARGET_FRAC = 0.10  # the step's acceptance: constrained decoding adds at most 10% to a mixed step
MASK_APPLY_REPS = 50


@dataclass(frozen=True, slots=True)
class StepSample:
    """One engine step as the loop saw it."""

    seconds: float
    grammar_seconds: float
    forward_seconds: float
    num_seqs: int
    decode_only: bool


@dataclass(frozen=True, slots=True)
class Workload:
    """The batch: prompt ids and both runs' params, aligned."""

    prompts: list[list[int]]
    mixed: list[SamplingParams]
    unconstrained: list[SamplingParams]

    @property
    def constrained_rows(self) -> list[int]:
        return [i for i, p in enumerate(self.mixed) if p.structured_output is not None]


def build_workload(cases: list[SchemaCase], tokenizer: Any, batch_size: int, max_tokens: int) -> Workload:
    """Request i asks case i % len(cases); odd requests are constrained in the mixed run."""
    picked = [cases[i % len(cases)] for i in range(batch_size)]
    prompts = [chat_ids(tokenizer, [{"role": "user", "content": c.prompt}]) for c in picked]
    free = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    mixed = [SamplingParams(max_tokens=max_tokens, temperature=0.0,
                            structured_output=StructuredOutput.json_schema(c.schema, param="schemas"))
             if i % 2 else free for i, c in enumerate(picked)]
    return Workload(prompts, mixed, [free] * batch_size)


def drive(engine: LLMEngine, label: str, prompts: list[list[int]], params: list[SamplingParams]
          ) -> tuple[list[StepSample], dict[str, FinishReason]]:
    """Add the batch, step until it ends; returns every step and each request's finish reason."""
    if engine.has_unfinished:
        raise RuntimeError("the overhead runs need an idle engine")
    for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"{label}-{i}", ids, p, prompt_token_ids=ids)
    # Each step computes at least one token of some request: a bound no healthy run reaches.
    max_steps = sum(len(ids) for ids in prompts) + sum(p.max_tokens for p in params) + 1
    steps: list[StepSample] = []
    reasons: dict[str, FinishReason] = {}
    while engine.has_unfinished:
        if len(steps) >= max_steps:
            raise RuntimeError(f"{label}: still unfinished after {max_steps} steps")
        g0, f0, t0 = engine.grammar_seconds_total, engine.forward_seconds_total, time.perf_counter()
        batch = engine.schedule()
        if batch is None:
            raise RuntimeError(f"{label}: the engine has work but scheduled nothing (too few KV pages?)")
        deltas = engine.finish_step(batch, engine.execute(batch))
        seconds = time.perf_counter() - t0
        steps.append(StepSample(seconds, engine.grammar_seconds_total - g0, engine.forward_seconds_total - f0,
                                batch.num_seqs, batch.is_decode_only))
        reasons.update({d.request_id: d.finish_reason for d in deltas if d.finish_reason is not None})
    return steps, reasons


def _ms(values: list[float]) -> float | None:
    return round(statistics.median(values) * 1e3, 4) if values else None


def run_figures(steps: list[StepSample], batch_size: int) -> dict[str, Any]:
    """Medians over the run's full steps (module docstring)."""
    full = [s for s in steps if s.decode_only and s.num_seqs == batch_size]
    return {
        "steps": len(steps),
        "full_steps": len(full),
        "step_ms": _ms([s.seconds for s in full]),
        "grammar_ms": _ms([s.grammar_seconds for s in full]),
        "forward_ms": _ms([s.forward_seconds for s in full]),
    }


def mask_apply_ms(llm: LLM, batch_size: int, rows: list[int]) -> float:
    """Median time of ``apply_token_masks`` on (batch_size, vocab) logits with ``rows`` masked."""
    device, dtype, vocab = llm.config.resolved_device(), llm.config.torch_dtype(), llm.engine.vocab_size
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(batch_size, vocab, generator=gen).to(device=device, dtype=dtype)
    words = torch.randint(-(2**31), 2**31, (len(rows), -(-vocab // 32)), generator=gen, dtype=torch.int64)
    masks = TokenMasks(rows, words.to(torch.int32))  # the bitmask stays on the CPU, as xgrammar fills it

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = []
    for k in range(MASK_APPLY_REPS + 1):  # the first call warms up and is not counted
        sync()
        t0 = time.perf_counter()
        apply_token_masks(logits, masks)
        sync()
        if k:
            times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e3, 4)


def _check(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidParameterError(name, f"must be an integer >= 1, got {value!r}")


def run(model: str, cases: list[SchemaCase], *, schema_set: str, batch_size: int = 32, max_tokens: int = 32,
        runs: int = 3, **engine: Any) -> dict[str, Any]:
    """Alternate the mixed and the unconstrained run ``runs`` times; returns the JSON-ready result."""
    for name, value in (("batch_size", batch_size), ("max_tokens", max_tokens), ("runs", runs)):
        _check(name, value)
    if batch_size < 2:
        raise InvalidParameterError("batch_size", f"must be >= 2 (half of it constrained), got {batch_size}")
    llm = LLM(model, **{**OFFLINE_ENGINE_DEFAULTS, "max_num_seqs": batch_size, **engine})
    try:
        work = build_workload(cases, llm.tokenizer, batch_size, max_tokens)
        eng = llm.engine
        drive(eng, "warm-mixed", work.prompts, work.mixed)  # compiles every grammar; not counted
        drive(eng, "warm-free", work.prompts, work.unconstrained)
        per_run: list[dict[str, Any]] = []
        early = 0
        for k in range(runs):
            a_steps, reasons = drive(eng, f"mixed{k}", work.prompts, work.mixed)
            b_steps, _ = drive(eng, f"free{k}", work.prompts, work.unconstrained)
            a, b = run_figures(a_steps, batch_size), run_figures(b_steps, batch_size)
            early_k = sum(reasons[f"mixed{k}-{i}"] is not FinishReason.LENGTH for i in work.constrained_rows)
            early += early_k
            per_run.append({"mixed": a, "unconstrained": b, "constrained_finished_early": early_k,
                            "engine_grammar_ms_per_step": round(sum(s.grammar_seconds for s in a_steps) * 1e3
                                                                / len(a_steps), 4),
                            "overhead_frac": ratio(None if a["step_ms"] is None or b["step_ms"] is None
                                                   else a["step_ms"] - b["step_ms"], b["step_ms"])})
        mask_ms = mask_apply_ms(llm, batch_size, work.constrained_rows)
        config = llm.config
    finally:
        llm.shutdown()

    def med(side: str, key: str) -> float | None:
        return median_of_known([r[side][key] for r in per_run])

    mixed_ms, free_ms = med("mixed", "step_ms"), med("unconstrained", "step_ms")
    overhead = ratio(None if mixed_ms is None or free_ms is None else mixed_ms - free_ms, free_ms)
    grammar_ms = med("mixed", "grammar_ms")
    return {
        "benchmark": "structured-overhead",
        "model": model,
        "device": str(config.resolved_device()),
        "dtype": str(config.torch_dtype()).removeprefix("torch."),
        "schema_set": schema_set,
        "batch_size": batch_size,
        "num_constrained": len(work.constrained_rows),
        "max_tokens": max_tokens,
        "num_runs": runs,
        "mixed_step_ms": mixed_ms,
        "unconstrained_step_ms": free_ms,
        "overhead_frac": overhead,
        "target_frac": TARGET_FRAC,
        "within_target": None if overhead is None else overhead <= TARGET_FRAC,
        "grammar_ms_per_step": grammar_ms,
        "grammar_frac": ratio(grammar_ms, free_ms),
        "engine_grammar_ms_per_step": median_of_known([r["engine_grammar_ms_per_step"] for r in per_run]),
        "mask_apply_ms": mask_ms,
        "mask_apply_frac": ratio(mask_ms, free_ms),
        "mixed_forward_ms": med("mixed", "forward_ms"),
        "unconstrained_forward_ms": med("unconstrained", "forward_ms"),
        "full_steps_mixed": int(statistics.median_low(r["mixed"]["full_steps"] for r in per_run)),
        "full_steps_unconstrained": int(statistics.median_low(r["unconstrained"]["full_steps"] for r in per_run)),
        "constrained_finished_early": early,
        "runs": per_run,
    }


def format_table(result: dict[str, Any]) -> str:
    """A short table for a person (``--json`` prints the whole result instead)."""
    r = result

    def cell(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    return "\n".join([
        f"{r['model']} ({r['device']}, {r['dtype']}): batch {r['batch_size']}, {r['num_constrained']} constrained "
        f"({r['schema_set']} schemas), max_tokens {r['max_tokens']}, median of {r['num_runs']} runs over full steps",
        f"{'':15}{'step ms':>10}{'forward ms':>12}{'full steps':>12}",
        f"{'mixed':15}{cell(r['mixed_step_ms'], '.3f'):>10}{cell(r['mixed_forward_ms'], '.3f'):>12}"
        f"{r['full_steps_mixed']:>12}",
        f"{'unconstrained':15}{cell(r['unconstrained_step_ms'], '.3f'):>10}"
        f"{cell(r['unconstrained_forward_ms'], '.3f'):>12}{r['full_steps_unconstrained']:>12}",
        f"overhead_frac {cell(r['overhead_frac'], '.4f')} (target <= {r['target_frac']}, within: {r['within_target']})",
        f"grammar {cell(r['grammar_ms_per_step'], '.3f')} ms/step ({cell(r['grammar_frac'], '.4f')} of the step)   "
        f"mask apply {cell(r['mask_apply_ms'], '.3f')} ms ({cell(r['mask_apply_frac'], '.4f')})   "
        f"constrained_finished_early {r['constrained_finished_early']}",
        "per run overhead_frac: " + ", ".join(cell(x["overhead_frac"], ".4f") for x in r["runs"]),
    ])
