"""``flotilla bench moe``: offline throughput of a mixture-of-experts model against a dense model of the same
active parameters, both at batch 32 (``models`` says how the pair is made).

Both engines are loaded side by side (prefix caching off, ``max_num_seqs`` =
the batch). Each run, in alternating order so slow drifts of a shared host hit
both alike, and after one untimed warm-up pass each:

- **throughput**: ``batch`` greedy requests of ``prompt_len`` random token
  ids and ``max_tokens`` output tokens (ignore_eos) through ``LLM.generate``:
  output tok/s and total (prompt + output) tok/s;
- **steps** (``cli.bench.decode_steps``): the same prompts prefilled (prompt
  tok/s), then ``steps`` decode steps of the full batch, each timed; and
  ``steps`` decode steps of the first prompt alone (batch 1: a token's top-k
  experts are all a MoE layer reads, so there the two models read about the
  same bytes).

Reported: the medians over runs, their ratios (MoE / dense), and what
explains them, from ``flotilla plan``'s arithmetic on the two configs:
parameters (total and active), the experts one MoE layer is expected to read
at batch 1 and at the batch, and the bytes a decode step reads
(``cli.plan.planner.decode_bytes_per_step``). docs/models.md discusses the figures.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from apps.llm import LLM
from cli.bench.decode_steps import decode_pass, median_ms, random_prompts
from cli.bench.harness import OFFLINE_ENGINE_DEFAULTS, measure, offline_engine
from cli.bench.moe.models import PairShape, dense_config, ensure_model, moe_config, shape_dict
from cli.bench.stats import check_count, ratio
from cli.plan.hardware import model_from_hf_config
from cli.plan.planner import count_params, decode_bytes_per_step, expected_experts_touched
from scheduling.errors import InvalidParameterError
from scheduling.sampling_params import SamplingParams

MODELS = ("moe", "dense")
WARMUP_STEPS = 2
PLAN_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # torch's names -> the planner's


def _status(message: str) -> None:
    print(f"flotilla bench moe: {message}", file=sys.stderr, flush=True)



def _arithmetic(config: dict[str, Any], *, dtype: str, context: int, batch: int) -> dict[str, Any]:
    """The planner's figures for one config (module docstring)."""
    arch = model_from_hf_config(config)
    params = count_params(arch)
    experts = {f"batch{b}": round(expected_experts_touched(arch.num_experts, arch.num_experts_per_tok, b), 2)
               for b in (1, batch)}
    return {"total_params": params.total, "active_params": params.active,
            "expected_experts_per_layer": experts,
            **{key: decode_bytes_per_step(arch, dtype=dtype, kv_dtype=dtype, context=context, batch=b)
               for key, b in (("decode_bytes_per_step", batch), ("decode_bytes_per_step_batch1", 1))}}


def run(*, shape: PairShape, batch: int = 32, prompt_len: int = 64, max_tokens: int = 64, steps: int = 16,
        runs: int = 3, seed: int = 0, progress: bool = False, models_root: Path | None = None,
        **engine: Any) -> dict[str, Any]:
    """The figures (module docstring); the models are written under ``models_root`` (default: the model cache)."""
    for name, value in (("batch", batch), ("prompt_len", prompt_len), ("max_tokens", max_tokens),
                        ("steps", steps), ("runs", runs)):
        check_count(name, value)
    if "max_num_seqs" in engine:
        raise InvalidParameterError("max_num_seqs", "is set by bench moe: the batch (--batch)")
    configs = {"moe": moe_config(shape), "dense": dense_config(shape)}
    _status("writing the seeded models (once; cached under the model cache)")
    folders = {name: ensure_model(config, seed, models_root) for name, config in configs.items()}
    context = prompt_len + max(max_tokens, steps + 2)
    options = {**OFFLINE_ENGINE_DEFAULTS, "max_model_len": max(context, 2 * prompt_len), **engine,
               "max_num_seqs": batch}
    prompts = random_prompts(batch, prompt_len, configs["moe"].vocab_size, seed)
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)] * batch
    per_run: dict[str, dict[str, list[float]]] = {m: {"output": [], "total": [], "prefill": [], "step": [],
                                                         "step1": []}
                                                 for m in MODELS}
    _status(f"loading {folders['moe']} and {folders['dense']}")
    with offline_engine({**options, "model": str(folders["moe"])}) as moe_llm, \
            offline_engine({**options, "model": str(folders["dense"])}) as dense_llm:
        llms: dict[str, LLM] = {"moe": moe_llm, "dense": dense_llm}
        for name, llm in llms.items():  # first-call costs, not counted
            decode_pass(llm.engine, f"warm-{name}", prompts, WARMUP_STEPS)
        with tqdm(total=runs * len(MODELS), desc="bench moe", unit="pass", disable=not progress) as bar:
            for r in range(runs):
                for name in MODELS if r % 2 == 0 else MODELS[::-1]:
                    llm, figures = llms[name], per_run[name]
                    timed = measure(llm, prompts, params, progress=False)
                    figures["output"].append(timed.tok_per_s)
                    figures["total"].append((timed.output_tokens + batch * prompt_len) / timed.seconds)
                    times = decode_pass(llm.engine, f"run{r}-{name}", prompts, steps)
                    figures["prefill"].append(times.prompt_tokens / times.prefill_s)
                    figures["step"].append(median_ms(times.step_s))
                    alone = decode_pass(llm.engine, f"run{r}-{name}-batch1", prompts[:1], steps)
                    figures["step1"].append(median_ms(alone.step_s))
                    bar.update(1)
                    if not progress:
                        _status(f"run {r + 1}/{runs} {name}: {timed.tok_per_s:.1f} output tok/s, "
                                f"decode step {figures['step'][-1]:.1f} ms")
        dtype = str(moe_llm.config.torch_dtype()).removeprefix("torch.")
        device = str(moe_llm.config.resolved_device())
    if dtype not in PLAN_DTYPES:
        raise InvalidParameterError("dtype", f"bench moe's arithmetic covers {', '.join(PLAN_DTYPES)}, not {dtype}")
    out: dict[str, Any] = {"batch": batch, "prompt_len": prompt_len, "max_tokens": max_tokens, "steps": steps,
                           "runs": runs, "device": device, "dtype": dtype, "shape": shape_dict(shape)}
    for name in MODELS:
        med = {k: statistics.median(v) for k, v in per_run[name].items()}
        out[name] = {"model": str(folders[name]),
                     "output_tok_per_s": round(med["output"], 1),
                     "total_tok_per_s": round(med["total"], 1),
                     "prefill_tok_per_s": round(med["prefill"], 1),
                     "decode_step_ms": round(med["step"], 3),
                     "decode_step_ms_batch1": round(med["step1"], 3),
                     **_arithmetic(configs[name].to_dict(), dtype=PLAN_DTYPES[dtype], context=context, batch=batch)}
    moe, dense = out["moe"], out["dense"]
    out["ratio_output_tok_per_s"] = ratio(moe["output_tok_per_s"], dense["output_tok_per_s"])
    out["ratio_prefill_tok_per_s"] = ratio(moe["prefill_tok_per_s"], dense["prefill_tok_per_s"])
    out["ratio_decode_step_ms"] = ratio(moe["decode_step_ms"], dense["decode_step_ms"])
    out["ratio_decode_bytes_per_step"] = ratio(moe["decode_bytes_per_step"], dense["decode_bytes_per_step"])
    out["ratio_decode_step_ms_batch1"] = ratio(moe["decode_step_ms_batch1"], dense["decode_step_ms_batch1"])
    out["ratio_decode_bytes_per_step_batch1"] = ratio(moe["decode_bytes_per_step_batch1"],
                                                      dense["decode_bytes_per_step_batch1"])
    out["ratio_total_params"] = ratio(moe["total_params"], dense["total_params"])
    out["ratio_active_params"] = ratio(moe["active_params"], dense["active_params"])
    return out
