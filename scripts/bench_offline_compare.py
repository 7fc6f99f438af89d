#!/usr/bin/env python3
"""Side-by-side offline throughput: flotilla vs HF static batching vs vLLM's CPU build.

Every engine runs the same JSONL workload (``make_workload.py --seed 0``)
greedily with ignore_eos, in fp32, each in its own process, interleaved
run by run so that machine noise hits all of them alike. Prints one JSON
object with every run and the medians, then a Markdown table.

    .venv/bin/python scripts/bench_offline_compare.py --runs 3 --models tiny small smollm2-135m
    .venv/bin/python scripts/bench_offline_compare.py --runs 3 --models smollm2-135m --workload-kind chat

``--workload-kind chat`` replaces the random token ids with the ``chat``
dataset of ``flotilla bench serve`` (64 real-English chats), rendered through
each model's chat template into token ids, with ``max_tokens`` 64-256. The
peers run every workload with ignore_eos, so all engines still generate the
same number of tokens (past the model's end of turn).

Peers live in ../shared/peers; vLLM's CPU build in a venv made by
``make peer-vllm`` (git-ignored ``.peer-vllm``); without it vLLM is skipped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from actors.load.loader import load_tokenizer, resolve_model_path
from actors.tokenizing import chat_ids
from cli.bench.serve.datasets import DatasetConfig, build_requests

ROOT = Path(__file__).resolve().parent.parent


def _last_json(text: str) -> dict[str, Any]:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            result: dict[str, Any] = json.loads(line)
            return result
    raise RuntimeError(f"no JSON line in output:\n{text[-2000:]}")


def _run(cmd: list[str], timeout: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    out = _last_json(proc.stdout)
    out["wall_seconds"] = round(time.perf_counter() - t0, 1)
    return out


def _chat_workload(model_dir: Path, out: Path) -> Path:
    """The ``chat`` serving dataset as a token-id JSONL for ``model_dir``'s tokenizer and template."""
    tok = load_tokenizer(model_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for req in build_requests(DatasetConfig(name="chat", num_prompts=64, output_len=(64, 256))):
            assert req.messages is not None  # the chat dataset's requests are conversations
            ids = chat_ids(tok, req.messages)
            f.write(json.dumps({"prompt_token_ids": ids, "max_tokens": req.max_tokens}) + "\n")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny", "small"])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workload", default=".bench/workload.jsonl", help="the random workload (written if missing)")
    ap.add_argument("--workload-kind", choices=("random", "chat"), default="random")
    ap.add_argument("--peers", default=str(ROOT.parent / "shared" / "peers"))
    ap.add_argument("--vllm-venv", default=str(ROOT / ".peer-vllm"))
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--engines", nargs="+", default=["flotilla", "hf-static", "vllm-cpu"])
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default=".bench/offline_compare.json")
    a = ap.parse_args()

    py = sys.executable
    peers = Path(a.peers)
    workload = ROOT / a.workload
    if not workload.exists():
        workload.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([py, str(peers / "make_workload.py"), str(workload), "--seed", "0"], check=True)
    vllm_py = Path(a.vllm_venv) / "bin" / "python"
    engines = list(a.engines)
    if "vllm-cpu" in engines and not vllm_py.exists():
        print(f"note: {vllm_py} missing (make peer-vllm); vLLM skipped", file=sys.stderr)
        engines.remove("vllm-cpu")
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {m: {e: [] for e in engines} for m in a.models}
    for r in range(a.runs):
        for model in a.models:
            path = str(resolve_model_path(model))
            if a.workload_kind == "chat":
                workload = _chat_workload(Path(path), ROOT / ".bench" / f"chat_workload_{model}.jsonl")
            cmds = {
                "flotilla": [py, "-m", "cli.main", "bench", "offline", "--model", path,
                             "--workload", str(workload)],
                "hf-static": [py, str(peers / "hf_offline.py"), path, str(workload), "--batch", str(a.hf_batch)],
                "vllm-cpu": [str(vllm_py), str(peers / "vllm_cpu_offline.py"), path, str(workload)],
            }
            for engine in engines:
                res = _run(cmds[engine], a.timeout)
                runs[model][engine].append(res)
                print(f"run {r + 1}/{a.runs} {model} {engine}: {res['output_tok_per_s']} tok/s",
                      file=sys.stderr, flush=True)
    summary: dict[str, Any] = {"workload": str(workload), "workload_kind": a.workload_kind, "runs": a.runs,
                               "models": {}}
    for model in a.models:
        med = {e: statistics.median(x["output_tok_per_s"] for x in runs[model][e]) for e in engines}
        entry: dict[str, Any] = {"median_output_tok_per_s": med, "runs": runs[model]}
        if "vllm-cpu" in med and "flotilla" in med:
            entry["flotilla_vs_vllm"] = round(med["flotilla"] / med["vllm-cpu"], 2)
        if "flotilla" in med:
            entry["flotilla_peak_rss_mib"] = max(x["peak_rss_mib"] for x in runs[model]["flotilla"])
        summary["models"][model] = entry
    out = ROOT / a.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    print(json.dumps({m: {k: v for k, v in e.items() if k != "runs"} for m, e in summary["models"].items()}))
    header = "| model | " + " | ".join(engines) + " | flotilla / vLLM |"
    print(header)
    print("|" + "---|" * (len(engines) + 2))
    for model, e in summary["models"].items():
        cells = " | ".join(f"{e['median_output_tok_per_s'][x]:,.0f}" for x in engines)
        print(f"| {model} | {cells} | {e.get('flotilla_vs_vllm', '-')}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
