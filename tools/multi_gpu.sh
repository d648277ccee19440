#!/usr/bin/env bash
# Data parallelism over NCCL on one machine with 2 or more GPUs, as users launch it
# (torchrun --no-python qtrain). Prints one line per check and exits 1 if any promise broke.
#
#   tools/multi_gpu.sh [equivalence] [scaling] [faults]     (default: all three)
#
#   equivalence  the demo recipe on CUDA: N ranks of micro-batch 2 against 1 GPU accumulating
#                N micro-batches of 2: in fp32 with dist.reduce: ordered bit for bit (adapter
#                equal, losses within 1e-12); in fp32 with NCCL's all-reduce within 1e-6 on 2
#                ranks (a sum of two is the same in either order) and 1e-5 on more; in bf16
#                within bf16 noise; the N-rank adapter loads in peft.
#   scaling      Llama-3-8B-shaped QLoRA (random weights from tools/random_checkpoint.py, NF4
#                double-quant, LoRA r16 on 7 projections, bf16, checkpointing, micro-batch 4,
#                seq 2048, Brown text packed wrapped) through `qtrain --recipe`: tokens/s on 1 and N GPUs
#                (goal 0.95 N x).
#   faults       tools/faults.py --device cuda torchrun stop (2 ranks): a killed rank under NCCL
#                ends the other and --max-restarts resumes; SIGTERM to one rank stops both.
#
# N is RANKS (default: every GPU of the machine). Needs build/qtrain and a python3 with torch,
# transformers, peft and safetensors. Work files go to $QTRAIN_MULTI_GPU_WORK (default a fresh
# temporary directory); SCALING_STEPS (24) steps each.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
QTRAIN=${QTRAIN:-$ROOT/build/qtrain}
PYTHON=${QTRAIN_PYTHON:-python3}
WORK=${QTRAIN_MULTI_GPU_WORK:-$(mktemp -d /tmp/qtrain-multi-gpu-XXXXXX)}
SCALING_STEPS=${SCALING_STEPS:-24}
# NVLink multicast stays off on shared hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$WORK"
broken=0
report() { printf '%s %s\n' "$1" "$2"; [ "$1" = ok ] || broken=1; }

gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')
if [ "$gpus" -lt 2 ]; then
  echo "multi_gpu: this machine has $gpus GPU(s); the checks need 2 or more" >&2
  exit 2
fi

RANKS=${RANKS:-$gpus}
torchrun() { "$PYTHON" -m torch.distributed.run --nproc_per_node "$RANKS" --master_port $((29500 + RANDOM % 1000)) "$@"; }

# Max |difference| of the `loss` lines of two runs' metrics.jsonl, relative to the loss, and the
# largest relative difference of their adapters' tensors.
compare_runs() {
  "$PYTHON" - "$1" "$2" <<'EOF'
import json, sys
from safetensors.torch import load_file
def losses(run):
    return {r["step"]: r["loss"] for r in map(json.loads, open(run + "/metrics.jsonl")) if "loss" in r}
a, b = losses(sys.argv[1]), losses(sys.argv[2])
assert a.keys() == b.keys() and a, (sorted(a), sorted(b))
loss = max(abs(a[s] - b[s]) / abs(a[s]) for s in a)
wa = load_file(sys.argv[1] + "/adapter/adapter_model.safetensors")
wb = load_file(sys.argv[2] + "/adapter/adapter_model.safetensors")
assert wa.keys() == wb.keys()
weights = max(((wa[k].double() - wb[k].double()).abs().max() / wa[k].double().abs().max().clamp_min(1e-30)).item()
              for k in wa)
print(f"{loss:.3g} {weights:.3g} {len(a)}")
EOF
}

equivalence() {
  local common=(--recipe "$ROOT/recipes/demo_tiny.yaml" --set train.device=cuda --set train.steps=20
                --set log.every=1 --set eval.every=0 --set checkpoint.every=0 --set lora.dropout=0
                --set train.micro_batch_size=2)
  local mode
  rm -rf "$WORK"/eq-*  # the one-GPU runs below are shared by the fp32 modes, never reused from an earlier call
  for mode in fp32-ordered fp32 bf16; do
    local dtype=${mode%-ordered} reduce=allreduce
    [ "$mode" = fp32-ordered ] && reduce=ordered
    local one="$WORK/eq-$dtype-one" two="$WORK/eq-$mode-two"
    rm -rf "$two"
    # The one-GPU run does not depend on dist.reduce: fp32-ordered and fp32 share it.
    if [ ! -f "$one/metrics.jsonl" ]; then
      "$QTRAIN" "${common[@]}" --set train.dtype=$dtype --set train.grad_accum_steps=$RANKS \
        --set train.output_dir="$one" >"$one.log" 2>&1 || { report FAIL "equivalence $mode: 1 GPU run failed: $(tail -1 "$one.log")"; continue; }
    fi
    torchrun --no-python "$QTRAIN" "${common[@]}" --set train.dtype=$dtype --set dist.reduce=$reduce \
      --set train.output_dir="$two" >"$two.log" 2>&1 || { report FAIL "equivalence $mode: $RANKS-rank run failed: $(tail -3 "$two.log")"; continue; }
    read -r loss weights steps < <(compare_runs "$one" "$two")
    # ordered: the same sums in the same order (the losses are summed over the ranks in fp64);
    # all-reduce: NCCL's order, which on more than 2 ranks moves the gradients' last bits and
    # AdamW's normalised update carries them into the adapter; bf16: the rounding noise of an N-way sum.
    local loss_bound weights_bound
    case $mode in
      fp32-ordered) loss_bound=1e-12 weights_bound=0 ;;
      fp32) loss_bound=1e-6 weights_bound=1e-6; [ "$RANKS" -gt 2 ] && weights_bound=1e-5 ;;
      bf16) loss_bound=1e-2 weights_bound=1e-2 ;;
    esac
    local verdict=FAIL; "$PYTHON" -c "import sys; sys.exit(not ($loss <= $loss_bound and $weights <= $weights_bound))" && verdict=ok
    report $verdict "equivalence $mode (dist.reduce: $reduce): $RANKS GPUs x micro-batch 2 against 1 GPU x $RANKS accumulated, $steps steps: loss max rel diff $loss (bound $loss_bound), adapter max rel diff $weights (bound $weights_bound)"
  done
  local inputs="$WORK/peft-inputs.safetensors"
  "$PYTHON" -c "import torch; from safetensors.torch import save_file; save_file({'input_ids': torch.randint(6, 8192, (2, 24), generator=torch.Generator().manual_seed(0))}, '$inputs')"
  if "$PYTHON" "$ROOT/tests/interop/peft_logits.py" "$ROOT/recipes/demo/tiny-llama" "$WORK/eq-fp32-ordered-two/adapter" \
       "$inputs" input_ids "$WORK/peft-logits.safetensors" >"$WORK/peft.log" 2>&1; then
    report ok "equivalence: PeftModel.from_pretrained loads the $RANKS-rank adapter, every LoRA tensor in place"
  else
    report FAIL "equivalence: peft did not load the $RANKS-rank adapter: $(tail -2 "$WORK/peft.log")"
  fi
}

# Median tokens/s (total over the ranks) of the logged steps after the first quarter.
median_tokens_per_second() {
  "$PYTHON" -c "
import json, statistics, sys
rows = [r for r in map(json.loads, open('$1/metrics.jsonl')) if 'tokens_per_second' in r]
rows = rows[len(rows) // 4:]
print(round(statistics.median(r['tokens_per_second'] for r in rows)), rows[-1].get('peak_memory', 0))"
}

scaling() {
  local model="$WORK/llama3-8b-random"
  [ -f "$model/config.json" ] || "$PYTHON" "$ROOT/tools/random_checkpoint.py" "$model" >"$WORK/checkpoint.log" 2>&1 \
    || { report FAIL "scaling: random checkpoint: $(tail -2 "$WORK/checkpoint.log")"; return; }
  local common=(--recipe "$ROOT/recipes/qlora_llama.yaml" --set model.path="$model"
                --set data.train="$ROOT/recipes/demo/brown-train.jsonl" --set data.format=text --set data.pack=true
                --set data.pack_strategy=wrapped
                --set train.micro_batch_size=4 --set train.grad_accum_steps=1 --set train.steps=$SCALING_STEPS
                --set schedule.warmup_steps=2 --set log.every=1 --set checkpoint.every=0 --set eval.every=0)
  rm -rf "$WORK/scale-1" "$WORK/scale-n"
  "$QTRAIN" "${common[@]}" --set train.output_dir="$WORK/scale-1" >"$WORK/scale-1.log" 2>&1 \
    || { report FAIL "scaling: 1 GPU run failed: $(tail -2 "$WORK/scale-1.log")"; return; }
  torchrun --no-python "$QTRAIN" "${common[@]}" --set train.output_dir="$WORK/scale-n" >"$WORK/scale-n.log" 2>&1 \
    || { report FAIL "scaling: $RANKS-GPU run failed: $(tail -3 "$WORK/scale-n.log")"; return; }
  read -r one one_peak < <(median_tokens_per_second "$WORK/scale-1")
  read -r many many_peak < <(median_tokens_per_second "$WORK/scale-n")
  local ratio goal; ratio=$("$PYTHON" -c "print(f'{$many / $one:.2f}')"); goal=$("$PYTHON" -c "print(0.95 * $RANKS)")
  local verdict=FAIL; "$PYTHON" -c "import sys; sys.exit(not $ratio >= $goal)" && verdict=ok
  report $verdict "scaling: 8B-shape QLoRA, micro-batch 4 x 2048, checkpointing: 1 GPU $one tokens/s (peak $one_peak), $RANKS GPUs $many tokens/s (peak $many_peak per rank): ${ratio}x (goal ${goal}x)"
}

faults() {
  if "$PYTHON" "$ROOT/tools/faults.py" --device cuda --qtrain "$QTRAIN" --work "$WORK/faults" torchrun stop \
       >"$WORK/faults.log" 2>&1; then
    sed 's/^/  /' "$WORK/faults.log"; report ok "faults under NCCL"
  else
    sed 's/^/  /' "$WORK/faults.log"; report FAIL "faults under NCCL"
  fi
}

for check in "${@:-equivalence scaling faults}"; do
  for name in $check; do "$name"; done
done
echo "multi_gpu: work files in $WORK"
exit $broken
