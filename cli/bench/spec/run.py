"""``flotilla bench spec``: one workload without and with speculative decoding, in one process.

Two engines of the same model are built once: the baseline, and one with
``speculative_config``. Both warm up, then run the whole workload in turn,
baseline then spec, ``runs`` times (default 3): a pair runs seconds apart,
so slow drifts of a shared host hit both alike, and the medians (tok/s of
each side, and the median of the pairs' speedups) are what a noisy machine
can stand behind. Each run's figures are kept in ``runs``.

Every request is greedy, so speculation must not change a single token:
``same_tokens`` is True iff each request's output ids are identical between
the two engines in every run (greedy verification keeps exactly the target's
argmax; a False is a bug, not noise). Token-id lines run with ignore_eos as
``bench offline`` does (fixed work); chat lines stop at EOS, since real
replies and what a draft can copy from them are the point.

The acceptance figures are the spec engine's ``SchedulerStats`` counters,
summed over the measured runs (warm-up excluded): ``acceptance_rate`` is
accepted draft tokens over proposed ones, ``mean_accepted_tokens`` accepted
draft tokens per draft (one sequence's draft verified in one step; the bonus
token the target adds is not counted), ``acceptance_per_pos[i]`` the share
of drafts whose token i was accepted. All are 0.0 before any draft.

Both engines get the same KV pool: unless the pool size is given, the spec
engine takes the baseline's page count, and on a GPU the baseline takes 0.4
of free memory (not 0.9) so that the second engine still fits.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actors.config import EngineConfig
from apps.llm import LLM
from cli.bench.harness import WARMUP_REQUESTS, Pass, measure
from cli.bench.workload import is_chat, read_workload, workload_prompt_ids
from scheduling.errors import InvalidParameterError
from scheduling.sampling_params import SamplingParams
from scheduling.scheduler_stats import SchedulerStats
from scheduling.spec_config import SpeculativeConfig

GPU_KV_FRACTION = 0.4  # of free GPU memory, for the baseline's pool when none is given (module docstring)


@dataclass(frozen=True, slots=True)
class SpecCounters:
    """The speculation counters of ``SchedulerStats`` at one moment, or their change over a span."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: tuple[int, ...]

    @classmethod
    def of(cls, stats: SchedulerStats) -> SpecCounters:
        return cls(stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens,
                   tuple(stats.spec_num_accepted_tokens_per_pos))  # a copy: the list grows in place

    def since(self, before: SpecCounters) -> SpecCounters:
        """The counts added after ``before`` (``accepted_per_pos`` only grows, so pad ``before``)."""
        old = before.accepted_per_pos + (0,) * (len(self.accepted_per_pos) - len(before.accepted_per_pos))
        return SpecCounters(self.num_drafts - before.num_drafts, self.num_draft_tokens - before.num_draft_tokens,
                            self.num_accepted_tokens - before.num_accepted_tokens,
                            tuple(a - b for a, b in zip(self.accepted_per_pos, old, strict=True)))

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def figures(self) -> dict[str, Any]:
        """The report's acceptance fields; every ratio is 0.0 before any draft."""
        drafts = self.num_drafts
        return {
            "spec_num_drafts": drafts,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_tokens": round(self.num_accepted_tokens / drafts, 3) if drafts else 0.0,
            "acceptance_per_pos": [round(n / drafts, 4) if drafts else 0.0 for n in self.accepted_per_pos],
        }


def _build_engines(model: str, spec: SpeculativeConfig, engine: dict[str, Any]) -> tuple[LLM, LLM]:
    """The baseline and the spec engine, with KV pools of the same size (module docstring)."""
    base_kw = dict(engine)
    sized = base_kw.get("num_kv_pages") is not None or base_kw.get("kv_cache_memory_fraction") is not None
    if not sized and EngineConfig.from_kwargs(model=model, **engine).resolved_device().type == "cuda":
        base_kw["kv_cache_memory_fraction"] = GPU_KV_FRACTION
    baseline = LLM(model, **base_kw)
    spec_kw = dict(engine)
    if not sized:
        spec_kw["num_kv_pages"] = baseline.engine.executor.capacity.num_pages
    try:
        return baseline, LLM(model, speculative_config=spec, **spec_kw)
    except BaseException:
        baseline.shutdown()
        raise


def _run_figures(base: Pass, spec: Pass, acc: SpecCounters) -> dict[str, Any]:
    return {
        "baseline_output_tok_per_s": round(base.tok_per_s, 2), "spec_output_tok_per_s": round(spec.tok_per_s, 2),
        "speedup": round(spec.tok_per_s / base.tok_per_s, 3) if base.tok_per_s else 0.0,
        "baseline_seconds": round(base.seconds, 3), "spec_seconds": round(spec.seconds, 3),
        "baseline_output_tokens": base.output_tokens, "spec_output_tokens": spec.output_tokens,
        "baseline_engine_steps": base.engine_steps, "spec_engine_steps": spec.engine_steps,
        "same_tokens": base.token_ids == spec.token_ids,
        "acceptance_rate": round(acc.acceptance_rate, 4),
    }


def run(model: str, workload: str | Path, *, speculative_config: str | dict[str, Any] | SpeculativeConfig,
        runs: int = 3, progress: bool = False, **engine: Any) -> dict[str, Any]:
    """Run ``workload`` on both engines ``runs`` times, alternating; returns the JSON-ready result."""
    if not isinstance(runs, int) or isinstance(runs, bool) or runs < 1:
        raise InvalidParameterError("runs", f"must be an integer >= 1, got {runs!r}")
    spec_config = SpeculativeConfig.parse(speculative_config)  # refuse a bad config before loading a model
    if spec_config is None:
        raise InvalidParameterError("speculative_config", "is required (the config to compare against none)")
    reqs = read_workload(workload, chat=True)
    baseline, spec = _build_engines(model, spec_config, engine)
    try:
        prompts = workload_prompt_ids(reqs, baseline.tokenizer)
        params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=not is_chat(r))
                  for r in reqs]
        for llm in (baseline, spec):  # warm-up, as bench offline does; not counted
            llm.generate(prompts[:WARMUP_REQUESTS], params[:WARMUP_REQUESTS], use_tqdm=False)
        stats = spec.engine.policy.stats
        start = SpecCounters.of(stats)
        per_run = []
        for _ in range(runs):
            base_pass = measure(baseline, prompts, params, progress)
            before = SpecCounters.of(stats)
            spec_pass = measure(spec, prompts, params, progress)
            per_run.append(_run_figures(base_pass, spec_pass, SpecCounters.of(stats).since(before)))
        total = SpecCounters.of(stats).since(start)
        num_kv_pages = spec.engine.executor.capacity.num_pages
        max_num_seqs = baseline.config.max_num_seqs
    finally:
        baseline.shutdown()
        spec.shutdown()

    def median(key: str) -> float:
        return statistics.median(r[key] for r in per_run)

    def median_int(key: str) -> int:
        return int(statistics.median_low(r[key] for r in per_run))

    return {
        "workload": str(workload),
        "model": model,
        "requests": len(reqs),
        "max_num_seqs": max_num_seqs,
        "num_kv_pages": num_kv_pages,
        "speculative_config": spec_config.to_dict(),
        "num_runs": runs,
        "baseline_output_tok_per_s": round(median("baseline_output_tok_per_s"), 2),
        "spec_output_tok_per_s": round(median("spec_output_tok_per_s"), 2),
        "speedup": round(median("speedup"), 3),
        "baseline_output_tokens": median_int("baseline_output_tokens"),
        "spec_output_tokens": median_int("spec_output_tokens"),
        "baseline_engine_steps": median_int("baseline_engine_steps"),
        "spec_engine_steps": median_int("spec_engine_steps"),
        "same_tokens": all(r["same_tokens"] for r in per_run),
        **total.figures(),
        "runs": per_run,
    }


def format_table(result: dict[str, Any]) -> str:
    """A short table for a person (``--json`` prints the whole result instead)."""
    r = result
    lines = [
        f"{r['model']} on {r['workload']}: {r['requests']} requests, max_num_seqs {r['max_num_seqs']}, "
        f"median of {r['num_runs']} runs",
        f"{'':10}{'tok/s':>10}{'out tokens':>12}{'steps':>8}",
        f"{'baseline':10}{r['baseline_output_tok_per_s']:>10.1f}{r['baseline_output_tokens']:>12}"
        f"{r['baseline_engine_steps']:>8}",
        f"{'spec':10}{r['spec_output_tok_per_s']:>10.1f}{r['spec_output_tokens']:>12}{r['spec_engine_steps']:>8}",
        f"speedup {r['speedup']:.3f}x   acceptance_rate {r['acceptance_rate']:.3f}   "
        f"mean_accepted_tokens {r['mean_accepted_tokens']:.2f}   same_tokens {r['same_tokens']}",
        "per run speedup: " + ", ".join(f"{x['speedup']:.3f}" for x in r["runs"]),
    ]
    return "\n".join(lines)
