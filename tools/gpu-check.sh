#!/usr/bin/env bash
# On the GPU machine: build with the machine's CUDA LibTorch and run every test suite there.
#   source .gpu/gpu-env.sh; tools/gpu-check.sh [ctest arguments]
# Fixtures travel in .gpu/fixtures (../shared does not reach the GPU machine).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export QTRAIN_OFFLINE=1
if [ -d "$ROOT/.gpu/fixtures" ]; then
  export QTRAIN_FIXTURES="$ROOT/.gpu/fixtures"
  # The carried tree must stay small: the demo's copy of tiny-llama stands in for the fixture's.
  [ -e "$QTRAIN_FIXTURES/tiny-llama" ] || ln -s "$ROOT/recipes/demo/tiny-llama" "$QTRAIN_FIXTURES/tiny-llama"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$ROOT/tools/setup.sh"
cd "$ROOT/build"
OMP_NUM_THREADS=2 ctest --output-on-failure --timeout 600 -j 8 "$@"
