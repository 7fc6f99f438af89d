#!/usr/bin/env bash
# Step 31's comparison (docs/benchmarks.md, "No Ray tax"): flotilla on its defaults, flotilla as it was
# before Step 31 (Serve's proxy, power of two choices) and vLLM-CPU, one server at a time, ROUNDS rounds
# (default 3), each round on `tiny` then on `smollm2-135m`, each server running 32 streams and then
# 8 lone requests; then the medians as JSON (scripts/bench_step31_summary.py).
#   bash scripts/bench_step31.sh [OUT=.bench/s31] [ROUNDS=3]        # needs make peer-vllm
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.bench/s31} rounds=${2:-3}
for r in $(seq 1 "$rounds"); do
  INGRESS="before default" bash scripts/bench_serve_vs_vllm.sh tiny "$out/tiny_$r" \
    scripts/bench_serve_tiny_streams.yaml,scripts/bench_serve_tiny_lone.yaml
  INGRESS="before default" bash scripts/bench_serve_vs_vllm.sh smollm2-135m "$out/smollm2_$r" \
    scripts/bench_serve_smollm2_streams.yaml,scripts/bench_serve_smollm2_lone.yaml
done
.venv/bin/python scripts/bench_step31_summary.py "$out"
