#!/usr/bin/env python3
"""Batch-1 decode and prefill: flotilla vs llama.cpp on the same weights and threads, in one run.

The weights: the ``smollm2-135m`` preset's GGUF (Q4_1 blocks) is what
flotilla dequantizes to fp32 at load; ``llama-quantize --allow-requantize
... F32`` makes llama.cpp the same fp32 weights (``.bench/<preset>-f32.gguf``).
Each run: ``llama-bench -p P -n N -d P`` (prefill of P tokens; decode of N
tokens after P of context), then ``flotilla bench offline``'s ``batch1``
(one request of P prompt tokens, N generated, greedy; fp32), interleaved
run by run so machine noise hits both alike. Prints one JSON object: the CPU
model, every run, the medians and the ratios flotilla / llama.cpp.

``--gemv auto native torch`` runs flotilla once per value of ``FLOTILLA_GEMV``
in every run (default: ``auto`` alone): the kernel of its one- and two-row
float32 products chosen by timing, forced native (``kvcache/csrc/gemv.cpp``),
or forced ``F.linear`` (MKL). Each flotilla run records the kernel it used
(``cpu_gemv``); forcing native shows what a machine whose MKL is slow gets.

    make peer-llamacpp     # once: builds .peer-llamacpp (git-ignored)
    .venv/bin/python scripts/bench_batch1_vs_llamacpp.py --runs 3
    .venv/bin/python scripts/bench_batch1_vs_llamacpp.py --runs 3 --weights q4_1

``--weights q4_1``: llama.cpp runs the preset's own Q4_1 file and flotilla
runs ``--quantization int4``, which loads those Q4_1 blocks directly
(docs/quantization.md); ``--weights int8`` sets flotilla's int8 weights
beside llama.cpp's Q8_0 requantization of the same file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from actors.load.presets import preset_gguf_path

ROOT = Path(__file__).resolve().parent.parent


def _llama_env(peer: Path) -> dict[str, str]:
    """The peer's binaries find their shared libraries beside them."""
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(peer / "bin"), env.get("LD_LIBRARY_PATH")]))
    return env


def requantized_gguf(peer: Path, preset: str, qtype: str) -> Path:
    """The preset's weights as a ``qtype`` (``F32``, ``Q8_0``) GGUF for llama.cpp (made once)."""
    out = ROOT / ".bench" / f"{preset}-{qtype.lower()}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(peer / "bin" / "llama-quantize"), "--allow-requantize", str(preset_gguf_path(preset)),
                        str(out), qtype], check=True, capture_output=True, env=_llama_env(peer))
    return out


def llama_bench(peer: Path, gguf: Path, threads: int, prompt: int, gen: int) -> dict[str, float]:
    # --repack 0: on this VM llama.cpp's default repacks Q4 weights for its AMX backend, whose
    # first prompt dies in ggml_backend_amx_mul_mat (SIGSEGV at ldtilecfg: the tiles are not
    # usable here); decode alone does run repacked (docs/quantization.md has both figures).
    cmd = [str(peer / "bin" / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", str(prompt),
           "-n", str(gen), "-d", str(prompt), "-r", "3", "--repack", "0", "-o", "json"]
    rows = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, env=_llama_env(peer)).stdout)
    prefill = next(r["avg_ts"] for r in rows if r["n_prompt"])
    decode = next(r["avg_ts"] for r in rows if r["n_gen"])
    return {"prefill_tok_per_s": round(prefill, 1), "decode_tok_per_s": round(decode, 2)}


# --weights -> (flotilla's --quantization, what each engine runs)
WEIGHTS = {
    "fp32": (None, "fp32 (the preset's GGUF, dequantized; llama.cpp: llama-quantize F32)"),
    "q4_1": ("int4", "Q4_1 (llama.cpp: the preset's file; flotilla: --quantization int4 from its blocks)"),
    "int8": ("int8", "int8 (llama.cpp: llama-quantize Q8_0; flotilla: --quantization int8, per channel)"),
}


def llama_gguf(peer: Path, preset: str, weights: str) -> Path:
    if weights == "q4_1":
        return preset_gguf_path(preset)
    return requantized_gguf(peer, preset, "Q8_0" if weights == "int8" else "F32")


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (figures are only comparable on the same one)."""
    try:
        lines = Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines()
    except OSError:
        return platform.processor() or "unknown"
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown")


def flotilla_batch1(preset: str, threads: int, prompt: int, gen: int, quantization: str | None,
                    gemv: str) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.write(json.dumps({"prompt_token_ids": list(range(1000, 1000 + prompt)), "max_tokens": 2}) + "\n")
    try:
        cmd = [sys.executable, "-m", "cli.main", "bench", "offline", "--model", preset, "--workload", f.name,
               "--dtype", "float32", "--max-num-seqs", "4", "--max-model-len", str(prompt + gen + 64),
               "--cpu-threads", str(threads), "--batch1-prompt-len", str(prompt), "--batch1-tokens", str(gen)]
        if quantization is not None:
            cmd += ["--quantization", quantization]
        env = {**os.environ, "FLOTILLA_GEMV": gemv}
        proc = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT, env=env)
    finally:
        os.unlink(f.name)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    b1 = report["batch1"]
    return {"prefill_tok_per_s": b1["prefill_tok_per_s"], "decode_tok_per_s": b1["decode_tok_per_s"],
            "cpu_gemv": report.get("cpu_gemv")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="smollm2-135m")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--weights", choices=tuple(WEIGHTS), default="fp32")
    ap.add_argument("--peer", default=str(ROOT / ".peer-llamacpp"), help="llama.cpp built by make peer-llamacpp")
    ap.add_argument("--gemv", nargs="+", choices=("auto", "native", "torch"), default=["auto"],
                    help="FLOTILLA_GEMV values to run flotilla with, each in every run")
    args = ap.parse_args()
    peer = Path(args.peer)
    if not (peer / "bin" / "llama-bench").exists():
        print(f"no llama-bench under {peer}: run `make peer-llamacpp` first", file=sys.stderr)
        return 2
    gguf = llama_gguf(peer, args.preset, args.weights)
    quantization, description = WEIGHTS[args.weights]
    engines = ["llama.cpp"] + [f"flotilla:{mode}" for mode in args.gemv]
    runs: list[dict[str, Any]] = []
    for k in range(args.runs):
        run: dict[str, Any] = {"run": k, "llama.cpp": llama_bench(peer, gguf, args.threads, args.prompt, args.gen)}
        for mode in args.gemv:
            run[f"flotilla:{mode}"] = flotilla_batch1(args.preset, args.threads, args.prompt, args.gen,
                                                      quantization, mode)
        runs.append(run)
        print(json.dumps(run), file=sys.stderr, flush=True)
    keys = ("prefill_tok_per_s", "decode_tok_per_s")
    medians = {engine: {key: statistics.median(r[engine][key] for r in runs) for key in keys} for engine in engines}
    ratios = {engine: {key: round(medians[engine][key] / medians["llama.cpp"][key], 3) for key in keys}
              for engine in engines[1:]}
    print(json.dumps({"preset": args.preset, "weights": description, "cpu": cpu_model(),
                      "threads": args.threads, "prompt_tokens": args.prompt, "gen_tokens": args.gen,
                      "runs": runs, "median": medians, "over_llamacpp": ratios}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
