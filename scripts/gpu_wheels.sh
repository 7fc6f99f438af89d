#!/usr/bin/env bash
# The wheel folder scripts/gpu_check.sh installs on the device, which has no network
# (`make gpu-wheels`; usage: bash scripts/gpu_wheels.sh [DIR], default .gpu-wheels, git-ignored).
#
# The device's image has python3.12, torch, transformers, safetensors, tokenizers, numpy, tqdm,
# ninja, pyyaml, requests, pytest, pytest-timeout, hypothesis, accelerate and nvcc
# (/work/.library/device/KINDS.md lists it). What the engine, the gpu tests and the bench import
# beyond that, found by importing them with this venv and reading each wheel's Requires-Dist:
#   flashinfer-python  the CUDA attention kernels, at the `cuda` extra's pin (pyproject.toml); its
#                      JIT compiles with the device's nvcc; at import and for the paged wrappers it
#                      needs apache-tvm-ffi (below) and, from the image, numpy, requests, tqdm,
#                      packaging, pynvml (nvidia-ml-py), cuda-bindings, ninja
#   xgrammar           actors/engine/llm_engine.py (structured output), with apache-tvm-ffi
#   pydantic           actors/ and apps/ models; xgrammar: pydantic-core, annotated-types,
#                      typing-inspection, typing-extensions (pydantic needs a newer one than
#                      the image may have)
#   gguf               actors/load/gguf
# Left out: ray (tests/shared_ray.py imports it, but its wheel alone is over the 64 MiB the
# device tool carries), compressed-tensors (imported only for such checkpoints), the HTTP stack.
# Every version but flashinfer's is the one installed in this venv: what the tests here ran with.
set -euo pipefail

DIR="${1:-.gpu-wheels}"
PYTHON="${PYTHON:-.venv/bin/python}"
DEVICE_PYTHON="${DEVICE_PYTHON:-3.12}"   # KINDS.md: the image's python3
LIMIT_BYTES=$((48 * 1024 * 1024))        # of the 64 MiB a call carries; the repo's files take the rest
PACKAGES=(xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection typing-extensions gguf)

cd "$(dirname "${BASH_SOURCE[0]}")/.."
FLASHINFER="$("$PYTHON" -c '
import tomllib
extra = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["cuda"]
(spec,) = [s for s in extra if s.startswith("flashinfer-python")]
print(spec)')"
SPECS=("$FLASHINFER")
for name in "${PACKAGES[@]}"; do
  SPECS+=("$name==$("$PYTHON" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$name")")
done

rm -rf "$DIR"
mkdir -p "$DIR"
echo "[gpu_wheels] downloading cp${DEVICE_PYTHON/./} manylinux x86_64 wheels into $DIR: ${SPECS[*]}"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$DEVICE_PYTHON" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 --platform any -d "$DIR" "${SPECS[@]}"

"$PYTHON" - "$DIR" "$LIMIT_BYTES" "${#SPECS[@]}" <<'EOF'
import hashlib
import sys
from pathlib import Path

folder, limit, expected = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
wheels = sorted(folder.glob("*.whl"))
if len(wheels) != expected:
    sys.exit(f"[gpu_wheels] {len(wheels)} wheels for {expected} packages: {[w.name for w in wheels]}")
total = sum(w.stat().st_size for w in wheels)
lines = [f"{w.name} {w.stat().st_size} sha256:{hashlib.sha256(w.read_bytes()).hexdigest()}" for w in wheels]
lines.append(f"total {total} bytes ({total / 2**20:.1f} MiB)")
(folder / "MANIFEST").write_text("\n".join(lines) + "\n")
print("\n".join(f"[gpu_wheels] {line}" for line in lines))
if total > limit:
    sys.exit(f"[gpu_wheels] {total / 2**20:.1f} MiB is over the {limit / 2**20:.0f} MiB this folder may take")
EOF
