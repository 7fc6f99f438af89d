"""``flotilla plan``: argument parsing and printing for the capacity planner.

Pure Python (argparse + json), so the command starts instantly. A user error
prints one line naming the flag at fault and exits with status 2, like
argparse's own errors; it never shows a traceback.
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
from cli.plan.planner import KV_DTYPES, TP_DEGREES, PlanReport, plan
from scheduling.errors import InvalidParameterError

_GB, _GIB = 1e9, 2**30


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``plan`` subcommand on ``subparsers`` (from ``add_subparsers``)."""
    p = subparsers.add_parser(
        "plan", help="capacity planner: weights, KV cache, TP degree and cost",
        description="Estimate weight and KV-cache memory, the smallest tensor-parallel degree "
        "that fits, the concurrent sequences per degree, and the cost per 1M output tokens. "
        "Without --gpu or --gpu-memory-gb only weights and KV cache are shown. "
        "Sizes are shown in GB (1e9 bytes) and GiB (2^30 bytes).")
    model = p.add_mutually_exclusive_group(required=True)
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
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run_plan)
    return p


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
    return f"{n / 1e9:.3f} B"


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


def format_report(r: PlanReport) -> str:
    """The human-readable report."""
    m, pc = r.model, r.params
    lines = [
        f"model       {m.name}: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads} heads, "
        f"{m.num_kv_heads} KV heads x head_dim {m.head_dim}, MLP {m.intermediate_size}, "
        f"vocab {m.vocab_size}, lm head {'tied' if m.tie_word_embeddings else 'untied'}"
        + (", q/k/v bias" if m.attention_bias else ""),
        f"parameters  {pc.total / 1e9:.2f} B = embedding {_billions(pc.embedding)} + attention "
        f"{_billions(pc.attention)} + MLP {_billions(pc.mlp)} + norms {_billions(pc.norms)} + "
        f"lm head {_billions(pc.lm_head)}",
    ]
    for i, (dtype, size) in enumerate(r.weight_bytes_by_dtype.items()):
        mark = "   <- --dtype" if dtype == r.weight_dtype else ""
        lines.append(f"{'weights' if i == 0 else '':<12}{dtype:<5} {_size(size)}{mark}")
    lines += [
        f"KV cache    {r.kv_dtype}: {r.kv_bytes_per_token:,} B per token "
        f"({r.kv_bytes_per_token / 1e6:.3f} MB / {r.kv_bytes_per_token / 2**20:.3f} MiB)",
        f"            {r.context:,} tokens x {r.batch} sequences = {_size(r.kv_bytes)}",
    ]
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
