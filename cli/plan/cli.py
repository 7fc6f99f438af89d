"""``flotilla plan``: argument parsing and printing for the capacity planner.

Pure Python (argparse + json), so the command starts instantly. A user error
prints one line naming the flag at fault and exits with status 2, like
argparse's own errors; it never shows a traceback.

``--json`` prints :meth:`PlanReport.to_dict`. Besides the model, the parameter
breakdown (``params``: embedding, attention, mlp, norms, lm_head, qk_norms,
router, shared_experts, experts, active_experts), weights, KV, fit table and
cost, it holds ``num_params`` / ``total_params`` (all parameters),
``active_params`` (per token; equal for dense models), ``kv_bytes_per_token``
(every layer x the whole context: what flotilla allocates),
``kv_bytes_per_token_window_aware`` and ``kv_bytes_window_aware`` (if
out-of-window KV of sliding-window layers were dropped, at ``--context``),
``expected_experts_per_layer`` / ``_batch1`` (distinct routed experts a
decode step touches per MoE layer) and ``decode_bytes_per_step`` / ``_batch1``
(bytes one decode step reads: weights, touched experts, KV; see ``cli.plan.planner``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from cli.plan.hardware import (
    DTYPE_BITS,
    GPUS,
    MODELS,
    ModelArch,
    get_gpu,
    get_model,
    load_hf_config,
    read_json_file,
)
from cli.plan.planner import (
    KV_DTYPES,
    TP_DEGREES,
    PlanReport,
    default_kv_dtype,
    kv_bytes_per_token,
    plan,
)
from scheduling.errors import InvalidParameterError

_GB, _GIB = 1e9, 2**30


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``plan`` subcommand on ``subparsers`` (from ``add_subparsers``)."""
    p = subparsers.add_parser(
        "plan", help="capacity planner: weights, KV cache, TP degree and cost",
        description="Estimate weight and KV-cache memory, the smallest tensor-parallel degree "
        "that fits, the concurrent sequences per degree, and the cost per 1M output tokens. "
        "Without --gpu or --gpu-memory-gb only weights and KV cache are shown. "
        "Sizes are shown in GB (1e9 bytes) and GiB (2^30 bytes). "
        "Models: Llama, Mistral, Qwen2/Qwen3, Gemma 2/3, Phi-3 and mixtures of experts "
        "(Mixtral, Qwen3-MoE, Qwen2-MoE shared experts); for MoE both total and active "
        "(per token) parameters are shown. "
        "KV per token counts every layer for the whole context, which is what flotilla allocates "
        "even for sliding-window layers (one page table for all layers, prefix caching); the "
        "window-aware figure (windowed layers holding min(context, window) tokens) is shown "
        "beside it for comparison. Decode bytes per step: non-expert weights + the expected "
        "distinct experts the batch touches per MoE layer, E(1-(1-k/E)^batch), + batch x context "
        "x KV per token.")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--preset", metavar="NAME", help=f"model preset: {', '.join(MODELS)}")
    model.add_argument("--config", metavar="PATH",
                       help="a Hugging Face config.json, or a model folder holding one")
    gpu = p.add_mutually_exclusive_group()
    gpu.add_argument("--gpu", metavar="NAME",
                     help=f"GPU preset: {', '.join(GPUS)} (without a GPU: no fit table)")
    gpu.add_argument("--gpu-memory-gb", type=float, metavar="N", help="memory per GPU in GB (1e9 bytes)")
    p.add_argument("--dtype", choices=tuple(DTYPE_BITS), default="fp16", help="weight dtype (default fp16)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default=None,
                   help="KV-cache dtype (default: the weight dtype; fp16 for fp8/int8/int4 weights); "
                        "fp8 and int8 count the engine's bf16 scale per token and head")
    p.add_argument("--context", type=int, default=4096, metavar="N",
                   help="tokens per sequence, prompt and output (default 4096)")
    p.add_argument("--batch", type=int, default=1, metavar="N", help="concurrent sequences (default 1)")
    p.add_argument("--memory-fraction", type=float, default=0.9, metavar="F",
                   help="share of each GPU's memory for weights and KV (default 0.9)")
    p.add_argument("--tp", type=int, choices=TP_DEGREES, default=None,
                   help="TP degree to price (default: the smallest that fits)")
    p.add_argument("--price-per-hour", type=float, metavar="P", help="price of one GPU for one hour")
    tput = p.add_mutually_exclusive_group()
    tput.add_argument("--throughput", type=float, metavar="TOK_S", help="output tokens per second")
    tput.add_argument("--bench-json", metavar="PATH",
                      help='JSON with "output_tok_per_s", e.g. from `flotilla bench offline`')
    p.add_argument("--json", action="store_true",
                   help="print the report as JSON: every figure above, incl. total_params, active_params, "
                        "kv_bytes_per_token (allocated), kv_bytes_per_token_window_aware, "
                        "expected_experts_per_layer, decode_bytes_per_step and decode_bytes_per_step_batch1")
    w = p.add_argument_group("workload sizing by simulation (docs/fleet.md; prints JSON)")
    w.add_argument("--workload", metavar="SPEC",
                   help="prompt_tokens=N,output_tokens=M,rate=R, or a trace (JSONL path or simulate generator)")
    w.add_argument("--slo", metavar="SPEC", default="ttft_p95_ms=2000,tpot_p95_ms=100",
                   help="ttft_p95_ms=..,tpot_p95_ms=.. (default 2000 and 100)")
    w.add_argument("--profile", metavar="PATH",
                   help="a step profile (flotilla bench profile); default: the roofline of the model on --gpu")
    w.add_argument("--max-gpus", type=int, default=64, metavar="N", help="the GPU budget searched (default 64)")
    w.add_argument("--minutes", type=float, default=2.0, help="simulated minutes of a rate= workload (default 2)")
    w.add_argument("--kv-transfer-bytes-per-s", type=float, default=25e9,
                   help="prefill-to-decode KV link (default 25e9)")
    p.set_defaults(func=run_plan)
    return p


def run_workload(args: argparse.Namespace) -> dict[str, Any]:
    """``--workload``: the sizing of ``cli.plan.workload`` (which imports the simulator, and with it torch
    and the scheduler: imported here so that the memory plan above starts instantly)."""
    from cli.plan.workload import parse_slo, plan_workload
    from cli.simulate.fleet import Disaggregation
    from cli.simulate.profile import load_profile, roofline_profile

    tp = args.tp or 1
    if args.profile is not None:
        profile = load_profile(args.profile)
    else:
        if args.gpu is None or (args.preset is None and args.config is None):
            raise InvalidParameterError("workload", "needs --profile, or --gpu with --preset or --config")
        profile = roofline_profile(_model(args), args.gpu, tp=tp, dtype=args.dtype)
    kv = None  # a roofline profile knows its KV bytes per token; a measured one learns them from the model
    if args.profile is not None and (args.preset is not None or args.config is not None):
        kv = kv_bytes_per_token(_model(args), args.kv_dtype or default_kv_dtype(args.dtype))
    pd = Disaggregation(kv_transfer_bytes_per_s=args.kv_transfer_bytes_per_s, remote_prefill_min_tokens=0,
                        kv_bytes_per_token=kv)
    return plan_workload(profile, args.workload, parse_slo(args.slo), max_gpus=args.max_gpus, tp=tp,
                         minutes=args.minutes, price_per_hour=args.price_per_hour, disaggregation=pd)


def read_bench_throughput(path: str) -> float:
    """``output_tok_per_s`` from a JSON file such as ``flotilla bench offline`` prints."""
    data = read_json_file(path, "bench_json")
    value = data.get("output_tok_per_s") if isinstance(data, dict) else None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise InvalidParameterError("bench_json", f'{path} has no positive "output_tok_per_s" number')
    return float(value)


def _model(args: argparse.Namespace) -> ModelArch:
    return get_model(args.preset) if args.preset is not None else load_hf_config(args.config)


def _gpu(args: argparse.Namespace) -> tuple[str | None, int | None]:
    if args.gpu is not None:
        spec = get_gpu(args.gpu)
        return spec.name, spec.memory_bytes
    gb = args.gpu_memory_gb
    if gb is None:
        return None, None  # KV and weight arithmetic only
    if not (gb > 0 and math.isfinite(gb)):
        raise InvalidParameterError("gpu_memory_gb", f"must be a positive number, got {gb!r}")
    return f"{gb:g} GB GPU", int(gb * _GB)


def _throughput(args: argparse.Namespace) -> float | None:
    if args.bench_json is not None:
        return read_bench_throughput(args.bench_json)
    value: float | None = args.throughput
    if args.price_per_hour is not None and value is None:
        raise InvalidParameterError("price_per_hour", "the cost needs --throughput or --bench-json too")
    if value is not None and args.price_per_hour is None:
        raise InvalidParameterError("throughput", "the cost needs --price-per-hour too")
    return value


def build_report(args: argparse.Namespace) -> PlanReport:
    """Turn parsed arguments into a report; raises InvalidParameterError."""
    throughput = _throughput(args)
    if args.bench_json is not None and args.price_per_hour is None:
        raise InvalidParameterError("bench_json", "the cost needs --price-per-hour too")
    gpu_name, gpu_bytes = _gpu(args)
    return plan(_model(args), gpu_name=gpu_name, gpu_memory_bytes=gpu_bytes, dtype=args.dtype,
                kv_dtype=args.kv_dtype, context=args.context, batch=args.batch,
                memory_fraction=args.memory_fraction, price_per_hour=args.price_per_hour,
                throughput=throughput, tp=args.tp)


def run_plan(args: argparse.Namespace) -> int:
    """Handler of ``flotilla plan``: print the report; 2 on a user error."""
    try:
        if args.workload is not None:
            print(json.dumps(run_workload(args)))
            return 0
        if args.preset is None and args.config is None:
            raise InvalidParameterError("preset", "give a model: --preset NAME or --config PATH")
        report = build_report(args)
    except InvalidParameterError as exc:
        flag = "--" + exc.param.replace("_", "-")
        print(f"flotilla plan: error: {flag}: {exc.message}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_report(report))
    return 0


def _size(num_bytes: float) -> str:
    return f"{num_bytes / _GB:,.2f} GB / {num_bytes / _GIB:,.2f} GiB"


def _billions(n: int) -> str:
    """A parameter count in billions, or in millions when that would show 0.0xx B (norms, routers)."""
    return f"{n / 1e9:.3f} B" if n >= 10**8 or n == 0 else f"{n / 1e6:.3f} M"


def _fit_lines(r: PlanReport, gpu_memory_bytes: int, need: str) -> list[str]:
    """The GPU line, the per-TP table and the verdict."""
    lines = [
        f"GPU         {r.gpu_name}: {_size(gpu_memory_bytes)}, {r.memory_fraction:.0%} usable "
        f"= {_size(gpu_memory_bytes * r.memory_fraction)} per GPU",
        "",
        f"{'TP':>3}  {'usable (all ranks)':<24}{'weights per rank':<24}{'KV per rank':<24}"
        f"{'fits':<6}max seqs of {r.context:,}",
    ]
    for f in r.fits:
        lines.append(f"{f.tp:>3}  {_size(f.usable_bytes):<24}{_size(f.weight_bytes_per_rank):<24}"
                     f"{_size(f.kv_bytes_per_rank):<24}{'yes' if f.fits else 'no':<6}{f.max_num_seqs:,}")
    lines.append("")
    if r.tp is not None:
        lines.append(f"smallest TP: {r.tp} ({r.tp} x {r.gpu_name}) for weights + KV = {need}")
    else:
        top = r.fits[-1]
        lines.append(f"DOES NOT FIT even on {top.tp} x {r.gpu_name}: weights + KV = {need}, "
                     f"but {top.tp} GPUs give {_size(top.usable_bytes)}")
    return lines


def _model_line(m: ModelArch) -> str:
    extras = []
    if m.attention_bias:
        extras.append("q/k/v bias")
    if m.qk_norm:
        extras.append("q/k norm")
    if m.norms_per_layer != 2:
        extras.append(f"{m.norms_per_layer} norms per layer")
    if m.is_moe:
        moe = (f"MoE on {len(m.moe_layers)} layers: {m.num_experts} experts x MLP {m.moe_intermediate_size}, "
               f"top-{m.num_experts_per_tok}")
        if m.shared_expert_intermediate_size:
            moe += f", shared expert MLP {m.shared_expert_intermediate_size}"
        extras.append(moe)
    if m.num_sliding_layers:
        extras.append(f"sliding window {m.sliding_window:,} on {m.num_sliding_layers} of "
                      f"{m.num_layers} layers")
    mlp = f"MLP {m.intermediate_size}" if len(m.moe_layers) < m.num_layers else "no dense MLP"
    return (f"model       {m.name}: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads} heads, "
            f"{m.num_kv_heads} KV heads x head_dim {m.head_dim}, {mlp}, "
            f"vocab {m.vocab_size}, lm head {'tied' if m.tie_word_embeddings else 'untied'}"
            + "".join(f", {e}" for e in extras))


def _param_lines(r: PlanReport) -> list[str]:
    pc, m = r.params, r.model
    parts = [("embedding", pc.embedding), ("attention", pc.attention), ("MLP", pc.mlp),
             ("norms", pc.norms), ("lm head", pc.lm_head)]
    if m.is_moe and not pc.mlp:
        parts.pop(2)  # every layer is a MoE layer
    parts += [(name, n) for name, n in (("q/k norms", pc.qk_norms), ("router", pc.router),
                                        ("shared experts", pc.shared_experts), ("experts", pc.experts)) if n]
    breakdown = " + ".join(f"{name} {_billions(n)}" for name, n in parts)
    lines = [f"parameters  {pc.total / 1e9:.2f} B = {breakdown}"]
    if m.is_moe:
        lines.append(f"active      {pc.active / 1e9:.2f} B per token ({m.num_experts_per_tok} of "
                     f"{m.num_experts} experts: {_billions(pc.active_experts)} of {_billions(pc.experts)})")
    else:
        lines.append(f"active      {pc.active / 1e9:.2f} B per token (dense: all of them)")
    return lines


def _decode_lines(r: PlanReport) -> list[str]:
    at = f"at {r.context:,} tokens"
    lines = [f"decode      bytes read per step {at} (weights + touched experts + KV): "
             f"batch 1 {_size(r.decode_bytes_per_step_batch1)}"
             + (f", batch {r.batch} {_size(r.decode_bytes_per_step)}" if r.batch != 1 else "")]
    if r.model.is_moe:
        lines.append(f"            distinct experts per MoE layer: {r.expected_experts_per_layer_batch1:.1f} "
                     f"at batch 1" + (f", {r.expected_experts_per_layer:.1f} at batch {r.batch}"
                                       if r.batch != 1 else "")
                     + f" of {r.model.num_experts}")
    return lines


def format_report(r: PlanReport) -> str:
    """The human-readable report."""
    lines = [_model_line(r.model), *_param_lines(r)]
    for i, (dtype, size) in enumerate(r.weight_bytes_by_dtype.items()):
        mark = "   <- --dtype" if dtype == r.weight_dtype else ""
        lines.append(f"{'weights' if i == 0 else '':<12}{dtype:<5} {_size(size)}{mark}")
    lines += [
        f"KV cache    {r.kv_dtype}: {r.kv_bytes_per_token:,} B per token "
        f"({r.kv_bytes_per_token / 1e6:.3f} MB / {r.kv_bytes_per_token / 2**20:.3f} MiB)",
        f"            {r.context:,} tokens x {r.batch} sequences = {_size(r.kv_bytes)}",
    ]
    if r.model.num_sliding_layers:
        lines.append(f"            window-aware (out-of-window KV dropped; flotilla keeps it): "
                     f"{r.kv_bytes_per_token_window_aware:,} B per token, {_size(r.kv_bytes_window_aware)}")
    lines += _decode_lines(r)
    need = _size(r.weight_bytes + r.kv_bytes)
    if r.gpu_memory_bytes is None:
        lines += ["", f"weights + KV = {need}; no GPU given (--gpu or --gpu-memory-gb): no fit table"]
    else:
        lines += _fit_lines(r, r.gpu_memory_bytes, need)
    if r.cost is not None:
        c = r.cost
        gpus = f"{c.num_gpus} GPU{'s' if c.num_gpus > 1 else ''}"
        lines.append(f"cost        {c.price_per_hour:g} per GPU-hour x {gpus} at "
                     f"{c.throughput_tok_per_s:,.1f} output tok/s = "
                     f"{c.cost_per_million_tokens:.2f} per 1M output tokens")
    lines += [f"note: {note}" for note in r.notes]
    return "\n".join(lines)
