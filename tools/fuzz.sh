#!/usr/bin/env bash
# Runs the libFuzzer targets (tests/fuzz) for a chosen time each and prints their figures.
#
#   tools/fuzz.sh [--seconds N] [--build DIR] [--work DIR] [--report FILE] [TARGET ...]
#
#   --seconds N   fuzzing time per target (default 60); 0 runs the seeds and regressions only
#   --build DIR   where the *_fuzz executables are (default build/fuzz, built by the main build
#                 when clang is found; or configure tests/fuzz alone with -DCMAKE_CXX_COMPILER=clang++)
#   --work DIR    corpora and crash artifacts (default build/fuzz-work); corpora grow run by run
#   --report FILE the figures as a Markdown table (docs/RELIABILITY.md quotes it)
#   TARGET        e.g. recipe tokenize (default: every target built)
#
# Per target: first every input in tests/fuzz/regressions/TARGET (crashes found earlier) runs
# once; then libFuzzer mutates the seeds (tests/fuzz/corpus/TARGET plus small fixture files)
# with AddressSanitizer and UBSan. A crash, sanitizer report, leak or uncaught exception other
# than qtrain::Error fails the run; its input is saved under WORK/crashes/TARGET/: add it to
# tests/fuzz/regressions/TARGET once fixed. Exit status: non-zero if any target failed.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
seconds=60
build="$ROOT/build/fuzz"
work="$ROOT/build/fuzz-work"
report=""
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    --work) work=$2; shift 2 ;;
    --report) report=$2; shift 2 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) targets+=("$1"); shift ;;
  esac
done
fixtures=${QTRAIN_FIXTURES:-$ROOT/../shared/fixtures}
export QTRAIN_FIXTURES=$fixtures
if [ ${#targets[@]} -eq 0 ]; then
  for executable in "$build"/*_fuzz; do
    [ -x "$executable" ] && targets+=("$(basename "$executable" _fuzz)")
  done
fi
if [ ${#targets[@]} -eq 0 ]; then
  echo "fuzz: no *_fuzz executables in $build (is clang installed? see tests/fuzz/CMakeLists.txt)" >&2
  exit 2
fi

# Small files of the fixtures and the clone that are valid inputs of a target.
seed_files() {
  case "$1" in
    hf_config) ls "$fixtures"/tiny-llama*/config.json ;;
    peft_adapter_config) ls "$fixtures"/tiny-llama-lora/adapter_config.json ;;
    recipe) ls "$ROOT"/recipes/*.yaml ;;
  esac 2>/dev/null
}

rows=()
failed=0
for target in "${targets[@]}"; do
  executable="$build/${target}_fuzz"
  if [ ! -x "$executable" ]; then
    echo "fuzz: $executable is missing" >&2
    failed=1
    continue
  fi
  corpus="$work/corpus/$target"
  crashes="$work/crashes/$target"
  log="$work/logs/$target.log"
  mkdir -p "$corpus" "$crashes" "$(dirname "$log")"
  [ -d "$ROOT/tests/fuzz/corpus/$target" ] && cp -n "$ROOT/tests/fuzz/corpus/$target"/* "$corpus"/ 2>/dev/null
  for file in $(seed_files "$target"); do cp -n "$file" "$corpus/seed-$(echo "$file" | md5sum | cut -c1-8)"; done

  status=ok
  regressions=("$ROOT/tests/fuzz/regressions/$target"/*)
  if [ -e "${regressions[0]}" ]; then
    if ! "$executable" "${regressions[@]}" >"$log.regressions" 2>&1; then
      status=REGRESSION
      echo "fuzz: $target: a regression input fails again:" >&2
      grep -E "ERROR|SUMMARY|Running:" "$log.regressions" | tail -5 >&2
    fi
  fi

  executions=0
  if [ "$seconds" -gt 0 ] && [ "$status" = ok ]; then
    # -rss_limit_mb: a parser must not need GBs for a small input; -timeout: nor seconds.
    "$executable" -max_total_time="$seconds" -print_final_stats=1 -print_funcs=0 -print_pcs=0 \
      -max_len=65536 -timeout=10 -rss_limit_mb=2048 -artifact_prefix="$crashes/" "$corpus" >"$log" 2>&1
    code=$?
    executions=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    executions=${executions:-0}
    if [ $code -ne 0 ]; then
      status=CRASH
      echo "fuzz: $target found a failing input (kept in $crashes):" >&2
      grep -E "ERROR|SUMMARY|Test unit written|uncaught|terminate" "$log" | tail -6 >&2
    fi
  fi
  [ "$status" = ok ] || failed=1
  regression_count=0
  [ -e "${regressions[0]}" ] && regression_count=${#regressions[@]}
  rows+=("| $target | $seconds | $executions | $((executions / (seconds > 0 ? seconds : 1))) | $(ls "$corpus" | wc -l) | $regression_count | $status |")
done

{
  echo "| target | seconds | executions | per second | corpus files | regression inputs | result |"
  echo "|---|---|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
} | tee ${report:+"$report"}
exit $failed
