#!/usr/bin/env bash
# Where speculation stops paying (docs/speculative.md, "Adaptive"): prompt lookup with no
# batch-size rule (only the per-sequence bar of 0.25 at every batch size), against none, at
# growing batch sizes on the edit and open-question workloads.
#   bash scripts/bench_spec_sweep.sh [OUT_DIR]      (RUNS=2 by default)
# Each batch size runs 2 x max_num_seqs requests (at most 32; 64 at batch 64).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.bench/spec_sweep}
RUNS=${RUNS:-2}
MODEL=${MODEL:-smollm2-135m}
ALWAYS='{"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": null, "busy_min_acceptance": 0.25}'
mkdir -p "$OUT"
.venv/bin/flotilla bench spec-workloads --out-dir "$OUT/w32" --num-requests 32 --seed 1 >/dev/null
.venv/bin/flotilla bench spec-workloads --out-dir "$OUT/w64" --num-requests 64 --seed 2 >/dev/null
for bs in 2 4 8 16 24 32 64; do
  for w in questions edit; do
    n=$((2 * bs)); [ "$n" -gt 32 ] && n=32; src="$OUT/w32/$w.jsonl"
    if [ "$bs" -eq 64 ]; then n=64; src="$OUT/w64/$w.jsonl"; fi
    head -n "$n" "$src" > "$OUT/${w}_n$n.jsonl"
    .venv/bin/flotilla bench spec --model "$MODEL" --workload "$OUT/${w}_n$n.jsonl" --max-num-seqs "$bs" \
      --speculative-config "$ALWAYS" --runs "$RUNS" --json > "$OUT/${w}_$bs.json" 2> "$OUT/${w}_$bs.log"
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps({'workload': sys.argv[2], 'max_num_seqs': int(sys.argv[3]), **{k: d[k] for k in ('baseline_output_tok_per_s', 'spec_output_tok_per_s', 'speedup', 'acceptance_rate', 'same_tokens')}}))" "$OUT/${w}_$bs.json" "$w" "$bs"
  done
done
