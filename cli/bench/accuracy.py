"""``flotilla bench accuracy``: what a config change (a KV dtype, weight quantization) costs in accuracy.

One workload runs greedily on two engines of one process, one after the
other (the first is shut down and freed before the second is built): the
*base* config, and the base updated by ``against`` (``{"kv_cache_dtype":
"int8"}``, ``{"quantization": "int4"}``, ...). Options merge in this order:
engine defaults < this benchmark's defaults (``cli.bench.spec.OFFLINE_ENGINE_DEFAULTS``) < the
command-line flags < ``base`` < ``against``; a key that both a flag and
``base`` set is an error (which one was meant?).

Each engine, in this order:

1. warm-up (two requests), then the whole workload with default batching:
   ``output_tok_per_s`` (``cli.bench.spec``'s measurement);
2. ``batch1`` (``cli.bench.offline``): the workload's first prompt alone,
   ``batch1_tokens`` tokens; ``decode_speedup`` is against / base of its
   batch-1 decode tok/s;
3. the teacher-forced pass: prompt + the BASE engine's output through the
   engine's own model and paged attention, keeping the next-token logits at
   every output position (``teacher_forced_logits``). The attention reads
   K/V back from the pool, so a quantized KV dtype is measured. Last, because it
   overwrites pool pages that the prefix cache may still index: after it
   the engine only shuts down.

Figures: ``greedy_agreement`` is the share of requests whose output ids are
identical; ``divergences`` and ``base_min_margin_quantiles``
(``accuracy_divergence``) say where the others part and how close the base
itself was to another token there; ``mean_kl`` / ``max_kl`` are KL(base || against) of the full
next-token distributions (float64 log-softmax) over every output position
of every request. The base's float32 logits are held in memory until the
against engine has run (requests x tokens x vocab x 4 bytes: 20 x 64 tokens
of SmolLM2's 49152-token vocabulary are 250 MB).

KV pages at equal memory: each engine's pool is sized as usual (that drives
the throughput runs), but pools sized from free memory would differ with
whatever else the host does between the two builds. So ``kv_pages`` is what
a fixed budget of ``kv_budget_mib`` holds at the engine's own bytes per page
(``capacity.bytes / capacity.num_pages``, scales included): the ratio
reflects bytes per page alone. ``kv_pool_pages`` is the pool each engine
actually had.
"""

from __future__ import annotations

import gc
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from actors.engine_config import EngineConfig
from actors.executor import LocalExecutor
from actors.model_runner import ModelRunner
from apps.llm import LLM
from cli.bench.accuracy_divergence import divergences, margin_quantiles
from cli.bench.offline import batch1
from cli.bench.spec import OFFLINE_ENGINE_DEFAULTS, WARMUP_REQUESTS, Pass, measure
from cli.bench.workload import is_chat, read_workload, workload_prompt_ids
from kvcache.attention_backend import StepLayout
from scheduling.errors import InvalidParameterError
from scheduling.json_object import parse_json_object
from scheduling.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class Settings:
    """How each engine is measured (the same for both)."""

    kv_budget_bytes: int
    batch1_tokens: int
    progress: bool


def parse_options(value: str | dict[str, Any] | None, param: str) -> dict[str, Any]:
    """Engine options from a JSON object (or a dict); any other value is an error naming ``param``."""
    if value is None:
        return {}
    return parse_json_object(value, param, (f.name for f in fields(EngineConfig)), "engine option")


def _validated(options: dict[str, Any], param: str) -> EngineConfig:
    """The config ``options`` build; its own error is re-raised naming ``param`` (and the option)."""
    try:
        config = EngineConfig.from_kwargs(**options)
    except InvalidParameterError as e:
        raise InvalidParameterError(param, str(e)) from e
    if config.executor != "local":
        # The teacher-forced pass runs the engine's own model in this process.
        raise InvalidParameterError(param, f"executor must be 'local' here, got {config.executor!r}")
    return config


def engine_options(model: str, base: str | dict[str, Any] | None, against: str | dict[str, Any],
                   flags: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The base and against options (module docstring: the merge order), both validated."""
    base_opts, against_opts = parse_options(base, "base"), parse_options(against, "against")
    given = {"model": model, **flags}
    clash = sorted(set(given) & set(base_opts))
    if clash:
        raise InvalidParameterError("base", f"sets {clash}, also given on the command line: keep one")
    merged = {**OFFLINE_ENGINE_DEFAULTS, **given, **base_opts}
    _validated(merged, "base")
    updated = {**merged, **against_opts}
    _validated(updated, "against")
    return merged, updated


@contextmanager
def _engine(options: dict[str, Any]) -> Iterator[LLM]:
    """An engine that is shut down on exit (``run`` frees it before building the next)."""
    llm = LLM(**options)
    try:
        yield llm
    finally:
        llm.shutdown()


def _runner(llm: LLM) -> ModelRunner:
    executor = llm.engine.executor
    assert isinstance(executor, LocalExecutor), type(executor)  # _validated refused other executors
    return executor.runner


@torch.inference_mode()
def teacher_forced_logits(runner: ModelRunner, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Float32 logits (len(output), vocab) on the CPU: row i is the distribution that predicts output[i].

    One prefill of ``prompt + output[:-1]`` (the last output token predicts
    nothing we compare) into pool pages 0.. of ``runner``. It overwrites
    whatever those pages held, so the caller runs it only on an engine with
    no live request and never generates on that engine again (the prefix
    cache may index these pages): ``_teacher_forced`` checks the first,
    ``run`` shuts the engine down right after.
    """
    assert output, "every greedy request emits at least one token (max_tokens >= 1)"
    tokens = prompt + output[:-1]
    num_pages = -(-len(tokens) // runner.config.page_size)
    assert num_pages <= runner.capacity.num_pages, (num_pages, runner.capacity.num_pages)
    dev = runner.device
    runner.attn.plan(StepLayout([len(tokens)], [len(tokens)], [list(range(num_pages))]))
    hidden = runner.model(torch.tensor(tokens, dtype=torch.long, device=dev),
                          torch.arange(len(tokens), dtype=torch.long, device=dev), runner.attn)
    return runner.model.compute_logits(hidden[len(prompt) - 1:]).cpu()


def _teacher_forced(llm: LLM, label: str, prompts: list[list[int]], outputs: list[list[int]],
                    progress: bool) -> Iterator[torch.Tensor]:
    """Each request's teacher-forced logits along ``outputs``, in order (see ``teacher_forced_logits``)."""
    if llm.engine.has_unfinished:
        raise RuntimeError("the teacher-forced pass needs an idle engine (it writes into the KV pool)")
    runner = _runner(llm)
    for prompt, output in tqdm(list(zip(prompts, outputs, strict=True)), desc=f"{label} teacher-forced",
                               unit="req", disable=not progress):
        yield teacher_forced_logits(runner, prompt, output)


def kl_per_position(base_logits: torch.Tensor, against_logits: torch.Tensor) -> torch.Tensor:
    """KL(base || against) of each row's softmax, in float64: shape (rows,)."""
    if base_logits.shape != against_logits.shape:
        raise InvalidParameterError(
            "against", f"logits of shape {tuple(against_logits.shape)}, the base's are {tuple(base_logits.shape)} "
            "(a model with another vocabulary cannot be compared)")
    lp = torch.log_softmax(base_logits.double(), dim=-1)
    lq = torch.log_softmax(against_logits.double(), dim=-1)
    p = lp.exp()
    # Rows where base gives a token zero probability contribute 0 (0 * log 0 / q), not NaN.
    return torch.where(p > 0, p * (lp - lq), torch.zeros_like(p)).sum(dim=-1)


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"bench accuracy: {message}", file=sys.stderr, flush=True)


def _engine_figures(llm: LLM, label: str, prompts: list[list[int]], params: list[SamplingParams],
                    settings: Settings) -> tuple[Pass, dict[str, Any]]:
    """Steps 1 and 2 of the module docstring on one engine: its pass over the workload and its figures."""
    runner = _runner(llm)
    cap = runner.capacity
    assert cap.bytes % cap.num_pages == 0, (cap.bytes, cap.num_pages)
    per_page = cap.bytes // cap.num_pages
    if per_page > settings.kv_budget_bytes:
        raise InvalidParameterError(
            "kv_budget_mib", f"{settings.kv_budget_bytes} bytes hold no page of the {label} engine ({per_page} bytes)")
    _say(settings.progress, f"{label}: warm-up, then {len(prompts)} requests")
    llm.generate(prompts[:WARMUP_REQUESTS], params[:WARMUP_REQUESTS], use_tqdm=False)
    measured = measure(llm, prompts, params, settings.progress)
    one: dict[str, Any] | None = None
    if settings.batch1_tokens > 0:
        _say(settings.progress, f"{label}: batch-1 decode, {settings.batch1_tokens} tokens")
        one = batch1(llm, prompts[0], settings.batch1_tokens)
    return measured, {
        "output_tok_per_s": round(measured.tok_per_s, 2),
        "seconds": round(measured.seconds, 3),
        "output_tokens": measured.output_tokens,
        "decode_tok_per_s": None if one is None else one["decode_tok_per_s"],
        "prefill_tok_per_s": None if one is None else one["prefill_tok_per_s"],
        "kv_bytes_per_page": per_page,
        "kv_pages": settings.kv_budget_bytes // per_page,
        "kv_pool_pages": cap.num_pages,
        "weight_bytes": runner.model.weight_bytes(),
    }


def _ratio(num: float | int | None, den: float | int | None) -> float | None:
    return None if num is None or not den else round(num / den, 4)


def _run_base(options: dict[str, Any], reqs: list[dict[str, Any]], params: list[SamplingParams], settings: Settings
              ) -> tuple[list[list[int]], Pass, dict[str, Any], list[torch.Tensor]]:
    """The base engine: the prompts' ids (its tokenizer), its pass, figures and teacher-forced logits."""
    with _engine(options) as llm:
        prompts = workload_prompt_ids(reqs, llm.tokenizer)
        measured, figures = _engine_figures(llm, "base", prompts, params, settings)
        logits = list(_teacher_forced(llm, "base", prompts, measured.token_ids, settings.progress))
    return prompts, measured, figures, logits


def _run_against(options: dict[str, Any], prompts: list[list[int]], params: list[SamplingParams],
                 outputs: list[list[int]], base_logits: list[torch.Tensor], settings: Settings
                 ) -> tuple[Pass, dict[str, Any], torch.Tensor]:
    """The against engine: its pass, figures, and the KL to ``base_logits`` at each base output position."""
    with _engine(options) as llm:
        measured, figures = _engine_figures(llm, "against", prompts, params, settings)
        forced = _teacher_forced(llm, "against", prompts, outputs, settings.progress)
        kl = torch.cat([kl_per_position(b, a) for b, a in zip(base_logits, forced, strict=True)])
    return measured, figures, kl


def run(model: str, workload: str | Path, *, against: str | dict[str, Any], base: str | dict[str, Any] | None = None,
        kv_budget_mib: int, batch1_tokens: int = 64, progress: bool = False, max_tokens: int | None = None,
        **flags: Any) -> dict[str, Any]:
    """Run ``workload`` on the base and the against engine; returns the JSON-ready result.

    ``flags`` are engine options given on the command line (module docstring: the merge order).
    ``max_tokens`` caps every request's own.
    """
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise InvalidParameterError("max_tokens", f"must be an integer >= 1, got {max_tokens!r}")
    if not isinstance(kv_budget_mib, int) or isinstance(kv_budget_mib, bool) or kv_budget_mib < 1:
        raise InvalidParameterError("kv_budget_mib", f"must be an integer >= 1, got {kv_budget_mib!r}")
    if not isinstance(batch1_tokens, int) or isinstance(batch1_tokens, bool) or batch1_tokens < 0:
        raise InvalidParameterError("batch1_tokens", f"must be an integer >= 0, got {batch1_tokens!r}")
    base_opts, against_opts = engine_options(model, base, against, flags)  # refuse before loading a model
    reqs = read_workload(workload, chat=True)
    cap = max_tokens or max(r["max_tokens"] for r in reqs)
    params = [SamplingParams(max_tokens=min(r["max_tokens"], cap), temperature=0.0, ignore_eos=not is_chat(r))
              for r in reqs]
    settings = Settings(kv_budget_mib * 2**20, batch1_tokens, progress)

    prompts, base_pass, base_figs, base_logits = _run_base(base_opts, reqs, params, settings)
    # The base engine went with _run_base's frame; collect any cycle so its memory is back first.
    gc.collect()
    torch.cuda.empty_cache()  # a no-op unless CUDA was initialised
    against_pass, against_figs, kl = _run_against(against_opts, prompts, params, base_pass.token_ids, base_logits,
                                                  settings)
    same = sum(a == b for a, b in zip(base_pass.token_ids, against_pass.token_ids, strict=True))
    parted = divergences(base_pass.token_ids, against_pass.token_ids, base_logits)
    return {
        "model": model,
        "workload": str(workload),
        "requests": len(reqs),
        "prompt_tokens": sum(len(p) for p in prompts),
        "output_tokens": base_pass.output_tokens,
        "base_config": base_opts,
        "against_config": against_opts,
        "kv_budget_mib": kv_budget_mib,
        "max_tokens": cap,
        "greedy_agreement": round(same / len(reqs), 4),
        "mean_kl": float(kl.mean()),
        "max_kl": float(kl.max()),
        "divergences": parted,
        "base_min_margin_quantiles": margin_quantiles(base_logits),
        "kv_pages_ratio": _ratio(against_figs["kv_pages"], base_figs["kv_pages"]),
        "decode_speedup": _ratio(against_figs["decode_tok_per_s"], base_figs["decode_tok_per_s"]),
        "output_tok_per_s_ratio": _ratio(against_figs["output_tok_per_s"], base_figs["output_tok_per_s"]),
        "base": base_figs,
        "against": against_figs,
    }


def format_table(result: dict[str, Any]) -> str:
    """A short table for a person (``--json`` prints the whole result instead)."""
    r, b, a = result, result["base"], result["against"]
    changed = {k: v for k, v in r["against_config"].items() if r["base_config"].get(k, object()) != v}

    def row(name: str, key: str, fmt: str) -> str:
        cells = [format(x[key], fmt) if x[key] is not None else "-" for x in (b, a)]
        return f"{name:22}{cells[0]:>14}{cells[1]:>14}"

    return "\n".join([
        f"{r['model']} on {r['workload']}: {r['requests']} requests, {r['output_tokens']} base output tokens; "
        f"against {json.dumps(changed)}",
        f"{'':22}{'base':>14}{'against':>14}",
        row("output tok/s", "output_tok_per_s", ".1f"),
        row("batch-1 decode tok/s", "decode_tok_per_s", ".1f"),
        row("KV bytes per page", "kv_bytes_per_page", "d"),
        row(f"KV pages in {r['kv_budget_mib']} MiB", "kv_pages", "d"),
        row("weight bytes", "weight_bytes", "d"),
        f"greedy_agreement {r['greedy_agreement']:.3f}   mean_kl {r['mean_kl']:.3e}   max_kl {r['max_kl']:.3e}"
        f"   (over {r['output_tokens']} positions)",
        f"outputs part at base top-2 gaps {sorted(d['base_margin'] for d in r['divergences'] if d['base_margin'] is not None)}"
        f"; smallest gap per request {r['base_min_margin_quantiles']}",
        f"kv_pages_ratio {r['kv_pages_ratio']}   decode_speedup {r['decode_speedup']}"
        f"   output_tok_per_s_ratio {r['output_tok_per_s_ratio']}",
    ])
