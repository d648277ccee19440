#!/usr/bin/env bash
# The QAT experiment of docs/QAT.md: on the bundled tiny Llama and the Brown slice, the eval
# perplexity of the float model, of post-training quantization (PTQ, round to nearest), of a
# fine-tune without fake quantization then PTQ (the fair baseline), and of QAT with the same
# data, steps and seed; and the share of the PTQ gap that QAT recovers.
#   tools/qat_experiment.sh [BUILD_DIR] [OUT_DIR] [--set key=value ...]
# Every run uses recipes/demo_qat_tiny.yaml plus the --set overrides given (the scheme:
# qat.weights.bits, group_size, ...); the eval is the whole held-out split.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
build="${1:-$here/build}"
out="${2:-$here/runs/qat_experiment}"
shift $(( $# < 2 ? $# : 2 ))
qtrain="$build/qtrain"
recipe="$here/recipes/demo_qat_tiny.yaml"
sets=(--set eval.max_batches=0 --set export.formats=[] --set checkpoint.every=0)
for arg in "$@"; do [[ "$arg" == --set ]] || sets+=(--set "$arg"); done
mkdir -p "$out"

eval_loss() { grep -E "$1" | tail -1 | sed -E 's/.*loss ([0-9.]+).*/\1/'; }

# Float and PTQ of the model as it is.
"$qtrain" quantize --recipe "$recipe" "${sets[@]}" --out "$out/ptq" --force > "$out/ptq.log"
float_loss=$(eval_loss 'eval float:' < "$out/ptq.log")
ptq_loss=$(eval_loss 'eval quantized:' < "$out/ptq.log")
# The same fine-tune without and with fake quantization.
"$qtrain" --recipe "$recipe" "${sets[@]}" --set quant=none --set train.output_dir="$out/finetune" > "$out/finetune.log"
finetune_loss=$(grep '^eval  step' "$out/finetune.log" | tail -1 | sed -E 's/.*eval_loss ([0-9.]+).*/\1/')
"$qtrain" quantize --recipe "$recipe" "${sets[@]}" --run "$out/finetune" --out "$out/finetune-ptq" --force > "$out/finetune-ptq.log"
finetune_ptq_loss=$(eval_loss 'eval quantized:' < "$out/finetune-ptq.log")
"$qtrain" --recipe "$recipe" "${sets[@]}" --set train.output_dir="$out/qat" > "$out/qat.log"
qat_loss=$(grep '^eval  step' "$out/qat.log" | tail -1 | sed -E 's/.*eval_loss ([0-9.]+).*/\1/')
scheme=$(grep '^quantize:' "$out/ptq.log" | head -1 | sed -E 's/quantize: [0-9]+ layers, //')

python3 - "$scheme" "$float_loss" "$ptq_loss" "$finetune_loss" "$finetune_ptq_loss" "$qat_loss" <<'PY'
import math, sys
scheme, *losses = sys.argv[1:]
float_loss, ptq, finetune, finetune_ptq, qat = map(float, losses)
ppl = lambda loss: math.exp(loss)
print(f"scheme: {scheme}")
print("| model | eval loss | perplexity |")
print("|---|---|---|")
for name, loss in [("float (as shipped)", float_loss), ("PTQ of it (RTN)", ptq), ("fine-tuned, float", finetune),
                   ("fine-tuned, then PTQ", finetune_ptq), ("QAT (same steps)", qat)]:
    print(f"| {name} | {loss:.4f} | {ppl(loss):.2f} |")
gap = ppl(finetune_ptq) - ppl(finetune)
print(f"PTQ gap after the fine-tune: {gap:+.2f} perplexity; QAT recovers "
      f"{(ppl(finetune_ptq) - ppl(qat)) / gap * 100 if gap else float('nan'):.0f}% of it")
PY
