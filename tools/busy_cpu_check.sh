#!/usr/bin/env bash
# qtrain's CPU speed alone and beside a busy process, as on a user's machine where something
# else always runs: the demo's training (40 steps of recipes/demo_tiny.yaml) and `qtrain eval`
# on the held-out Brown split, each once alone and once beside a plain busy loop at normal
# priority. Prints tokens/s for each and the busy / idle ratio.
#
#   tools/busy_cpu_check.sh [--steps N] [-- extra qtrain arguments, e.g. --set train.seed=1]
#
# Set OMP_NUM_THREADS / OMP_WAIT_POLICY yourself to compare with qtrain's own choice.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
QTRAIN=${QTRAIN:-$ROOT/build/qtrain}
steps=40
while [ $# -gt 0 ]; do
  case $1 in
    --steps) steps=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "usage: $0 [--steps N] [-- qtrain arguments]" >&2; exit 2 ;;
  esac
done
work=$(mktemp -d /tmp/qtrain-busy-XXXXXX)
trap 'kill $busy 2>/dev/null || true; rm -rf "$work"' EXIT
busy=

train_tokens_per_second() {
  rm -rf "$work/run"
  "$QTRAIN" --recipe "$ROOT/recipes/demo_tiny.yaml" --set train.steps="$steps" --set log.every=10 \
    --set eval.every=0 --set data.eval= --set checkpoint.every=0 --set train.output_dir="$work/run" "$@" \
    >"$work/train.log" 2>&1 || { cat "$work/train.log" >&2; exit 1; }
  # The first logged window holds the warm-up: the median of the later ones.
  python3 -c "
import json, statistics
rows = [r['tokens_per_second'] for r in map(json.loads, open('$work/run/metrics.jsonl')) if 'tokens_per_second' in r]
print(round(statistics.median(rows[1:] or rows)))"
}

eval_tokens_per_second() {
  "$QTRAIN" eval --model "$ROOT/recipes/demo/tiny-llama" --data "$ROOT/recipes/demo/brown-val.jsonl" \
    --max-seq-len 256 --device cpu --json 2>/dev/null | tail -1 |
    python3 -c "import json, sys; print(round(json.load(sys.stdin)['tokens_per_second']))"
}

train_idle=$(train_tokens_per_second "$@")
eval_idle=$(eval_tokens_per_second)
bash -c 'while :; do :; done' &
busy=$!
train_busy=$(train_tokens_per_second "$@")
eval_busy=$(eval_tokens_per_second)
kill $busy; busy=

ratio() { python3 -c "print(f'{$2 / $1:.2f}')"; }
echo "cores available: $(nproc); OMP_NUM_THREADS=${OMP_NUM_THREADS:-unset} OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-unset}"
echo "train ($steps steps of the demo): alone $train_idle tokens/s, beside a busy loop $train_busy tokens/s ($(ratio "$train_idle" "$train_busy")x)"
echo "eval (held-out Brown, cpu):      alone $eval_idle tokens/s, beside a busy loop $eval_busy tokens/s ($(ratio "$eval_idle" "$eval_busy")x)"
