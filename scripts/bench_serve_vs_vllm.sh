#!/usr/bin/env bash
# flotilla serve vs vLLM's CPU build on the same model folder, one server at a time, one config:
#   bash scripts/bench_serve_vs_vllm.sh [MODEL=small] [OUT_DIR=.bench/serve] [CONFIG=scripts/bench_serve_compare.yaml]
# MODEL is anything flotilla loads (tiny, small, smollm2-135m, a folder, a .gguf file); vLLM gets its folder.
# The real model with real chats: bash scripts/bench_serve_vs_vllm.sh smollm2-135m .bench/chat scripts/bench_serve_chat.yaml
# The overhead pair on tiny: scripts/bench_serve_tiny_streams.yaml (32 streams), then scripts/bench_serve_tiny_lone.yaml (8 lone);
# both on one start of each server: CONFIG=scripts/bench_serve_tiny_streams.yaml,scripts/bench_serve_tiny_lone.yaml.
# Step 31's rounds: scripts/bench_step31.sh.
# INGRESS (default: "default") is flotilla serve's --ingress; INGRESS="proxy haproxy" runs flotilla once
# with each, before the one vLLM run. Two more names: "default" passes no --ingress, --router or
# --scheduler-placement (what a newcomer runs), "before" is Step 31's starting point (Serve's proxy and its
# power of two choices: --ingress proxy --router default). Needs `make peer-vllm` (the .peer-vllm venv). Writes
# flotilla_<ingress>.json, vllm.json (+ PNGs) under OUT_DIR and prints a comparison table per
# ingress (flotilla as "new", vLLM as "base"). PLACEMENT (default actor) is --scheduler-placement;
# PLACEMENT="actor replica" runs each ingress with each (a replica-placed run is named
# flotilla_<ingress>_replica).
set -euo pipefail
cd "$(dirname "$0")/.."
model_name=${1:-small} out=${2:-.bench/serve} config=${3:-scripts/bench_serve_compare.yaml}
ingresses=${INGRESS:-default} placements=${PLACEMENT:-actor}
mkdir -p "$out"
model=$(.venv/bin/python -c "from actors.load.loader import resolve_model_path as r; print(r('$model_name'))")
export RAY_AUTH_MODE=disabled OMP_NUM_THREADS=1
pid=""
stop() { if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=""; fi; }
trap stop EXIT
wait_up() {  # bounded: 600 s for a server to answer /health
  for _ in $(seq 1 600); do
    curl -sf "$1/health" >/dev/null && return 0
    kill -0 "$pid" 2>/dev/null || { echo "server exited" >&2; return 1; }
    sleep 1
  done
  return 1
}
# CONFIG may list several configs, comma-separated: each server then runs them all, one after the other,
# and every result is named <server>_<config's name> (scripts/bench_serve_tiny_streams.yaml -> _tiny_streams).
IFS=, read -ra configs <<< "$config"
result() {  # result SERVER CONFIG: the JSON's name (without .json)
  if [ "${#configs[@]}" -eq 1 ]; then echo "$1"; else local c; c=$(basename "$2" .yaml); echo "$1_${c#bench_serve_}"; fi
}
bench() {
  local c
  for c in "${configs[@]}"; do
    .venv/bin/flotilla bench serve --config "$c" --base-url "$1" --out "$out/$(result "$2" "$c").json" \
      --plot "$out/$(result "$2" "$c").png" > /dev/null
  done
}

names=()
for ingress in $ingresses; do
  for placement in $placements; do
    name=flotilla_$ingress; [ "$placement" = actor ] || name=${name}_$placement
    names+=("$name")
    case $ingress in
      default) flags=() ;;
      before) flags=(--ingress proxy --router default) ;;
      *) flags=(--ingress "$ingress") ;;
    esac
    [ "$placement" = actor ] || flags+=(--scheduler-placement "$placement")
    .venv/bin/flotilla serve --model "$model" --port 8200 --dtype float32 --max-num-seqs 64 \
      --max-model-len 2048 "${flags[@]}" > "$out/${name}_server.log" 2>&1 &
    pid=$!
    wait_up http://127.0.0.1:8200 && bench http://127.0.0.1:8200 "$name"
    stop
  done
done
bash ../shared/peers/vllm_cpu_serve.sh .peer-vllm "$model" 8100 > "$out/vllm_server.log" 2>&1 &
pid=$!
wait_up http://127.0.0.1:8100 && bench http://127.0.0.1:8100 vllm
stop
for c in "${configs[@]}"; do
  for name in "${names[@]}"; do
    echo "== $(result "$name" "$c") (new) vs vLLM (base)" >&2
    .venv/bin/flotilla bench serve --load "$out/$(result "$name" "$c").json" \
      --compare "$out/$(result vllm "$c").json" > /dev/null || true
  done
done
