#!/usr/bin/env bash
# Colocated vs prefill:decode splits of N GPUs on one workload, by simulation (docs/fleet.md, "Prefill and
# decode pools"). Every pool has a fixed size (min = max replicas); each line is one `flotilla simulate`.
#   bash scripts/fleet_pd_split.sh [MODEL] [GPU] [GPUS] [RATE] [MINUTES] [PROMPT] [OUTPUT]
set -euo pipefail
model=${1:-mistral-7b}; gpu=${2:-H200}; gpus=${3:-8}; rate=${4:-40}; minutes=${5:-5}
prompt=${6:-2000}; output=${7:-500}
py=${PYTHON:-.venv/bin/python}
trace="poisson:rate=${rate},minutes=${minutes},prompt_tokens=${prompt},output_tokens=${output},spread=0"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
run() {  # label, config yaml
  printf '%s\n' "$2" > "$dir/c.yaml"
  "$py" -m cli.main simulate --trace "$trace" --gpu "$gpu" --model "$model" --config "$dir/c.yaml" \
    --slo ttft:1000 tpot:50 --json | "$py" -c "
import json, sys
d = json.load(sys.stdin)
print(json.dumps({'split': '$1', 'rate': $rate, 'requests': d['requests'], 'goodput_req_per_s': d['goodput_req_per_s'],
                  'goodput_fraction': d['goodput_fraction'], 'ttft_p95_ms': d['ttft_p95_ms'],
                  'tpot_p95_ms': d['tpot_p95_ms'], 'unfinished': d['unfinished'], 'wall_s': d['wall_s']}))"
}
run "colocated:$gpus" "startup_s: 0
autoscaling: {min_replicas: $gpus, max_replicas: $gpus}"
for p in $(seq 1 $((gpus / 2))); do
  d=$((gpus - p))
  run "$p:$d" "startup_s: 0
autoscaling: {min_replicas: $d, max_replicas: $d}
disaggregation:
  prefill: {min_replicas: $p, max_replicas: $p}
  remote_prefill_min_tokens: 0"
done
