#!/usr/bin/env bash
# Set-up (tools/setup.sh: packages, Python environment, build), then every test suite.
#   tools/run-tests.sh [ctest arguments, e.g. -R Tokenizer]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# The tests also run our GGUF exports in llama.cpp: its Python binding is built once per Python
# environment (QTRAIN_LLAMA_CPP=0 skips it, and those tests skip).
# The Python packages the interop tests compare with (TRL, compressed-tensors, torchao, tensorboard) too.
QTRAIN_TEST_PACKAGES=1 QTRAIN_LLAMA_CPP=${QTRAIN_LLAMA_CPP:-1} "$ROOT/tools/setup.sh"
# The reference outputs the tests compare against live beside the clone, in ../shared/fixtures.
fixtures=${QTRAIN_FIXTURES:-$ROOT/../shared/fixtures}
if [ ! -d "$fixtures" ]; then
  echo "run-tests: no reference fixtures at $fixtures: the tests that compare against them will fail;" \
       "clone next to shared/ or set QTRAIN_FIXTURES" >&2
fi
cd "$ROOT/build"
# One thread per test process: the suites run side by side on every core.
OMP_NUM_THREADS=1 ctest --output-on-failure --timeout 600 -j "$(nproc)" "$@"
