#!/usr/bin/env bash
# Step 23's device check (issue 40) in one command, ending within GPU_CHECK_TOTAL_S (480 s):
#
#   bash scripts/gpu_check.sh OUT_DIR            on a bare CUDA machine without network
#   bash scripts/gpu_check.sh --dry-run OUT_DIR  the same script on the CPU (part of `make test`)
#
# Phases, each in a time box (a phase that runs out is stopped; what it had is kept):
#   setup      check the GPU and nvcc (FlashInfer's JIT compiles with it), install the wheel folder
#              (`make gpu-wheels`: what the device's image lacks) into a private site folder, import
#              what the tests and the bench import. Dry run: imports only (this venv has everything).
#   gpu_tests  pytest -m gpu over the test files that hold gpu-marked tests (the others are not
#              collected: they may import what the device lacks, Ray first).
#   bench      scripts/gpu_bench.py (correctness, decode, HF peer), rewriting the report as it goes.
# Then scripts/gpu_report.py closes OUT_DIR/gpu_check.json (phases, gpu tests, device minutes,
# the command) and prints a summary. Exit 0 only when every figure was measured and every check
# passed; the report is written either way.
#
# Files in OUT_DIR (the device tool returns at most 8): gpu_check.json, setup.log, gpu_tests.log,
# gpu_tests.xml, bench.log.
#
# Environment: PYTHON (default python3), FLOTILLA_GPU_WHEELS (default REPO/.gpu-wheels),
# GPU_CHECK_TOTAL_S (480; dry run 120), GPU_CHECK_TESTS_S (the gpu tests' box: 180; dry run 60).
set -euo pipefail

usage() {
  echo "usage: bash scripts/gpu_check.sh [--dry-run] OUT_DIR" >&2
  exit 2
}

DRY_RUN=0
OUT_DIR=""
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    -h | --help) usage ;;
    -*) echo "gpu_check: unknown option $arg" >&2; usage ;;
    *)
      [[ -z "$OUT_DIR" ]] || { echo "gpu_check: one OUT_DIR only (got $OUT_DIR and $arg)" >&2; usage; }
      OUT_DIR="$arg"
      ;;
  esac
done
[[ -n "$OUT_DIR" ]] || usage

START_S=$SECONDS
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
COMMAND="bash scripts/gpu_check.sh $*"
cd "$REPO"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
PYTHON="${PYTHON:-python3}"
WHEELS="${FLOTILLA_GPU_WHEELS:-$REPO/.gpu-wheels}"
if [[ "$DRY_RUN" == 1 ]]; then
  TOTAL_S="${GPU_CHECK_TOTAL_S:-120}"
  TESTS_S="${GPU_CHECK_TESTS_S:-60}"
  MODE_ARGS=(--dry-run)
else
  TOTAL_S="${GPU_CHECK_TOTAL_S:-480}"
  TESTS_S="${GPU_CHECK_TESTS_S:-180}"
  MODE_ARGS=()
fi
SETUP_S=90
FINALIZE_S=15 # kept back for the report's last step
REPORT="$OUT_DIR/gpu_check.json"
rm -f "$REPORT" "$OUT_DIR"/setup.log "$OUT_DIR"/gpu_tests.log "$OUT_DIR"/gpu_tests.xml "$OUT_DIR"/bench.log

say() { echo "[gpu_check $((SECONDS - START_S))s] $*"; }
left() { echo $((TOTAL_S - FINALIZE_S - (SECONDS - START_S))); }

PHASE_ARGS=()
STOP=0 # set when a phase leaves nothing for the next ones to run on

# run_phase NAME BUDGET_S LOG COMMAND...: the command under `timeout`, its output shown and kept in LOG.
run_phase() {
  local name="$1" budget="$2" log="$3"
  shift 3
  if [[ "$STOP" == 1 ]]; then
    say "$name: not run (an earlier phase failed)"
    PHASE_ARGS+=(--phase "$name=not_run:0")
    return 0
  fi
  if ((budget <= 0)); then
    say "$name: no time left in the ${TOTAL_S} s box"
    PHASE_ARGS+=(--phase "$name=timed_out:0")
    return 0
  fi
  say "$name: starting (time box ${budget} s, log $log)"
  local t0=$SECONDS rc=0 status
  # --kill-after: a process that ignores TERM is killed 10 s later.
  set +e
  timeout --kill-after=10 "$budget" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  set -e
  case "$rc" in
    0) status=ok ;;
    124 | 137) status=timed_out ;;
    *) status=failed ;;
  esac
  say "$name: $status (exit $rc) in $((SECONDS - t0)) s"
  PHASE_ARGS+=(--phase "$name=$status:$((SECONDS - t0))")
  LAST_STATUS="$status"
}

# ---------------------------------------------------------------- setup
setup_device() {
  if ! command -v nvidia-smi >/dev/null; then
    echo "no nvidia-smi: this is no CUDA machine (on a CPU, run with --dry-run)" >&2
    return 1
  fi
  echo "GPU:"
  nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader
  local nvcc
  nvcc="$(command -v nvcc || true)"
  if [[ -z "$nvcc" && -n "${CUDA_HOME:-}" && -x "$CUDA_HOME/bin/nvcc" ]]; then nvcc="$CUDA_HOME/bin/nvcc"; fi
  if [[ -z "$nvcc" && -x /usr/local/cuda/bin/nvcc ]]; then nvcc=/usr/local/cuda/bin/nvcc; fi
  if [[ -z "$nvcc" ]]; then
    echo "no nvcc on PATH, in \$CUDA_HOME/bin or /usr/local/cuda/bin: FlashInfer's JIT cannot compile its kernels" >&2
    return 1
  fi
  echo "nvcc: $nvcc ($("$nvcc" --version | tail -1))"
  if [[ ! -f "$WHEELS/MANIFEST" ]]; then
    echo "no wheel folder at $WHEELS (make it here with \`make gpu-wheels\`, carry it with the command)" >&2
    return 1
  fi
  echo "wheels from $WHEELS into $SITE:"
  cat "$WHEELS/MANIFEST"
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$WHEELS"/*.whl
}

import_check() {
  "$PYTHON" - <<'EOF'
import importlib.metadata as md
import sys

import torch

print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available())
import apps.llm  # noqa: F401,E402  the engine and every package it imports
import tests.kvcache.flashinfer_emulator  # noqa: F401,E402
import tests.kvcache.attention.test_flashinfer_backend  # noqa: F401,E402  the gpu test's own imports
for dist in ("transformers", "flashinfer-python", "xgrammar", "pydantic", "gguf"):
    try:
        print(dist, md.version(dist))
    except md.PackageNotFoundError:
        print(dist, "not installed")
EOF
  if [[ "$DRY_RUN" == 0 ]]; then
    "$PYTHON" -c 'import torch, flashinfer; assert torch.cuda.is_available(), "torch sees no CUDA device"; print("flashinfer", flashinfer.__version__)'
  fi
}

setup() {
  if [[ "$DRY_RUN" == 0 ]]; then setup_device; fi
  import_check
}

SITE="${TMPDIR:-/tmp}/flotilla-gpu-site"
if [[ "$DRY_RUN" == 1 ]]; then
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
  # The native CPU kernels (kvcache/csrc) off: a CUDA device never runs them, and a fresh checkout
  # would otherwise compile them inside a phase's time box. The torch path runs, as on CUDA.
  export FLOTILLA_CPU_KERNELS=0
else
  # The repo first (flotilla is not installed there), then the wheels, then the image's packages.
  export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
  export MAX_JOBS="${MAX_JOBS:-$(nproc)}" # FlashInfer's JIT: ninja jobs
fi
export PYTHONUNBUFFERED=1
export PYTHONDONTWRITEBYTECODE=1

LAST_STATUS=""
# `timeout` runs programs, not functions: the setup functions and what they read go to a child bash.
export DRY_RUN PYTHON WHEELS SITE
export -f setup setup_device import_check
run_phase setup "$SETUP_S" "$OUT_DIR/setup.log" bash -euo pipefail -c setup
[[ "$LAST_STATUS" == ok ]] || STOP=1

# ---------------------------------------------------------------- gpu tests
mapfile -t GPU_TEST_FILES < <(grep -rlE --include='test_*.py' 'pytest\.mark\.gpu' tests | sort)
say "gpu-marked test files: ${GPU_TEST_FILES[*]:-none}"
BUDGET=$(left)
((BUDGET < TESTS_S)) || BUDGET=$TESTS_S
if ((${#GPU_TEST_FILES[@]} == 0)); then
  say "gpu_tests: no test file holds a gpu-marked test"
  PHASE_ARGS+=(--phase "gpu_tests=failed:0")
else
  # --continue-on-collection-errors: a file that cannot be imported there (one needing Ray, which
  # the device lacks) is an error in the report, and the other files still run.
  run_phase gpu_tests "$BUDGET" "$OUT_DIR/gpu_tests.log" \
    "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider -rs --continue-on-collection-errors \
    --junitxml "$OUT_DIR/gpu_tests.xml" "${GPU_TEST_FILES[@]}"
fi

# ---------------------------------------------------------------- bench
BUDGET=$(left)
# The bench ends its own phases 10 s before its box, so the shell's kill is a last resort.
run_phase bench "$BUDGET" "$OUT_DIR/bench.log" \
  "$PYTHON" scripts/gpu_bench.py --out "$REPORT" --deadline-s "$((BUDGET > 10 ? BUDGET - 10 : 1))" \
  "${MODE_ARGS[@]}"

# ---------------------------------------------------------------- report
JUNIT_ARGS=()
if [[ -f "$OUT_DIR/gpu_tests.xml" ]]; then JUNIT_ARGS=(--junit "$OUT_DIR/gpu_tests.xml"); fi
set +e
"$PYTHON" scripts/gpu_report.py finalize --report "$REPORT" --command "$COMMAND" \
  --elapsed-s "$((SECONDS - START_S))" "${PHASE_ARGS[@]}" "${JUNIT_ARGS[@]}" "${MODE_ARGS[@]}"
rc=$?
set -e
say "done in $((SECONDS - START_S)) s; report $REPORT"
exit "$rc"
