#!/usr/bin/env bash
# docs/quantization.md's accuracy table: flotilla bench accuracy on SmolLM2-135M, open chat
# questions (bench spec-workloads' questions.jsonl, 20 requests, 64 tokens), fp32 base, against
# each quantization, and the whole model in bfloat16 as a yardstick of what a perturbation
# of that size does to greedy agreement; each case also reports token_top1_agreement (teacher-forced
# along the base replies) and perplexity_ratio on cli/bench/data/heldout_prose.txt. Extra arguments
# after OUT go to every bench accuracy call (e.g. --batch1-tokens 0). One JSON file per case in OUT (default
# .bench/quant), then a summary.
#   bash scripts/bench_quant_accuracy.sh [OUT]         ONLY='int8_kv|fp8_kv' to run a subset
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.bench/quant}
mkdir -p "$out"
py=.venv/bin/python
$py -m cli.main bench spec-workloads --out-dir "$out" --num-requests 20 > /dev/null
declare -A cases=(
  [int8_kv]='{"kv_cache_dtype": "int8"}'
  [fp8_kv]='{"kv_cache_dtype": "fp8"}'
  [int8_weights]='{"quantization": "int8"}'
  [int4_weights]='{"quantization": "int4"}'
  [bf16_reference]='{"dtype": "bfloat16"}'
)
for name in int8_kv fp8_kv int8_weights int4_weights bf16_reference; do
  [[ -n "${ONLY:-}" && ! "$name" =~ ^(${ONLY})$ ]] && continue
  echo "== $name: ${cases[$name]}" >&2
  $py -m cli.main bench accuracy --model smollm2-135m --workload "$out/questions.jsonl" --max-tokens 64 \
      --against "${cases[$name]}" --json --no-progress "${@:2}" > "$out/$name.json"
done
$py - "$out" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    r = json.loads(f.read_text())
    keys = ("greedy_agreement", "token_top1_agreement", "token_top1_matches", "output_tokens", "perplexity_ratio",
            "mean_kl", "max_kl", "kv_pages_ratio", "decode_speedup", "output_tok_per_s_ratio")
    print(f.stem, {k: r.get(k) for k in keys}, "weight MiB", [round(r[s]["weight_bytes"] / 2**20, 1) for s in ("base", "against")])
PY
