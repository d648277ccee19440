#!/usr/bin/env bash
# GPU speed 8/11's benchmark (docs/PERFORMANCE.md): `qtrain bench` on the Llama-3-8B shape in the
# issue's five settings and, in the same settings on the same GPU, the Python anchors: hf
# (tools/bench_anchor.py: transformers + peft, + bitsandbytes for QLoRA rows) and unsloth
# (tools/bench_unsloth.py: `import unsloth` on a GPU; every dense shape, llama3-70b (QLoRA rows only, its
# checkpoint written already NF4) and qwen3-30b-a3b, gpt-oss-20b); then a table.
#   tools/bench.sh [--steps N] [--warmup N] [--seq T] [--anchors hf,unsloth | --no-anchor] [--shape S]
#                  [--layers N] [--qtrain-flags "FLAGS"] [ROW ...]
# --layers N: every tool runs the shape's first N decoder layers (default 0: all; unsloth's mixtures: 12).
# A ROW is QUANT:MICRO_BATCH:CHECKPOINTING[:SWITCHES], e.g. qlora:4:on (the default rows are the
# issue's); SWITCHES are `qtrain bench` flags for that row's qtrain run, without dashes, comma-
# separated: qlora:4:on:offload-activations,embeddings-on-host. --qtrain-flags go to every row's.
# --anchors defaults to every anchor whose packages import. QTRAIN_PYTHON picks the anchors' Python
# (default python3); QTRAIN_UNSLOTH_PATH, if set, goes first on PYTHONPATH for the unsloth anchor
# only; build/qtrain must exist (tools/setup.sh).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
QTRAIN="$ROOT/build/qtrain"
PYTHON=${QTRAIN_PYTHON:-python3}
steps=5 warmup=2 seq=2048 anchors=auto shape=llama3-8b layers=0 rows=() qtrain_flags=()
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) steps=$2; shift 2 ;;
    --seq) seq=$2; shift 2 ;;
    --warmup) warmup=$2; shift 2 ;;
    --anchors) anchors=$2; shift 2 ;;
    --no-anchor) anchors=; shift ;;
    --shape) shape=$2; shift 2 ;;
    --qtrain-flags) read -ra qtrain_flags <<<"$2"; shift 2 ;;
    --layers) layers=$2; shift 2 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) rows+=("$1"); shift ;;
  esac
done
[ ${#rows[@]} -gt 0 ] || rows=(qlora:1:on qlora:4:on qlora:8:on qlora:1:off none:4:on)
[ -x "$QTRAIN" ] || { echo "bench.sh: $QTRAIN is missing: run tools/setup.sh first" >&2; exit 1; }
unsloth_python=(env ${QTRAIN_UNSLOTH_PATH:+"PYTHONPATH=$QTRAIN_UNSLOTH_PATH${PYTHONPATH:+:$PYTHONPATH}"} "$PYTHON")
imports() { "$PYTHON" -c "import $1" 2>/dev/null; }
usable() {  # ANCHOR: whether it can run here; says why not
  case "$1" in
    hf) imports "transformers, peft" || { echo "bench.sh: transformers or peft does not import" >&2; false; } ;;
    unsloth) "${unsloth_python[@]}" "$ROOT/tools/bench_unsloth.py" --shape "$shape" --layers "$layers" --check ;;
    *) echo "bench.sh: unknown anchor '$1' (hf, unsloth)" >&2; exit 1 ;;
  esac
}
if [ "$anchors" = auto ]; then wanted=(hf unsloth); else IFS=, read -ra wanted <<<"$anchors"; fi
ran=()
for anchor in "${wanted[@]}"; do
  if usable "$anchor"; then ran+=("$anchor")
  elif [ "$anchors" = auto ]; then echo "bench.sh: without the $anchor anchor" >&2
  else echo "bench.sh: --anchors $anchor: it cannot run here" >&2; exit 1
  fi
done
results=$(mktemp)
trap 'rm -f "$results" "$results.out"' EXIT
record() {  # INDEX WHO COMMAND...: runs it, its output to stderr, and files its last line (a JSON object)
  local index=$1 who=$2 last; shift 2
  echo "== $who: $*" >&2
  "$@" | tee "$results.out" >&2 || echo "bench.sh: $who failed on this row" >&2
  last=$(tail -1 "$results.out")
  [[ $last == "{"* ]] || last="{}"
  echo "$index $who $last" >>"$results"
}
for index in "${!rows[@]}"; do
  IFS=: read -r quant batch checkpointing switches <<<"${rows[$index]}"
  row_flags=()
  for switch in ${switches//,/ }; do row_flags+=("--$switch"); done
  flags=(--shape "$shape" --layers "$layers" --quant "$quant" --micro-batch "$batch" --seq "$seq" --steps "$steps"
         --warmup "$warmup" --json)
  [ "$checkpointing" = on ] && flags+=(--checkpointing)
  record "$index" qtrain "$QTRAIN" bench "${flags[@]}" ${qtrain_flags[@]+"${qtrain_flags[@]}"} \
    ${row_flags[@]+"${row_flags[@]}"}
  setting="$quant:$batch:$checkpointing"  # anchors run each setting once, whatever qtrain's switches
  for anchor in "${ran[@]}"; do
    if grep -q "^$setting $anchor " "$results"; then continue
    elif [ "$anchor" = unsloth ]; then
      record "$setting" unsloth "${unsloth_python[@]}" "$ROOT/tools/bench_unsloth.py" "${flags[@]}"
    elif [ "$quant" = none ] || imports bitsandbytes; then
      record "$setting" hf "$PYTHON" "$ROOT/tools/bench_anchor.py" "${flags[@]}"
    else
      echo "bench.sh: bitsandbytes does not import in $PYTHON: no hf anchor for ${rows[$index]}" >&2
    fi
  done
done
"$PYTHON" - "$results" "$(IFS=,; echo "${ran[*]}")" "$layers" "${rows[@]}" <<'PY'
import json, sys
anchors, layers, rows = [name for name in sys.argv[2].split(",") if name], int(sys.argv[3]), sys.argv[4:]
records = {}  # (row index, "qtrain") and (QUANT:MICRO_BATCH:CHECKPOINTING, anchor)
for line in open(sys.argv[1]):
    key, who, text = line.split(" ", 2)
    records[int(key) if who == "qtrain" else key, who] = json.loads(text)


def other_depth(ours, theirs):  # an anchor's layers where they differ from qtrain's (unsloth's mixtures: 12)
    deep = theirs.get("layers")
    return deep if ours.get("layers") and deep and deep != ours["layers"] else None


def tokens(record, depth=None):
    note = f" ({depth} layers)" if depth else ""
    if "oom" in record:
        return "OOM" + note
    if not record.get("tokens_per_second"):
        return "-"
    mfu = f" (MFU {100 * record['mfu']:.1f}%)" if "mfu" in record else ""
    return f"{record['tokens_per_second']:,.0f}{mfu}{note}"


def peak(record):
    ran = record.get("tokens_per_second") and record.get("peak_memory_bytes")  # 0: not on a GPU
    return f"{record['peak_memory_bytes'] / 2**30:.2f} GiB" if ran else "-"


def ratio(ours, theirs, key):  # ours / theirs where both ran, as deep
    ran = all(record.get("tokens_per_second") and record.get(key) for record in (ours, theirs))
    ran = ran and not other_depth(ours, theirs)
    return f"{ours[key] / theirs[key]:.2f}x" if ran else "-"


header = ["setting", "qtrain tokens/s", "qtrain peak"]
for anchor in anchors:
    header += [f"{anchor} tokens/s", f"{anchor} peak", f"speed vs {anchor}", f"memory vs {anchor}"]
print("| " + " | ".join(header) + " |")
print("|" + "---|" * len(header))
for index, row in enumerate(rows):
    quant, batch, checkpointing, *switches = row.split(":")
    name = {"qlora": "QLoRA", "none": "LoRA bf16"}.get(quant, quant) + \
        (", checkpointing" if checkpointing == "on" else ", no checkpointing") + f", micro-batch {batch}" + \
        "".join(f", {switch}" for switch in ",".join(switches).split(",") if switch) + \
        (f", {layers} layers" if layers > 0 else "")
    ours = records.get((index, "qtrain"), {})
    cells = [name, tokens(ours), peak(ours)]
    for anchor in anchors:
        theirs = records.get((f"{quant}:{batch}:{checkpointing}", anchor), {})
        cells += [tokens(theirs, other_depth(ours, theirs)), peak(theirs), ratio(ours, theirs, "tokens_per_second"),
                  ratio(ours, theirs, "peak_memory_bytes")]
    print("| " + " | ".join(cells) + " |")
PY
