#!/usr/bin/env bash
# Set-up (tools/setup.sh: packages, Python environment, build), then every test suite.
#   tools/run-tests.sh [ctest arguments, e.g. -R Tokenizer]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$ROOT/tools/setup.sh"
cd "$ROOT/build"
ctest --output-on-failure --timeout 600 -j "$(nproc)" "$@"
