"""Issue 6's serving targets, side by side in one run: HTTP at saturation vs the offline engine.

    .venv/bin/python scripts/bench_http_vs_offline.py --runs 3 [--model tiny]
        [--ingress haproxy] [--scheduler-placement replica]   # flotilla serve's options of those names

For each side, ``--runs`` runs (the offline runs first, then the HTTP runs against one server):
- offline: ``flotilla bench offline`` on the workload at max_num_seqs 64
  (output tok/s), and the lone-request TTFT of the in-process engine: one
  request at a time, wall time from ``add_request`` to its first token.
- HTTP: a ``flotilla serve`` subprocess on a free loopback port; ``flotilla
  bench serve`` on the same workload with 64 streams in flight (output tok/s),
  then the same prompts one at a time (TTFT P50 as the client sees it).
Prints one JSON object: medians per side, the throughput ratio (target >=
0.80) and the TTFT difference in ms (target <= 20).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
LONE_PROMPTS = 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# One torch thread on both sides (the server's engine via --cpu-threads 1): two OpenMP threads
# of the tiny model on a 2-core machine that also runs the client collapse under contention.
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}


def _json_cmd(args: list[str]) -> dict[str, Any]:
    """Run a command that prints one JSON object on stdout."""
    out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, check=True, env=ONE_THREAD)
    return dict(json.loads(out.stdout))


def offline_lone_ttft_ms(model: str, workload: Path) -> float:
    """Median wall time from add_request to the first token, one request at a time (in-process)."""
    import torch

    from apps.llm import LLM
    from cli.bench.workload import read_workload
    from scheduling.sampling_params import SamplingParams

    torch.set_num_threads(1)
    llm = LLM(model, max_num_seqs=64, max_model_len=2048, enable_prefix_caching=False)
    try:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        samples = []
        for i, req in enumerate(read_workload(workload)[:LONE_PROMPTS]):
            t0 = time.perf_counter()
            llm.engine.add_request(f"lone-{i}", req["prompt_token_ids"], SamplingParams(max_tokens=2, temperature=0.0))
            while not any(d.token_ids for d in llm.engine.step()):
                pass
            samples.append((time.perf_counter() - t0) * 1000)
            while llm.engine.has_unfinished:
                llm.engine.step()
        return round(statistics.median(samples), 2)
    finally:
        llm.engine.shutdown()


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("flotilla serve exited before it was healthy")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.5)  # polling a server that is still starting
    raise TimeoutError(f"{url} never became healthy")


def http_side(model: str, workload: Path, runs: int, serve_options: list[str]) -> list[dict[str, float]]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(ONE_THREAD)
    env.pop("RAY_ADDRESS", None)
    server = subprocess.Popen([str(BIN / "flotilla"), "serve", "--model", model, "--port", str(port),
                               "--max-num-seqs", "64", "--cpu-threads", "1", *serve_options], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_healthy(url, server)
        results = []
        for _ in range(runs):
            base = [str(BIN / "flotilla"), "bench", "serve", "--base-url", url, "--dataset", "jsonl",
                    "--dataset-path", str(workload), "--request-rate", "inf", "--ignore-eos",
                    "--temperature", "0", "--num-warmups", "2"]
            sat = _json_cmd([*base, "--max-concurrency", "64"])["runs"][0]
            lone = _json_cmd([*base, "--max-concurrency", "1", "--num-prompts", str(LONE_PROMPTS)])["runs"][0]
            assert sat["failed_requests"] == 0 and lone["failed_requests"] == 0
            results.append({"output_tok_per_s": sat["output_throughput"], "lone_ttft_ms_p50": lone["ttft_ms"]["p50"]})
        return results
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--workload", default=None, help="JSONL (default: make_workload.py --seed 0)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--ingress", default="proxy", help="flotilla serve --ingress")
    parser.add_argument("--scheduler-placement", default="actor", help="flotilla serve --scheduler-placement")
    args = parser.parse_args()
    serve_options = ["--ingress", args.ingress, "--scheduler-placement", args.scheduler_placement]
    workload = Path(args.workload) if args.workload else Path(tempfile.mkdtemp()) / "workload.jsonl"
    if args.workload is None:  # make_workload.py writes the file it is given
        subprocess.run([sys.executable, str(ROOT.parent / "shared" / "peers" / "make_workload.py"),
                        "--seed", "0", str(workload)], stdout=subprocess.DEVNULL, check=True)
    offline = []
    for _ in range(args.runs):
        tput = _json_cmd([str(BIN / "flotilla"), "bench", "offline", "--model", args.model, "--workload",
                          str(workload), "--max-num-seqs", "64"])["output_tok_per_s"]
        offline.append({"output_tok_per_s": tput, "lone_ttft_ms_p50": offline_lone_ttft_ms(args.model, workload)})
    http = http_side(args.model, workload, args.runs, serve_options)

    def med(rows: list[dict[str, float]], key: str) -> float:
        return round(statistics.median(r[key] for r in rows), 2)

    result = {
        "model": args.model, "runs": args.runs, "workload": str(workload), "serve_options": serve_options,
        "offline": {"output_tok_per_s": med(offline, "output_tok_per_s"),
                    "lone_ttft_ms": med(offline, "lone_ttft_ms_p50"), "per_run": offline},
        "http": {"output_tok_per_s": med(http, "output_tok_per_s"),
                 "lone_ttft_ms": med(http, "lone_ttft_ms_p50"), "per_run": http},
    }
    result["throughput_ratio"] = round(result["http"]["output_tok_per_s"] / result["offline"]["output_tok_per_s"], 3)
    result["lone_ttft_diff_ms"] = round(result["http"]["lone_ttft_ms"] - result["offline"]["lone_ttft_ms"], 2)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
