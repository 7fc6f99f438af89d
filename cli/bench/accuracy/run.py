"""``flotilla bench accuracy``: what a config change (a KV dtype, weight quantization) costs in accuracy.

One workload runs greedily on two engines of one process, one after the
other (the first is shut down and freed before the second is built): the
*base* config, and the base updated by ``against`` (``{"kv_cache_dtype":
"int8"}``, ``{"quantization": "int4"}``, ...). Options merge in this order:
engine defaults < the offline benchmarks' (``cli.bench.harness.OFFLINE_ENGINE_DEFAULTS``) < the
command-line flags < ``base`` < ``against``; a key that both a flag and
``base`` set is an error (which one was meant?).

Each engine, in this order:

1. warm-up (two requests), then the whole workload with default batching:
   ``output_tok_per_s`` (``cli.bench.harness.measure``);
2. ``batch1`` (``cli.bench.harness``): the workload's first prompt alone,
   ``batch1_tokens`` tokens; ``decode_speedup`` is against / base of its
   batch-1 decode tok/s;
3. the teacher-forced pass: prompt + the BASE engine's output through the
   engine's own model and paged attention, keeping the next-token logits at
   every output position (``forced.teacher_forced_logits``). The
   attention reads K/V back from the pool, so a quantized KV dtype is
   measured (``forced`` says why one prefill suffices);
4. the held-out text (``--heldout``, default ``data/heldout_prose.txt``),
   teacher-forced window by window: each scored token's NLL and argmax.
   Steps 3 and 4 come last because they overwrite pool pages that the prefix
   cache may still index: after them the engine only shuts down.

Figures: ``greedy_agreement`` is the share of requests whose output ids are
identical; ``divergences`` and ``base_min_margin_quantiles``
(``divergence``) say where the others part and how close the base
itself was to another token there; ``mean_kl`` / ``max_kl`` are KL(base || against) of the full
next-token distributions (float64 log-softmax) over every output position
of every request; ``token_top1_agreement`` is the share of those positions
where both argmaxes agree (``token_top1_matches`` of them),
``perplexity_ratio`` the against engine's perplexity on the held-out text
over the base's (``forced``). The base's float32 logits are held
in memory until the against engine has run (requests x tokens x vocab x 4 bytes: 20 x 64 tokens
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
import sys
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from actors.config import EngineConfig
from actors.engine.executor import LocalExecutor
from actors.runner.model_runner import ModelRunner
from apps.llm import LLM
from cli.bench.accuracy.divergence import divergences, margin_quantiles
from cli.bench.accuracy.forced import (
    HELDOUT_PATH,
    HELDOUT_WINDOW,
    HeldoutScore,
    heldout_windows,
    kl_per_position,
    perplexity_ratio,
    read_heldout,
    score_heldout,
    teacher_forced_logits,
    top1_matches,
)
from cli.bench.harness import (
    OFFLINE_ENGINE_DEFAULTS,
    WARMUP_REQUESTS,
    Pass,
    batch1,
    measure,
    offline_engine,
)
from cli.bench.stats import ratio
from cli.bench.workload import is_chat, read_workload, workload_prompt_ids
from scheduling.errors import InvalidParameterError
from scheduling.json_object import parse_json_object
from scheduling.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class Settings:
    """How each engine is measured (the same for both)."""

    kv_budget_bytes: int
    batch1_tokens: int
    progress: bool
    heldout_text: str
    heldout_window: int


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


def _runner(llm: LLM) -> ModelRunner:
    executor = llm.engine.executor
    assert isinstance(executor, LocalExecutor), type(executor)  # _validated refused other executors
    return executor.runner


def _teacher_forced(llm: LLM, label: str, prompts: list[list[int]], outputs: list[list[int]],
                    progress: bool) -> Iterator[torch.Tensor]:
    """Each request's teacher-forced logits along ``outputs``, in order (see ``teacher_forced_logits``)."""
    if llm.engine.has_unfinished:
        raise RuntimeError("the teacher-forced pass needs an idle engine (it writes into the KV pool)")
    runner = _runner(llm)
    for prompt, output in tqdm(list(zip(prompts, outputs, strict=True)), desc=f"{label} teacher-forced",
                               unit="req", disable=not progress):
        yield teacher_forced_logits(runner, prompt, output)


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


@dataclass(frozen=True, slots=True)
class _Side:
    """What one engine's run leaves for the comparison."""

    measured: Pass
    figures: dict[str, Any]
    heldout: HeldoutScore


def _heldout(llm: LLM, label: str, windows: list[list[int]], progress: bool) -> HeldoutScore:
    _say(progress, f"{label}: held-out text, {sum(len(w) - 1 for w in windows)} tokens in {len(windows)} windows")
    return score_heldout(_runner(llm), windows)


def _run_base(options: dict[str, Any], reqs: list[dict[str, Any]], params: list[SamplingParams], settings: Settings
              ) -> tuple[list[list[int]], list[list[int]], _Side, list[torch.Tensor]]:
    """The base engine: the prompts' and held-out windows' ids (its tokenizer), its run and teacher-forced logits."""
    with offline_engine(options) as llm:
        prompts = workload_prompt_ids(reqs, llm.tokenizer)
        windows = heldout_windows(llm.tokenizer, settings.heldout_text, settings.heldout_window)
        measured, figures = _engine_figures(llm, "base", prompts, params, settings)
        logits = list(_teacher_forced(llm, "base", prompts, measured.token_ids, settings.progress))
        heldout = _heldout(llm, "base", windows, settings.progress)
    return prompts, windows, _Side(measured, figures, heldout), logits


def _run_against(options: dict[str, Any], prompts: list[list[int]], windows: list[list[int]],
                 params: list[SamplingParams], outputs: list[list[int]], base_logits: list[torch.Tensor],
                 settings: Settings) -> tuple[_Side, torch.Tensor, torch.Tensor]:
    """The against engine: its run, then per base output position the KL to ``base_logits`` and top-1 match."""
    kl, same = [], []
    with offline_engine(options) as llm:
        measured, figures = _engine_figures(llm, "against", prompts, params, settings)
        for b, a in zip(base_logits, _teacher_forced(llm, "against", prompts, outputs, settings.progress),
                        strict=True):
            kl.append(kl_per_position(b, a))
            same.append(top1_matches(b, a))
        heldout = _heldout(llm, "against", windows, settings.progress)
    return _Side(measured, figures, heldout), torch.cat(kl), torch.cat(same)


def run(model: str, workload: str | Path, *, against: str | dict[str, Any], base: str | dict[str, Any] | None = None,
        kv_budget_mib: int, batch1_tokens: int = 64, progress: bool = False, max_tokens: int | None = None,
        heldout: str | Path = HELDOUT_PATH, **flags: Any) -> dict[str, Any]:
    """Run ``workload`` on the base and the against engine; returns the JSON-ready result.

    ``flags`` are engine options given on the command line (module docstring: the merge order).
    ``max_tokens`` caps every request's own; ``heldout`` is the text of ``perplexity_ratio``.
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
    # One window size for both engines, so both score the same tokens.
    window = min(HELDOUT_WINDOW, *(_validated(o, p).max_model_len for o, p in ((base_opts, "base"),
                                                                                 (against_opts, "against"))))
    settings = Settings(kv_budget_mib * 2**20, batch1_tokens, progress, read_heldout(heldout), window)

    prompts, windows, base_side, base_logits = _run_base(base_opts, reqs, params, settings)
    base_pass, base_figs = base_side.measured, base_side.figures
    # The base engine went with _run_base's frame; collect any cycle so its memory is back first.
    gc.collect()
    torch.cuda.empty_cache()  # a no-op unless CUDA was initialised
    against_side, kl, top1 = _run_against(against_opts, prompts, windows, params, base_pass.token_ids, base_logits,
                                          settings)
    against_pass, against_figs = against_side.measured, against_side.figures
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
        # Unrounded, with its count: a threshold is never met by rounding.
        "token_top1_agreement": float(top1.double().mean()),
        "token_top1_matches": int(top1.sum()),
        "perplexity_ratio": perplexity_ratio(base_side.heldout, against_side.heldout),
        "heldout": {
            "path": str(heldout),
            "tokens": int(base_side.heldout.nll.numel()),
            "window": window,
            "base_perplexity": base_side.heldout.perplexity,
            "against_perplexity": against_side.heldout.perplexity,
            "top1_agreement": float((base_side.heldout.argmax == against_side.heldout.argmax).double().mean()),
        },
        "divergences": parted,
        "base_min_margin_quantiles": margin_quantiles(base_logits),
        "kv_pages_ratio": ratio(against_figs["kv_pages"], base_figs["kv_pages"]),
        "decode_speedup": ratio(against_figs["decode_tok_per_s"], base_figs["decode_tok_per_s"]),
        "output_tok_per_s_ratio": ratio(against_figs["output_tok_per_s"], base_figs["output_tok_per_s"]),
        "base": base_figs,
        "against": against_figs,
    }

