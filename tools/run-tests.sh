#!/usr/bin/env bash
# Set-up (tools/setup.sh: packages, Python environment, build), then every test suite.
#   tools/run-tests.sh [ctest arguments, e.g. -R Tokenizer]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$ROOT/tools/setup.sh"
cd "$ROOT/build"
# One thread per test process: the suites run side by side on every core.
OMP_NUM_THREADS=1 ctest --output-on-failure --timeout 600 -j "$(nproc)" "$@"
