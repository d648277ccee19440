#!/usr/bin/env bash
# On the GPU machine: build with the machine's CUDA LibTorch and run every test suite there.
#   source .gpu/gpu-env.sh; tools/gpu-check.sh [ctest arguments]
# Fixtures travel in .gpu/fixtures (../shared does not reach the GPU machine).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export QTRAIN_OFFLINE=1
[ -d "$ROOT/.gpu/fixtures" ] && export QTRAIN_FIXTURES="$ROOT/.gpu/fixtures"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$ROOT/tools/setup.sh"
cd "$ROOT/build"
ctest --output-on-failure --timeout 600 -j 8 "$@"
