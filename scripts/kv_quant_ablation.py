#!/usr/bin/env python3
"""Which half of a quantized KV cache costs greedy agreement, and whether smoothing K helps.

An ablation for docs/quantization.md, on one engine in one process (float32
pages throughout): every K and V written to the pool is replaced by its int8
(or fp8) round trip through ``kvcache.kv_quant`` (per token and kv head,
exactly the stored values), for K only, V only, or both. The "smoothed" rows
first divide K per channel by ``s = a**alpha`` (``a``: each channel's
absolute maximum over a calibration pass on three other prompts, shared by
rotary channel pairs), quantize, and multiply back: what storing K / s and
reading it with q * s would give (QServe's SmoothAttention). Greedy outputs
are compared with the same engine's unquantized run on the workload.

    .venv/bin/python scripts/kv_quant_ablation.py .bench/quant/questions.jsonl --max-tokens 64

Prints one JSON object: greedy agreement per case.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch

from apps.llm import LLM
from cli.bench.workload import read_workload, workload_prompt_ids
from kvcache.attention import torch_paged as torch_attention
from kvcache.kv_quant import dequantize_kv, quantize_kv
from scheduling.sampling_params import SamplingParams

CALIBRATION = [
    "Describe the history of the printing press and its effect on Europe.",
    "List five tips for staying productive when working from home, with a sentence on each.",
    "Translate 'good morning, how are you?' into French, Spanish and German, and explain the grammar.",
]
ORIGINAL_WRITE = torch_attention.TorchPagedAttention._write


def _round_trip(x: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    q, scale = quantize_kv(x, kv_dtype)
    return dequantize_kv(q, scale, x.dtype)


def _patched(fn: Callable[..., None]) -> Any:
    class _Patch:
        def __enter__(self) -> None:
            torch_attention.TorchPagedAttention._write = fn  # type: ignore[method-assign]

        def __exit__(self, *exc: object) -> None:
            torch_attention.TorchPagedAttention._write = ORIGINAL_WRITE  # type: ignore[method-assign]

    return _Patch()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workload")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    reqs = read_workload(args.workload, chat=True)
    llm = LLM(args.model, enable_prefix_caching=False)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        prompts = workload_prompt_ids(reqs, llm.tokenizer)
        calib = workload_prompt_ids([{"messages": [{"role": "user", "content": c}]} for c in CALIBRATION],
                                    llm.tokenizer)

        def generate(ids: list[list[int]]) -> list[list[int]]:
            return [list(o.outputs[0].token_ids) for o in llm.generate(ids, [params] * len(ids), use_tqdm=False)]

        absmax: dict[int, torch.Tensor] = {}

        def record(self: Any, layer_id: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
            a = k.abs().amax(0)
            absmax[layer_id] = torch.maximum(absmax[layer_id], a) if layer_id in absmax else a
            ORIGINAL_WRITE(self, layer_id, k, v, slots)

        with _patched(record):
            generate(calib)
        base = generate(prompts)

        def smoothing(alpha: float) -> dict[int, torch.Tensor]:
            out = {}
            for layer, a in absmax.items():
                half = a.shape[-1] // 2
                pair = torch.maximum(a[:, :half], a[:, half:]).clamp_min(1e-6)
                s = torch.cat([pair, pair], -1) ** alpha
                out[layer] = s / s.mean(-1, keepdim=True)
            return out

        def agreement(kv_dtype: str, k: bool, v: bool, smooth: dict[int, torch.Tensor] | None = None) -> float:
            def write(self: Any, layer_id: int, kk: torch.Tensor, vv: torch.Tensor, slots: torch.Tensor) -> None:
                if k:
                    s = None if smooth is None else smooth[layer_id]
                    kk = _round_trip(kk, kv_dtype) if s is None else _round_trip(kk / s, kv_dtype) * s
                if v:
                    vv = _round_trip(vv, kv_dtype)
                ORIGINAL_WRITE(self, layer_id, kk, vv, slots)

            with _patched(write):
                got = generate(prompts)
            return round(sum(a == b for a, b in zip(base, got, strict=True)) / len(base), 4)

        result = {
            "model": args.model, "workload": args.workload, "requests": len(prompts), "max_tokens": args.max_tokens,
            "int8 K and V": agreement("int8", True, True),
            "int8 K only": agreement("int8", True, False),
            "int8 V only": agreement("int8", False, True),
            "int8, K smoothed alpha 0.5": agreement("int8", True, True, smoothing(0.5)),
            "int8, K smoothed alpha 1.0": agreement("int8", True, True, smoothing(1.0)),
            "fp8 K and V": agreement("fp8_e4m3", True, True),
        }
    finally:
        llm.shutdown()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
