#!/usr/bin/env bash
# GPU speed 8/11's benchmark (docs/PERFORMANCE.md): `qtrain bench` on the Llama-3-8B shape in the
# issue's five settings and, when transformers, peft and bitsandbytes import, the Python anchor
# (tools/bench_anchor.py) in the same settings on the same GPU; then one markdown table side by side.
#   tools/bench.sh [--steps N] [--warmup N] [--seq T] [--no-anchor] [--shape S] [ROW ...]
# A ROW is QUANT:MICRO_BATCH:CHECKPOINTING, e.g. qlora:4:on (the default rows are the issue's).
# QTRAIN_PYTHON picks the anchor's Python (default python3); build/qtrain must exist (tools/setup.sh).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
QTRAIN="$ROOT/build/qtrain"
PYTHON=${QTRAIN_PYTHON:-python3}
steps=5 warmup=2 seq=2048 anchor=1 shape=llama3-8b rows=()
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) steps=$2; shift 2 ;;
    --seq) seq=$2; shift 2 ;;
    --warmup) warmup=$2; shift 2 ;;
    --no-anchor) anchor=0; shift ;;
    --shape) shape=$2; shift 2 ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    *) rows+=("$1"); shift ;;
  esac
done
[ ${#rows[@]} -gt 0 ] || rows=(qlora:1:on qlora:4:on qlora:8:on qlora:1:off none:4:on)
[ -x "$QTRAIN" ] || { echo "bench.sh: $QTRAIN is missing: run tools/setup.sh first" >&2; exit 1; }
imports() { "$PYTHON" -c "import $1" 2>/dev/null; }
if [ $anchor = 1 ] && ! imports "transformers, peft"; then
  echo "bench.sh: transformers or peft does not import in $PYTHON: qtrain only" >&2
  anchor=0
fi
results=$(mktemp)
trap 'rm -f "$results"' EXIT
for row in "${rows[@]}"; do
  IFS=: read -r quant batch checkpointing <<<"$row"
  flags=(--shape "$shape" --quant "$quant" --micro-batch "$batch" --seq "$seq" --steps "$steps" --warmup "$warmup" --json)
  [ "$checkpointing" = on ] && flags+=(--checkpointing)
  echo "== qtrain bench ${flags[*]}" >&2
  "$QTRAIN" bench "${flags[@]}" | tee /dev/stderr | tail -1 | sed 's/^/qtrain /' >>"$results"
  if [ $anchor = 1 ] && { [ "$quant" = none ] || imports bitsandbytes; }; then
    echo "== tools/bench_anchor.py ${flags[*]}" >&2
    "$PYTHON" "$ROOT/tools/bench_anchor.py" "${flags[@]}" | tee /dev/stderr | tail -1 | sed 's/^/anchor /' >>"$results" \
      || echo "anchor {}" >>"$results"
  fi
done
"$PYTHON" - "$results" <<'PY'
import json, sys
rows, anchors = [], {}
for line in open(sys.argv[1]):
    who, _, text = line.partition(" ")
    record = json.loads(text)
    if who == "qtrain":
        rows.append(record)
    elif rows:
        anchors[len(rows) - 1] = record
gib = 2 ** 30
print("| setting | qtrain tokens/s | qtrain peak | anchor tokens/s | anchor peak | speed | memory |")
print("|---|---|---|---|---|---|---|")
for index, ours in enumerate(rows):
    name = ("QLoRA" if ours["quant"] == "qlora" else "LoRA bf16") + \
        (", checkpointing" if ours["checkpointing"] else ", no checkpointing") + f", micro-batch {ours['micro_batch']}"
    theirs = anchors.get(index) or {}
    cells = [name, f"{ours['tokens_per_second']:,.0f} (MFU {100 * ours['mfu']:.1f}%)", f"{ours['peak_memory_bytes'] / gib:.2f} GiB"]
    if theirs.get("tokens_per_second"):
        cells += [f"{theirs['tokens_per_second']:,.0f}", f"{theirs['peak_memory_bytes'] / gib:.2f} GiB",
                  f"{ours['tokens_per_second'] / theirs['tokens_per_second']:.2f}x",
                  f"{ours['peak_memory_bytes'] / theirs['peak_memory_bytes']:.2f}x" if theirs["peak_memory_bytes"] else "-"]
    else:
        cells += ["-", "-", "-", "-"]
    print("| " + " | ".join(cells) + " |")
PY
