#!/usr/bin/env bash
# Speculative decoding on the real model (docs/speculative.md): without and with speculation,
# side by side in one process per case (flotilla bench spec), medians of RUNS runs.
#   bash scripts/bench_spec.sh [OUT_DIR]        (ONLY=REGEX runs the cases whose name matches)
# Cases: ngram at batch 1 and at 32 streams on the edit and open-question workloads, and the
# self-draft (the target's first 10 of 30 layers) at batch 1. Prints one JSON line per case.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.bench/spec_final}
RUNS=${RUNS:-3}
MODEL=${MODEL:-smollm2-135m}
NGRAM='{"method": "ngram", "num_speculative_tokens": 4}'
SELF='{"method": "draft", "layers": 10, "num_speculative_tokens": 3}'
mkdir -p "$OUT"
.venv/bin/flotilla bench spec-workloads --out-dir "$OUT/b1" --num-requests 16 --seed 0 >/dev/null
.venv/bin/flotilla bench spec-workloads --out-dir "$OUT/b32" --num-requests 32 --seed 1 >/dev/null
ONLY=${ONLY:-}
run() {  # name workload max_num_seqs config
  if [ -n "$ONLY" ] && ! [[ "$1" =~ $ONLY ]]; then return 0; fi
  .venv/bin/flotilla bench spec --model "$MODEL" --workload "$2" --max-num-seqs "$3" \
    --speculative-config "$4" --runs "$RUNS" --json > "$OUT/$1.json" 2> "$OUT/$1.log"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps({'case': sys.argv[2], **{k: d[k] for k in ('baseline_output_tok_per_s', 'spec_output_tok_per_s', 'speedup', 'acceptance_rate', 'mean_accepted_tokens', 'same_tokens')}, 'per_run_speedup': [r['speedup'] for r in d['runs']]}))" "$OUT/$1.json" "$1"
}
for w in edit questions; do run "ngram_b1_$w" "$OUT/b1/$w.jsonl" 1 "$NGRAM"; done
for w in edit questions; do run "ngram_b32_$w" "$OUT/b32/$w.jsonl" 32 "$NGRAM"; done
for w in edit questions; do run "self_draft_b1_$w" "$OUT/b1/$w.jsonl" 1 "$SELF"; done
