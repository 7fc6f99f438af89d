"""``flotilla bench profile``: this machine's step-time model of one model, for ``flotilla simulate`` and ``plan``.

One offline engine (prefix caching off) runs, after a warm-up, steps of
known shapes, each timed whole (``schedule`` + ``execute`` + ``finish_step``,
as ``LLMEngine.step`` runs them; ``cli.bench.decode_steps``):

- **prefill**: one prompt of ``T`` tokens for each ``T`` in ``prefill_tokens``,
  computed in one step (``T`` within ``max_num_batched_tokens``);
- **decode**: ``B`` sequences at context ``C`` for each ``B`` in
  ``decode_batches`` and ``C`` in ``decode_contexts``, the median of
  ``steps`` full-batch decode steps.

Each point is a ``StepShape`` and its seconds (the median over ``runs``);
``cli.simulate.profile.LinearProfile``'s six coefficients are fitted by
least squares, none negative (a coefficient the fit makes negative is
dropped and the rest refitted). The report holds the profile, every point
with the fit's prediction, and the fit's worst relative error.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from actors.engine.llm_engine import LLMEngine
from cli.bench.decode_steps import check_idle, decode_pass, random_prompts
from cli.bench.harness import OFFLINE_ENGINE_DEFAULTS, offline_engine
from cli.bench.stats import check_count
from cli.simulate.profile import Capacity, LinearProfile, StepShape
from scheduling.errors import InvalidParameterError
from scheduling.sampling_params import SamplingParams

PREFILL_TOKENS = (16, 64, 256, 1024, 2048)
DECODE_BATCHES = (1, 4, 16, 32, 64)
DECODE_CONTEXTS = (64, 512, 1536)
OFFLINE_STEPS = 8  # decode steps timed per shape: an offline step is the same from the first


def _status(message: str) -> None:
    print(f"flotilla bench profile: {message}", file=sys.stderr, flush=True)


def prefill_seconds(engine: LLMEngine, prompt: list[int], label: str) -> float:
    """One step computing the whole ``prompt``, timed whole; the request is then aborted."""
    check_idle(engine, label)
    engine.add_request(label, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                       prompt_token_ids=prompt)
    try:
        t0 = time.perf_counter()
        batch = engine.schedule()
        if batch is None or batch.num_tokens != len(prompt):
            raise RuntimeError(f"{label}: the prompt of {len(prompt)} tokens did not run in one step")
        engine.finish_step(batch, engine.execute(batch))
        return time.perf_counter() - t0
    finally:
        engine.abort(label)


def fit(points: list[tuple[StepShape, float]]) -> list[float]:
    """Non-negative least squares of (overhead, per token, per sequence, per prefill, per context token, per
    prefill pair),
    in relative error (each row divided by its time): steps range from milliseconds to seconds, and a plain fit
    would spend itself on the longest prefills and miss the short decode steps that dominate a serving run."""
    y = np.array([t for _, t in points])
    a = np.array([[1.0, s.tokens, s.seqs, s.prefills, s.context_tokens, s.prefill_pairs]
                  for s, _ in points]) / y[:, None]
    y = np.ones_like(y)
    keep = list(range(6))
    coef = np.zeros(6)
    while keep:
        sol, *_ = np.linalg.lstsq(a[:, keep], y, rcond=None)
        if (sol >= 0).all():
            coef[keep] = sol
            break
        keep.pop(int(np.argmin(sol)))  # the most negative coefficient explains nothing here: drop it
    return [float(c) for c in coef]


Shape = tuple[str, StepShape, list[list[int]]]  # a name, the step's shape, the prompts that make it


def check_settings(runs: int, steps: int) -> None:
    check_count("runs", runs)
    check_count("steps", steps)


def step_shapes(prefill_tokens: tuple[int, ...], decode_batches: tuple[int, ...], decode_contexts: tuple[int, ...],
                *, steps: int, vocab: int, seed: int) -> list[Shape]:
    """Every shape timed (module docstring), with seeded random prompts."""
    shapes: list[Shape] = []
    for t in prefill_tokens:
        shapes.append((f"prefill{t}", StepShape(t, 1, 1, t, t * t, t * t), random_prompts(1, t, vocab, seed + t)))
    for b in decode_batches:
        for c in decode_contexts:
            # A decode step of B sequences at context C attends B x C keys (the sequences grow by a few
            # tokens over the timed steps: the midpoint is used).
            ctx = c + steps // 2 + 1
            shapes.append((f"decode{b}x{c}", StepShape(b, b, 0, b * ctx, b * ctx, 0),
                           random_prompts(b, c, vocab, seed + 7919 * b + c)))
    return shapes


def report(shapes: list[Shape], times: dict[str, list[float]], capacity: Capacity, source: str, *, runs: int,
           steps: int, host_cores: float | None = None, host_share_per_waiting: float = 0.0) -> dict[str, Any]:
    """The fitted profile, every point beside its fit, and the worst relative error."""
    points = [(shape, statistics.median(times[name])) for name, shape, _ in shapes]
    c0, c_tok, c_seq, c_prefill, c_ctx, c_pair = fit(points)
    profile = LinearProfile(capacity, c0, c_tok, c_seq, c_prefill, c_ctx, c_pair, source=source,
                            host_cores=host_cores, host_share_per_waiting=host_share_per_waiting)
    rows = []
    worst = 0.0
    for (name, shape, _), (_, seconds) in zip(shapes, points, strict=True):
        predicted = profile.step_seconds(shape)
        worst = max(worst, abs(predicted - seconds) / seconds)
        rows.append({"shape": name, "tokens": shape.tokens, "seqs": shape.seqs,
                     "context_tokens": shape.context_tokens, "ms": round(seconds * 1e3, 3),
                     "fit_ms": round(predicted * 1e3, 3)})
    return {"profile": profile.to_dict(), "points": rows, "fit_max_rel_error": round(worst, 4), "runs": runs,
            "steps": steps}


def run(model: str, *, runs: int = 3, steps: int = OFFLINE_STEPS, seed: int = 0, progress: bool = False,
        prefill_tokens: tuple[int, ...] = PREFILL_TOKENS, decode_batches: tuple[int, ...] = DECODE_BATCHES,
        decode_contexts: tuple[int, ...] = DECODE_CONTEXTS, **engine: Any) -> dict[str, Any]:
    check_settings(runs, steps)
    need_len = max(max(prefill_tokens) + 2, max(decode_contexts) + steps + 4)
    options = {**OFFLINE_ENGINE_DEFAULTS, "max_num_seqs": max(decode_batches),
               "max_num_batched_tokens": max(max(prefill_tokens), max(decode_batches)), "max_model_len": need_len,
               **engine, "model": model}
    with offline_engine(options) as llm:
        eng = llm.engine
        cfg = eng.config
        if max(prefill_tokens) > cfg.max_num_batched_tokens:
            raise InvalidParameterError("max_num_batched_tokens", f"{cfg.max_num_batched_tokens} is below the "
                                                                  f"largest prefill, {max(prefill_tokens)}")
        shapes = step_shapes(prefill_tokens, decode_batches, decode_contexts, steps=steps, vocab=eng.vocab_size,
                             seed=seed)
        _status(f"{len(shapes)} shapes x {runs} runs on {model}")
        times: dict[str, list[float]] = {name: [] for name, _, _ in shapes}
        with tqdm(total=(runs + 1) * len(shapes), desc="bench profile", unit="shape", disable=not progress) as bar:
            for r in range(runs + 1):  # run 0 warms up and is not counted
                for name, _shape, prompts in shapes:
                    if name.startswith("prefill"):
                        seconds = prefill_seconds(eng, prompts[0], f"r{r}-{name}")
                    else:
                        seconds = statistics.median(decode_pass(eng, f"r{r}-{name}", prompts, steps).step_s)
                    if r:
                        times[name].append(seconds)
                    bar.update(1)
        cap = eng.executor.capacity
        capacity = Capacity(cap.num_pages, cap.page_size, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                            cfg.max_model_len)
        device = str(llm.config.resolved_device())
    return report(shapes, times, capacity, f"bench profile: {model} on {device}", runs=runs, steps=steps)
