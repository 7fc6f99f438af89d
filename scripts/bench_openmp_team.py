"""One decode step with the model loaded on the forward's thread vs on another live thread.

Why it matters: see ``actors/remote/cpu_threads.py`` (one OpenMP team per process).
Each run is a fresh process, because OpenMP teams live as long as their
thread; modes alternate so the noise of a shared host falls on both alike.

    .venv/bin/python scripts/bench_openmp_team.py [--model small] [--threads 2] [--runs 3] [--steps 200]

Prints JSON: every run's median step time (ms) per mode, and their medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODES = ("forward_thread", "other_thread")


def one_run(model: str, mode: str, threads: int, steps: int) -> float:
    """Median decode-step time (ms) of one greedy sequence, the forward on a worker thread."""
    import torch

    from apps.llm import LLM
    from scheduling.sampling_params import SamplingParams

    pool = ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(threads,))
    torch.set_num_threads(threads)  # "other_thread": the main thread loads with a team of its own

    def load() -> LLM:
        return LLM(model=model, dtype="float32", max_num_seqs=8, max_model_len=2048, enable_prefix_caching=False)

    llm = pool.submit(load).result() if mode == "forward_thread" else load()

    def decode() -> float:
        engine = llm.engine
        engine.add_request("r0", [5, 6, 7, 8], SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True))
        times: list[float] = []
        while engine.has_unfinished:
            batch = engine.schedule()
            if batch is None:
                break
            start = time.perf_counter()
            output = engine.execute(batch)
            if batch.is_decode_only:
                times.append(time.perf_counter() - start)
            engine.finish_step(batch, output)
        return statistics.median(times) * 1000

    return pool.submit(decode).result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_run(args.model, args.child, args.threads, args.steps)))
        return
    runs: dict[str, list[float]] = {mode: [] for mode in MODES}
    for i in range(args.runs):
        for mode in MODES:
            cmd = [sys.executable, __file__, "--child", mode, "--model", args.model,
                   "--threads", str(args.threads), "--steps", str(args.steps)]
            out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True, timeout=900)
            runs[mode].append(round(float(out.stdout.strip().splitlines()[-1]), 2))
            print(f"run {i + 1}/{args.runs} {mode}: {runs[mode][-1]} ms per decode step", file=sys.stderr)
    report: dict[str, Any] = {
        "benchmark": "openmp_team", "model": args.model, "threads": args.threads, "steps": args.steps,
        "step_ms": runs, "median_step_ms": {mode: statistics.median(v) for mode, v in runs.items()},
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
