"""``flotilla bench lora``: what LoRA adapters add to a decode step, and throughput when adapters outnumber slots.

**Step overhead.** One engine with ``enable_lora``, ``max_loras`` 32 and
``max_num_seqs`` 32 serves 32 seeded random adapters (``adapters``: rank
``rank``, all seven projections, written to a temporary folder). A
*configuration* is a batch of ``BATCH_SIZE`` (32) greedy requests, each with
its own random prompt of ``context`` token ids: ``base`` (no adapter), or
``k`` distinct adapters for k in ``DISTINCT`` (1, 8, 32), request i on
adapter ``i % k``. A pass of one configuration adds the batch, steps the
engine until every request has its first token (the prefill, not timed),
then times ``steps`` decode steps of the full batch, each one checked:
decode-only, all 32 sequences, one token each, exactly ``k`` distinct slots
(none for ``base``) and no adapter written into a slot; then it aborts the
batch. The engine is stepped by hand (``schedule``, ``execute``,
``finish_step``: what ``LLMEngine.step`` does) and each step timed whole.

Base rows skip the LoRA work entirely (``actors.models.lora``), so ``base``
on the LoRA engine is the reference for the overhead; ``no_lora_engine``, the
same batch on a second engine without ``enable_lora``, shows what merely
enabling LoRA costs base requests. Every run passes through the
configurations in turn (``base``, ``1``, ``8``, ``32``, ``no_lora_engine``),
after one untimed warm-up of each, so slow drifts of a shared host hit them
alike; a run's figure is the median of its step times, the reported figure
the median over ``runs``. ``overhead_8 = lora_step_ms["8"] / base_step_ms``.

**Cycling.** Another engine with ``cycle.max_loras`` slots (4) serves
``cycle.adapters`` adapters (16, more than the slots) and runs
``cycle.requests`` requests (64) of ``cycle.prompt_len`` random tokens and
``cycle.max_tokens`` output tokens, request i on adapter ``i % adapters``,
then the same requests on the base model, ``cycle.runs`` times alternating
after a warm-up of two requests each. The scheduler admits in order, and a
request whose adapter finds every slot pinned by others waits, so the batch
holds requests of at most ``max_loras`` adapters: ``mean_seqs_per_step``
shows it. ``slot_loads`` counts the adapters written into slots (each
``Batch.lora.loads`` entry).
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from actors.config import EngineConfig
from actors.engine.llm_engine import LLMEngine
from actors.load.loader import resolve_model_path
from apps.llm import LLM
from cli.bench.decode_steps import check_idle, decode_pass, median_ms, random_prompts
from cli.bench.harness import OFFLINE_ENGINE_DEFAULTS, offline_engine
from cli.bench.lora.adapters import write_adapters
from cli.bench.lora.batch import BATCH_SIZE
from cli.bench.stats import check_count, median_of_known, ratio
from scheduling.errors import InvalidParameterError
from scheduling.sampling_params import SamplingParams

DISTINCT: tuple[int, ...] = (1, 8, 32)  # distinct adapters in the batch (the figures)
BASE, NO_LORA_ENGINE = "base", "no_lora_engine"
CONFIGS: tuple[str, ...] = (BASE, *(str(k) for k in DISTINCT), NO_LORA_ENGINE)
TARGET_OVERHEAD_8 = 1.3  # the step's acceptance: 8 distinct adapters at batch 32 within 1.3x the base step
WARMUP_STEPS = 2
CYCLE_WARMUP_REQUESTS = 2
SET_BY_BENCH = ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")


@dataclass(frozen=True, slots=True)
class CycleSettings:
    """The cycling workload (module docstring); ``max_cpu_loras`` None is the engine's default."""

    max_loras: int = 4
    max_cpu_loras: int | None = None
    adapters: int = 16
    requests: int = 64
    prompt_len: int = 16
    max_tokens: int = 16
    runs: int = 3


@dataclass(frozen=True, slots=True)
class CyclePass:
    """One timed run of the cycling workload."""

    seconds: float
    output_tokens: int
    steps: int
    seqs_in_steps: int
    slot_loads: int

    def figures(self) -> dict[str, Any]:
        return {"seconds": round(self.seconds, 3), "output_tokens": self.output_tokens,
                "output_tok_per_s": round(self.output_tokens / self.seconds, 2), "steps": self.steps,
                "mean_seqs_per_step": round(self.seqs_in_steps / self.steps, 2), "slot_loads": self.slot_loads}



def cycle_pass(engine: LLMEngine, label: str, prompts: list[list[int]], loras: list[str | None],
               max_tokens: int) -> CyclePass:
    """Run every request to its end, counting steps, sequences per step and slot loads."""
    check_idle(engine, label)
    t0 = time.perf_counter()
    for i, (ids, lora) in enumerate(zip(prompts, loras, strict=True)):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, lora=lora)
        engine.add_request(f"{label}-{i}", ids, params, prompt_token_ids=ids)
    # Each step computes at least one token of some request: a bound no healthy run reaches.
    max_steps = sum(len(ids) for ids in prompts) + max_tokens * len(prompts) + 1
    tokens = steps = seqs = loads = 0
    while engine.has_unfinished:
        if steps >= max_steps:
            raise RuntimeError(f"{label}: still unfinished after {max_steps} steps")
        batch = engine.schedule()
        if batch is None:
            raise RuntimeError(f"{label}: the engine has work but scheduled nothing (too few KV pages?)")
        deltas = engine.finish_step(batch, engine.execute(batch))
        steps += 1
        seqs += batch.num_seqs
        loads += len(batch.lora.loads or ())
        tokens += sum(len(d.token_ids) for d in deltas)
    seconds = time.perf_counter() - t0
    if tokens != max_tokens * len(prompts):
        raise RuntimeError(f"{label}: {tokens} output tokens, expected {max_tokens * len(prompts)}")
    return CyclePass(seconds, tokens, steps, seqs, loads)


def _engine_options(engine: dict[str, Any], context_needed: int) -> dict[str, Any]:
    """The options every engine of the run shares; the bench sets the LoRA ones itself."""
    given = [k for k in SET_BY_BENCH if k in engine]
    if given:
        raise InvalidParameterError(given[0], "is set by bench lora (see --rank and --cycle-*)")
    options = {**OFFLINE_ENGINE_DEFAULTS, "max_num_seqs": BATCH_SIZE, **engine}
    if options["max_num_seqs"] < BATCH_SIZE:
        raise InvalidParameterError("max_num_seqs", f"must be at least the batch, {BATCH_SIZE}")
    max_model_len = options.get("max_model_len", EngineConfig.max_model_len)
    if context_needed > max_model_len:
        raise InvalidParameterError("max_model_len", f"{max_model_len} is below the {context_needed} tokens "
                                                     "a request of the run needs")
    return options


def _status(message: str) -> None:
    print(f"flotilla bench lora: {message}", file=sys.stderr, flush=True)


def _step_overhead(options: dict[str, Any], adapters: list[Path], *, rank: int, runs: int, steps: int,
                   context: int, seed: int, progress: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every run's per-configuration medians (step ms, forward ms), and the LoRA engine's device and dtype."""
    lora_kw = {**options, "enable_lora": True, "max_loras": max(DISTINCT), "max_lora_rank": rank}
    _status(f"loading {len(adapters)} adapters into a LoRA engine, and a plain engine")
    with offline_engine(lora_kw) as lora_llm, offline_engine(dict(options)) as plain_llm:
        names = [f"a{i}" for i in range(len(adapters))]
        for name, path in zip(names, adapters, strict=True):
            lora_llm.load_lora(name, str(path))
        prompts = random_prompts(BATCH_SIZE, context, lora_llm.engine.vocab_size, seed)
        batches: dict[str, tuple[LLM, list[str | None]]] = {
            BASE: (lora_llm, [None] * BATCH_SIZE),
            **{str(k): (lora_llm, [names[i % k] for i in range(BATCH_SIZE)]) for k in DISTINCT},
            NO_LORA_ENGINE: (plain_llm, [None] * BATCH_SIZE),
        }
        for config, (llm, loras) in batches.items():  # warm-up: first-call costs and slot loads, not counted
            decode_pass(llm.engine, f"warm-{config}", prompts, WARMUP_STEPS, loras)
        per_run: list[dict[str, Any]] = []
        with tqdm(total=runs * len(CONFIGS), desc="bench lora steps", unit="pass", disable=not progress) as bar:
            for r in range(runs):
                figures: dict[str, Any] = {"step_ms": {}, "forward_ms": {}}
                for config, (llm, loras) in batches.items():
                    times = decode_pass(llm.engine, f"run{r}-{config}", prompts, steps, loras)
                    figures["step_ms"][config] = median_ms(times.step_s)
                    figures["forward_ms"][config] = median_ms(times.forward_s)
                    bar.update(1)
                per_run.append(figures)
                if not progress:
                    _status(f"run {r + 1}/{runs}: step ms {figures['step_ms']}")
        where = {"device": str(lora_llm.config.resolved_device()),
                 "dtype": str(lora_llm.config.torch_dtype()).removeprefix("torch.")}
    return per_run, where


def _cycling(options: dict[str, Any], adapters: list[Path], cycle: CycleSettings, *, rank: int, seed: int,
             progress: bool) -> dict[str, Any]:
    kw = {**options, "enable_lora": True, "max_loras": cycle.max_loras, "max_lora_rank": rank}
    if cycle.max_cpu_loras is not None:
        kw["max_cpu_loras"] = cycle.max_cpu_loras
    _status(f"cycling: {cycle.adapters} adapters over {cycle.max_loras} slots, {cycle.requests} requests")
    with offline_engine(kw) as llm:
        names = [f"c{i}" for i in range(cycle.adapters)]
        for name, path in zip(names, adapters, strict=True):
            llm.load_lora(name, str(path))
        engine = llm.engine
        prompts = random_prompts(cycle.requests, cycle.prompt_len, engine.vocab_size, seed + 1)
        lora_of: list[str | None] = [names[i % cycle.adapters] for i in range(cycle.requests)]
        base_of: list[str | None] = [None] * cycle.requests
        warm = CYCLE_WARMUP_REQUESTS
        cycle_pass(engine, "cycle-warm-lora", prompts[:warm], lora_of[:warm], cycle.max_tokens)
        cycle_pass(engine, "cycle-warm-base", prompts[:warm], base_of[:warm], cycle.max_tokens)
        per_run: list[dict[str, Any]] = []
        with tqdm(total=2 * cycle.runs, desc="bench lora cycling", unit="pass", disable=not progress) as bar:
            for r in range(cycle.runs):
                base = cycle_pass(engine, f"cycle{r}-base", prompts, base_of, cycle.max_tokens)
                bar.update(1)
                lora = cycle_pass(engine, f"cycle{r}-lora", prompts, lora_of, cycle.max_tokens)
                bar.update(1)
                per_run.append({"base": base.figures(), "lora": lora.figures(),
                                "tok_per_s_ratio": ratio(lora.output_tokens / lora.seconds,
                                                         base.output_tokens / base.seconds)})
        max_cpu_loras = llm.config.resolved_max_cpu_loras()

    def med(side: str, key: str) -> float | None:
        return median_of_known([r[side][key] for r in per_run])

    return {
        "max_loras": cycle.max_loras, "max_cpu_loras": max_cpu_loras, "adapters": cycle.adapters,
        "requests": cycle.requests, "prompt_len": cycle.prompt_len, "max_tokens": cycle.max_tokens,
        "runs": cycle.runs,
        "lora_output_tok_per_s": med("lora", "output_tok_per_s"),
        "base_output_tok_per_s": med("base", "output_tok_per_s"),
        "tok_per_s_ratio": median_of_known([r["tok_per_s_ratio"] for r in per_run]),
        "lora_slot_loads": med("lora", "slot_loads"),
        "lora_mean_seqs_per_step": med("lora", "mean_seqs_per_step"),
        "base_mean_seqs_per_step": med("base", "mean_seqs_per_step"),
        "lora_steps": med("lora", "steps"), "base_steps": med("base", "steps"),
        "per_run": per_run,
    }


def run(model: str, *, rank: int = 16, runs: int = 3, steps: int = 16, context: int = 128, seed: int = 0,
        cycle: CycleSettings | None = None, progress: bool = False, **engine: Any) -> dict[str, Any]:
    """Step overhead, then cycling (module docstring); returns the JSON-ready result."""
    cycle = cycle or CycleSettings()
    for name, value in (("rank", rank), ("runs", runs), ("steps", steps), ("context", context),
                        ("cycle_max_loras", cycle.max_loras), ("cycle_adapters", cycle.adapters),
                        ("cycle_requests", cycle.requests), ("cycle_prompt_len", cycle.prompt_len),
                        ("cycle_max_tokens", cycle.max_tokens), ("cycle_runs", cycle.runs)):
        check_count(name, value)
    if cycle.adapters <= cycle.max_loras:
        raise InvalidParameterError("cycle_adapters", f"must be above cycle_max_loras ({cycle.max_loras}) "
                                                      f"to cycle, got {cycle.adapters}")
    if cycle.requests < CYCLE_WARMUP_REQUESTS:
        raise InvalidParameterError("cycle_requests", f"must be at least {CYCLE_WARMUP_REQUESTS}")
    options = _engine_options(engine, max(context + steps + 2, cycle.prompt_len + cycle.max_tokens))
    model_dir = resolve_model_path(model)
    options["model"] = str(model_dir)  # the folder the adapters are shaped for
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="flotilla-bench-lora-") as tmp:
        count = max(max(DISTINCT), cycle.adapters)
        _status(f"writing {count} random rank-{rank} adapters of {model_dir.name}")
        adapters = write_adapters(model_dir, Path(tmp), count, rank=rank, seed=seed)
        per_run, where = _step_overhead(options, adapters[: max(DISTINCT)], rank=rank, runs=runs, steps=steps,
                                        context=context, seed=seed, progress=progress)
        cycling = _cycling(options, adapters[: cycle.adapters], cycle, rank=rank, seed=seed, progress=progress)

    def med(kind: str, config: str) -> float | None:
        return median_of_known([r[kind][config] for r in per_run])

    base = med("step_ms", BASE)
    lora = {str(k): med("step_ms", str(k)) for k in DISTINCT}
    no_lora = med("step_ms", NO_LORA_ENGINE)
    overhead = {k: ratio(v, base) for k, v in lora.items()}
    return {
        "benchmark": "lora",
        "model": model,
        **where,
        "base_step_ms": base,
        "lora_step_ms": lora,
        "overhead_8": overhead["8"],
        "overhead": overhead,
        "target_overhead_8": TARGET_OVERHEAD_8,
        "within_target": None if overhead["8"] is None else overhead["8"] <= TARGET_OVERHEAD_8,
        "base_step_ms_no_lora_engine": no_lora,
        "lora_engine_base_ratio": ratio(base, no_lora),
        "forward_ms": {config: med("forward_ms", config) for config in CONFIGS},
        "cycling": cycling,
        "settings": {"batch_size": BATCH_SIZE, "rank": rank, "targets": "all seven projections", "runs": runs,
                     "steps": steps, "context": context, "seed": seed, "engine": options},
        "per_run": per_run,
        "seconds": round(time.perf_counter() - started, 1),
    }


def format_table(result: dict[str, Any]) -> str:
    """A short table for a person (``--json`` prints the whole result instead)."""
    r, c, s = result, result["cycling"], result["settings"]
    base = r["base_step_ms"]
    rows = [f"{r['model']} ({r['device']}, {r['dtype']}): batch {s['batch_size']}, rank {s['rank']}, context "
            f"{s['context']}, median of {s['runs']} runs x {s['steps']} decode steps",
            f"{'':22}{'step ms':>10}{'x base':>9}{'forward ms':>12}",
            f"{'base (LoRA engine)':22}{base:>10.3f}{1.0:>9.3f}{r['forward_ms'][BASE]:>12.3f}"]
    for k, ms in r["lora_step_ms"].items():
        label = "1 adapter" if k == "1" else f"{k} distinct adapters"
        rows.append(f"{label:22}{ms:>10.3f}{r['overhead'][k]:>9.3f}{r['forward_ms'][k]:>12.3f}")
    rows += [f"{'base (no LoRA engine)':22}{r['base_step_ms_no_lora_engine']:>10.3f}"
             f"{r['base_step_ms_no_lora_engine'] / base:>9.3f}{r['forward_ms'][NO_LORA_ENGINE]:>12.3f}",
             f"overhead_8 {r['overhead_8']:.3f} (target <= {r['target_overhead_8']}, within: {r['within_target']})",
             f"cycling {c['adapters']} adapters over {c['max_loras']} slots, {c['requests']} requests x "
             f"{c['max_tokens']} tokens: {c['lora_output_tok_per_s']} tok/s against the base's "
             f"{c['base_output_tok_per_s']} (x{c['tok_per_s_ratio']}), {c['lora_slot_loads']} slot loads, "
             f"{c['lora_mean_seqs_per_step']} sequences a step (base {c['base_mean_seqs_per_step']})"]
    return "\n".join(rows)
