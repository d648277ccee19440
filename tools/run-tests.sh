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
# ctest starts the longest suites first when it knows their times: a fresh build borrows those of
# a quiet 2-core run (tests/ctest_costs.txt, ctest's own cost file), later runs keep their own.
if [ ! -f Testing/Temporary/CTestCostData.txt ]; then
  mkdir -p Testing/Temporary
  cp "$ROOT/tests/ctest_costs.txt" Testing/Temporary/CTestCostData.txt
fi
# One thread per test process (OMP_NUM_THREADS, which nproc obeys too): the suites run side by side
# on every core.
jobs=$(nproc)
export OMP_NUM_THREADS=1
# A few hundred tests run Python scripts that import torch, transformers and peft (about 8 s of CPU
# each on 2 cores): tests/interop/python_server.py imports them once and runs each script in a fork
# of itself; tests/interop/warm_python, the tests' Python, sends it the scripts (the real Python
# where the environment differs). QTRAIN_WARM_PYTHON=0 runs every script in a fresh interpreter.
real_python=$(sed -n 's/^QTRAIN_PYTHON:STRING=//p' CMakeCache.txt)
if [ "${QTRAIN_WARM_PYTHON:-1}" = 1 ] && [ -x "$real_python" ]; then
  export QTRAIN_PYTHON_REAL=$real_python
  export QTRAIN_PYTHON_SERVER=$ROOT/build/Testing/python-server.sock
  export QTRAIN_PYTHON_SERVER_LOG=$ROOT/build/Testing/python-server-fallbacks.log
  export QTRAIN_PYTHON=$ROOT/tests/interop/warm_python
  mkdir -p Testing
  rm -f "$QTRAIN_PYTHON_SERVER_LOG"
  "$real_python" "$ROOT/tests/interop/python_server.py" "$QTRAIN_PYTHON_SERVER" &
  server=$!
  trap 'kill $server 2>/dev/null' EXIT
fi
status=0
ctest --output-on-failure --timeout 600 -j "$jobs" "$@" || status=$?
# ctest counts a suite whose cases skipped as passed: the skipped cases by their reason (the line
# GTEST_SKIP printed before each), so that a GPU-less machine's skips and a missing package's show.
if [ -f Testing/Temporary/LastTest.log ]; then
  awk '/^\[  SKIPPED \] [^ ]+ \([0-9]+ ms\)$/ { skipped++; reasons[previous]++ }
       { previous = $0 }
       END {
         if (skipped == 0) exit
         printf "run-tests: %d test cases skipped (ctest counts them as passed), by reason:\n", skipped
         fflush()
         for (reason in reasons) printf "%7d %s\n", reasons[reason], reason | "sort -rn"
       }' Testing/Temporary/LastTest.log
fi
exit "$status"
