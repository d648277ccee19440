#!/usr/bin/env bash
# Does QAT recover the accuracy that rounding costs, on schemes where the cost is real? For int4
# per channel, int3 in groups of 32, 8da4w (int4 groups of 32 + int8 dynamic per-token
# activations) and int2 in groups of 32 (asymmetric), on two models:
#   A  the bundled tiny Llama (7.2M parameters);
#   B  a Llama with random weights (hidden 768, 8 layers, about 63M parameters, the tiny model's
#      tokenizer), pretrained here in float on the Brown training split (on a GPU: minutes);
# it measures the eval perplexity of the float model, of PTQ (round to nearest), of a fine-tune
# without fake quantization and of that fine-tune then PTQ (the fair baseline), and of QAT
# variants with the same data and seed: plain, learned scales (LSQ, initialised from the range or
# as the paper does), a float warm-up before the rounding turns on, a higher learning rate, a
# longer run. A variant that changes the learning rate or the steps is compared with the
# fine-tune that changes them alike. Every number is an fp32 evaluation of the whole held-out
# split (Brown's val.jsonl): qtrain quantize's for float and PTQ models, qtrain eval's of the QAT
# run's safetensors-int export (the integer model it serves) for QAT.
#   tools/qat_recovery.sh [BUILD_DIR] [OUT_DIR] [cuda|cpu]
#   tools/qat_recovery.sh --report OUT_DIR     the tables again, from OUT_DIR/results.tsv
# Environment:
#   QTRAIN_RECOVERY_QUICK=1      smoke run: a few steps each, a 2-layer model B, slices of the data
#   QTRAIN_BROWN=DIR             train.jsonl and val.jsonl of the Brown corpus (default ../shared/data/brown)
#   QTRAIN_RECOVERY_MODELS="A B" which models
#   QTRAIN_RECOVERY_JOBS=N       runs at a time for each model (default 4 on cuda, 1 on cpu)
#   QTRAIN_RECOVERY_VARIANTS="qat lsq ..."  which QAT variants (default: all, listed below)
#   QTRAIN_RECOVERY_SCHEMES="q4_k_m ..."    which schemes (default: all, listed below)
#   QTRAIN_RECOVERY_BUDGET_S=S   start no run S seconds after the start (default: none); what
#                                finished is reported, what did not start is marked "not run".
#                                The longest runs start first, so the last ones are short.
#   QTRAIN_PYTHON                Python with torch and safetensors, for model B's random weights
# Prints one table per model (OUT_DIR/report.md); OUT_DIR/results.tsv holds every eval loss and
# OUT_DIR/logs/ every run's output. Measured 2026-11-26: 515 s on one H100 (all 70 jobs; model B's
# pretraining 114 s of it, beside model A's runs); the smoke run 6 min 11 s on 2 CPU cores.
set -uo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
report_only=0
[[ "${1:-}" == --report ]] && { report_only=1; shift; set -- "" "$@"; }
build="$(realpath "${1:-$here/build}")"
out="$(realpath -m "${2:-$here/runs/qat_recovery}")"
device="${3:-cuda}"
qtrain="$build/qtrain"
python="${QTRAIN_PYTHON:-python3}"
quick="${QTRAIN_RECOVERY_QUICK:-0}"
brown="${QTRAIN_BROWN:-$here/../shared/data/brown}"
models="${QTRAIN_RECOVERY_MODELS:-A B}"
budget_s="${QTRAIN_RECOVERY_BUDGET_S:-0}"
recipe="$here/recipes/qat_recovery.yaml"
pretrain_recipe="$here/recipes/qat_recovery_pretrain.yaml"
if [[ "$report_only" == 0 ]]; then
  [[ -x "$qtrain" ]] || { echo "qat_recovery: $qtrain not found (build it: tools/setup.sh)" >&2; exit 2; }
  [[ -f "$brown/train.jsonl" && -f "$brown/val.jsonl" ]] || { echo "qat_recovery: $brown: no train.jsonl / val.jsonl (set QTRAIN_BROWN)" >&2; exit 2; }
  [[ "$device" == cuda || "$device" == cpu ]] || { echo "qat_recovery: device '$device': cuda or cpu" >&2; exit 2; }
  mkdir -p "$out/logs" "$out/runs"
  : > "$out/results.tsv"
  : > "$out/timings.tsv"
fi
started=$(date +%s)

# Sizes. Model A trains with AdamW at 1e-4 on the tiny model's windows of 128, 16 sequences a
# step; model B with 8 windows of 256 (a base run is a quarter of an epoch, a long one under one:
# model B was pretrained on these documents and soon overfits them). Both compute in fp32
# (recipes/qat_recovery.yaml), as docs/QAT.md's tables were measured.
train_data="$brown/train.jsonl"
eval_data="$brown/val.jsonl"
if [[ "$quick" == 1 ]]; then
  mkdir -p "$out/data"
  [[ "$report_only" == 1 ]] || head -n 40 "$brown/train.jsonl" > "$out/data/train.jsonl"
  [[ "$report_only" == 1 ]] || head -n 2 "$brown/val.jsonl" > "$out/data/val.jsonl"
  train_data="$out/data/train.jsonl" eval_data="$out/data/val.jsonl"
  A_steps=3 A_micro=2 B_steps=3 B_micro=2 B_seq=64
  B_shape=(64 2 2 1 128)  # hidden, layers, heads, KV heads, intermediate
  pretrain_sets=(train.steps=10 train.micro_batch_size=4 data.max_seq_len=64 optim.lr=3e-3
                 schedule.warmup_steps=2 log.every=5)
  jobs_per_model="${QTRAIN_RECOVERY_JOBS:-1}"  # 2 cores: 2 processes at a time, one per model
else
  A_steps=300 A_micro=16 B_steps=150 B_micro=8 B_seq=256
  B_shape=(768 8 12 4 2048)
  pretrain_sets=()
  jobs_per_model="${QTRAIN_RECOVERY_JOBS:-$([[ "$device" == cuda ]] && echo 4 || echo 1)}"
fi
# Model B's pretraining ends at lr 1e-4; continuing at 1e-4 with fresh AdamW moments and 8
# sequences a step raised its perplexity (155.5 -> 158.2), so its fine-tunes start at 5e-5.
A_seq=128 A_lr=1e-4 B_lr=5e-5 eval_batch=16
# Several runs share the GPU; each keeps a few CPU threads rather than all the cores.
if [[ "$device" == cuda ]]; then
  export OMP_NUM_THREADS=$(( $(nproc) / (2 * jobs_per_model) > 0 ? $(nproc) / (2 * jobs_per_model) : 1 ))
fi

# The schemes: qat.* keys on top of recipes/qat_recovery.yaml.
# q4_k_m / q3_k_m: llama.cpp's file types (each layer on the block type llama-quantize gives its
# tensor); their PTQ is llama.cpp's own quantizer (qtrain quantize rounds as llama-quantize does).
schemes=(int4-per-channel int3-g32 8da4w int2-g32 q4_k_m q3_k_m)
[[ -n "${QTRAIN_RECOVERY_SCHEMES:-}" ]] && read -r -a schemes <<< "$QTRAIN_RECOVERY_SCHEMES"
declare -A scheme_sets=(
  [int4-per-channel]="qat.weights.bits=4 qat.weights.symmetric=true qat.weights.granularity=per_channel"
  [int3-g32]="qat.weights.bits=3 qat.weights.symmetric=true qat.weights.granularity=per_group qat.weights.group_size=32"
  [8da4w]="qat.weights.bits=4 qat.weights.symmetric=true qat.weights.granularity=per_group qat.weights.group_size=32 qat.activations.bits=8 qat.activations.symmetric=false qat.activations.granularity=per_token qat.activations.observer=dynamic"
  [int2-g32]="qat.weights.bits=2 qat.weights.symmetric=false qat.weights.granularity=per_group qat.weights.group_size=32"
  [q4_k_m]="qat.weights.format=gguf qat.weights.gguf_type=Q4_K_M"
  [q3_k_m]="qat.weights.format=gguf qat.weights.gguf_type=Q3_K_M"
)
# Training configurations: the fine-tune of each is the baseline of the QAT variants that use it.
#   base: the model's steps and lr; hilr: 3x the lr; long: 3x the steps.
configs=(base hilr long)
# QAT variants: name, configuration, extra keys (QUARTER: a quarter of the configuration's steps).
variants=(
  "qat base"
  "lsq base qat.weights.observer=minmax qat.weights.learned_scale=true qat.weights.learned_scale_init=observer"
  "lsq-paper base qat.weights.observer=minmax qat.weights.learned_scale=true qat.weights.learned_scale_init=paper"
  "warmup base qat.start_step=QUARTER"
  "qat-hilr hilr"
  "qat-long long"
  "lsq-long long qat.weights.observer=minmax qat.weights.learned_scale=true qat.weights.learned_scale_init=observer"
)
if [[ -n "${QTRAIN_RECOVERY_VARIANTS:-}" ]]; then
  mapfile -t variants < <(for entry in "${variants[@]}"; do
    [[ " $QTRAIN_RECOVERY_VARIANTS " == *" ${entry%% *} "* ]] && echo "$entry"; done)
fi

log() { printf '[qat_recovery %4ds] %s\n' "$(( $(date +%s) - started ))" "$*" >&2; }
past_budget() { (( budget_s > 0 && $(date +%s) - started >= budget_s )); }
record() { printf '%s\n' "$(IFS=$'\t'; echo "$*")" >> "$out/results.tsv"; }  # model kind scheme variant config loss
loss_of() { grep -E "^eval $2" "$1" | tail -1 | sed -E 's/.*loss ([0-9.]+).*/\1/'; }

# model_sets MODEL CONFIG: the --set arguments of a training run of MODEL in CONFIG.
model_sets() {
  local model=$1 config=$2 path=${1}_path seq=${1}_seq micro=${1}_micro steps=${1}_steps lr=${1}_lr
  steps=${!steps} lr=${!lr}
  case $config in
    hilr) lr=$(awk -v lr="$lr" 'BEGIN { printf "%g", 3 * lr }') ;;
    long) steps=$(( 3 * steps )) ;;
  esac
  echo "model.path=${!path} data.train=$train_data data.eval= data.max_seq_len=${!seq} train.micro_batch_size=${!micro}" \
       "train.device=$device train.steps=$steps optim.lr=$lr" \
       "schedule.warmup_steps=$(( steps / 15 > 1 ? steps / 15 : 1 ))"
}
# eval_sets MODEL: what qtrain quantize needs to evaluate MODEL on the held-out split.
eval_sets() {
  local path=${1}_path seq=${1}_seq
  echo "model.path=${!path} data.train=$train_data data.eval=$eval_data data.max_seq_len=${!seq}" \
       "train.micro_batch_size=$eval_batch train.device=$device eval.max_batches=0 export.formats=[]"
}
as_sets() { local item; for item in "$@"; do printf -- '--set\n%s\n' "$item"; done; }
timed() {  # NAME COMMAND...: runs it, logging its seconds and exit status to timings.tsv
  local name=$1 start rc; shift
  start=$(date +%s)
  "$@"; rc=$?
  printf '%s\t%d\t%d\n' "$name" "$(( $(date +%s) - start ))" "$rc" >> "$out/timings.tsv"
  return $rc
}

# ptq MODEL SCHEME CONFIG [--run DIR]: PTQ of the float model, or of the fine-tune in DIR; records
# the eval loss before (the float model, or the fine-tune of CONFIG) and after.
ptq() {
  local model=$1 scheme=$2 config=$3 name="$1-ptq-$2-$3" path=${1}_path; shift 3
  local source=("$@")
  (( ${#source[@]} )) || source=(--model "${!path}")
  mapfile -t sets < <(as_sets $(eval_sets "$model") ${scheme_sets[$scheme]})
  "$qtrain" quantize --recipe "$recipe" "${sets[@]}" "${source[@]}" --out "$out/runs/$name" --force \
    > "$out/logs/$name.log" 2>&1 || { log "FAILED: $name (logs/$name.log)"; return 1; }
  rm -rf "$out/runs/$name"
  if [[ "$config" == float ]]; then
    record "$model" float - - - "$(loss_of "$out/logs/$name.log" 'float:')"
  else
    record "$model" ft - - "$config" "$(loss_of "$out/logs/$name.log" 'float:')"
  fi
  record "$model" ptq "$scheme" - "$config" "$(loss_of "$out/logs/$name.log" 'quantized:')"
}

# finetune MODEL CONFIG: the fine-tune without fake quantization, then its PTQ in every scheme.
finetune() {
  local model=$1 config=$2 name="$1-ft-$2" scheme
  mapfile -t sets < <(as_sets $(model_sets "$model" "$config") quant=none export.formats=[] "train.output_dir=$out/runs/$name")
  "$qtrain" --recipe "$recipe" "${sets[@]}" > "$out/logs/$name.log" 2>&1 || { log "FAILED: $name (logs/$name.log)"; return 1; }
  for scheme in "${schemes[@]}"; do ptq "$model" "$scheme" "$config" --run "$out/runs/$name"; done
  rm -rf "$out/runs/$name"
}

# qat MODEL SCHEME VARIANT CONFIG [KEY=VALUE...]: the QAT run, then qtrain eval of its
# safetensors-int export (fp32, as qtrain quantize evaluates).
qat() {
  local model=$1 scheme=$2 variant=$3 config=$4 name="$1-qat-$2-$3" seq=${1}_seq steps; shift 4
  mapfile -t sets < <(as_sets $(model_sets "$model" "$config") ${scheme_sets[$scheme]} "$@" quant=qat \
                      export.formats=[safetensors-int] "train.output_dir=$out/runs/$name")
  steps=$(printf '%s\n' "${sets[@]}" | sed -n 's/^train.steps=//p')
  sets=("${sets[@]/QUARTER/$(( steps / 4 ))}")
  "$qtrain" --recipe "$recipe" "${sets[@]}" > "$out/logs/$name.log" 2>&1 || { log "FAILED: $name (logs/$name.log)"; return 1; }
  "$qtrain" eval --model "$out/runs/$name/export/safetensors-int" --data "$eval_data" --max-seq-len "${!seq}" \
    --batch-size "$eval_batch" --device "$device" --dtype fp32 --json > "$out/logs/$name-eval.log" 2>&1 \
    || { log "FAILED: $name eval (logs/$name-eval.log)"; return 1; }
  record "$model" qat "$scheme" "$variant" "$config" "$(tail -1 "$out/logs/$name-eval.log" | sed -E 's/.*"loss":([0-9.eE+-]+).*/\1/')"
  rm -rf "$out/runs/$name"
}

# make_model_b: random weights (tools/random_checkpoint.py's tensor names, the tiny model's config
# and tokenizer), then the float pretraining; model B is the pretraining run's merged export.
make_model_b() {
  local init="$out/runs/B-init" run="$out/runs/B-pretrain"
  "$python" - "$here/tools" "$init" "${B_shape[@]}" > "$out/logs/B-init.log" 2>&1 <<'PY' || { log "FAILED: B-init (logs/B-init.log)"; return 1; }
import json, math, os, shutil, sys
import torch
from safetensors.torch import save_file
sys.path.insert(0, sys.argv[1])
from random_checkpoint import TOKENIZER_DIR, tensor_shapes
out = sys.argv[2]
hidden, layers, heads, kv_heads, intermediate = map(int, sys.argv[3:8])
with open(os.path.join(TOKENIZER_DIR, "config.json")) as file:
    config = json.load(file)
config.update(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
              head_dim=hidden // heads, intermediate_size=intermediate, max_position_embeddings=1024, dtype="float32")
generator = torch.Generator().manual_seed(0)
tensors = {}
for name, shape in tensor_shapes(config):
    if len(shape) == 1:
        tensors[name] = torch.ones(shape)
        continue
    # GPT-2's init: N(0, 0.02), the projections into the residual stream scaled by 1/sqrt(2 layers).
    std = 0.02 / math.sqrt(2 * layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
    tensors[name] = torch.empty(shape).normal_(0, std, generator=generator)
os.makedirs(out, exist_ok=True)
save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
with open(os.path.join(out, "config.json"), "w") as file:
    json.dump(config, file, indent=1)
for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
    shutil.copy(os.path.join(TOKENIZER_DIR, name), out)
print(f"model B: {sum(t.numel() for t in tensors.values()) / 1e6:.1f}M parameters in {out}")
PY
  log "$(tail -1 "$out/logs/B-init.log")"
  mapfile -t sets < <(as_sets "model.path=$init" "data.train=$train_data" "data.eval=$eval_data" "train.device=$device" \
                              "train.output_dir=$run" "${pretrain_sets[@]}")
  "$qtrain" --recipe "$pretrain_recipe" "${sets[@]}" > "$out/logs/B-pretrain.log" 2>&1 \
    || { log "FAILED: B-pretrain (logs/B-pretrain.log)"; return 1; }
  log "B pretrained: $(grep '^done:' "$out/logs/B-pretrain.log")"
  echo "$(tail -1 "$out/logs/B-init.log"); pretraining $(grep '^data: [0-9]* batches' "$out/logs/B-pretrain.log" | sed 's/^data: //'):" \
       "$(grep '^done:' "$out/logs/B-pretrain.log" | sed -E 's/^done: (.*); .*/\1/') (recipes/qat_recovery_pretrain.yaml)" >> "$out/settings.txt"
  rm -rf "$run/checkpoints"
  B_path="$run/export/merged"
}

# experiment MODEL: every run of MODEL, JOBS at a time: the PTQs of the float model, then the
# fine-tunes and QAT runs, longest first (the variants are listed shortest first).
experiment() {
  local model=$1 scheme index entry
  local -a queue=()
  for scheme in "${schemes[@]}"; do queue+=("ptq $model $scheme float"); done
  for (( index = ${#configs[@]} - 1; index >= 0; index-- )); do queue+=("finetune $model ${configs[index]}"); done
  for (( index = ${#variants[@]} - 1; index >= 0; index-- )); do
    for scheme in "${schemes[@]}"; do queue+=("qat $model $scheme ${variants[index]}"); done
  done
  for entry in "${queue[@]}"; do
    while (( $(jobs -rp | wc -l) >= jobs_per_model )); do wait -n; done
    if past_budget; then record "$model" skipped - - - "$entry"; continue; fi
    timed "$model $entry" $entry &
  done
  wait
}

# report: the tables, from results.tsv.
report() {
  local variant_configs
  variant_configs=$(for entry in "${variants[@]}"; do read -r name config _ <<< "$entry"; printf '%s:%s ' "$name" "$config"; done)
  python3 - "$out" "$models" "${schemes[*]}" "$variant_configs" <<'PY' | tee "$out/report.md"
import collections, math, os, sys
out, models, schemes = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()
# Each QAT variant and the fine-tune configuration it is compared with.
variants = dict(entry.split(":") for entry in sys.argv[4].split())
losses, skipped = {}, collections.defaultdict(list)
for line in open(f"{out}/results.tsv"):
    model, kind, scheme, variant, config, value = line.rstrip("\n").split("\t")
    if kind == "skipped":
        skipped[model].append(value)
    elif value:
        losses[(model, kind, scheme, variant, config)] = float(value)

def perplexity(model, kind, scheme="-", variant="-", config="-"):
    key = (model, kind, scheme, variant, config)
    return math.exp(losses[key]) if key in losses else math.nan

def recovery(model, scheme, variant):
    """Share of the fine-tune's PTQ gap that QAT closes, (ft+PTQ - QAT) / (ft+PTQ - ft) in percent;
    None where a run is missing, NaN where PTQ costs the fine-tune nothing."""
    config = variants[variant]
    finetune, finetune_ptq = perplexity(model, "ft", config=config), perplexity(model, "ptq", scheme, config=config)
    qat = perplexity(model, "qat", scheme, variant, config)
    if math.isnan(finetune + finetune_ptq + qat):
        return None
    return (finetune_ptq - qat) / (finetune_ptq - finetune) * 100 if finetune_ptq > finetune else math.nan

def percent(value):
    return "not run" if value is None else "no gap" if math.isnan(value) else f"{value:.0f}%"

show = lambda value: "not run" if math.isnan(value) else f"{value:.2f}"
for model in models:
    print(f"\n### Model {model}: perplexity on the whole held-out split\n")
    print("| scheme | float | PTQ | fine-tune | fine-tune+PTQ | QAT (best variant) | recovery | plain QAT (base recipe) | its recovery |")
    print("|---|---|---|---|---|---|---|---|---|")
    for scheme in schemes:
        # The best QAT model is the one with the lowest perplexity (the highest recovery would favour
        # configurations whose own fine-tune did badly).
        measured = [v for v in variants if not math.isnan(perplexity(model, "qat", scheme, v, variants[v]))]
        best = min(measured, key=lambda v: perplexity(model, "qat", scheme, v, variants[v])) if measured else "qat"
        config = variants[best]
        print(f"| {scheme} | {show(perplexity(model, 'float'))} | {show(perplexity(model, 'ptq', scheme, config='float'))} "
              f"| {show(perplexity(model, 'ft', config=config))} ({config}) "
              f"| {show(perplexity(model, 'ptq', scheme, config=config))} "
              f"| {show(perplexity(model, 'qat', scheme, best, config))} ({best}) | {percent(recovery(model, scheme, best))} "
              f"| {show(perplexity(model, 'qat', scheme, 'qat', 'base'))} | {percent(recovery(model, scheme, 'qat'))} |")
    print(f"\nEvery QAT run of model {model}, against the fine-tune of its configuration:\n")
    print("| scheme | variant | config | QAT | fine-tune | fine-tune+PTQ | recovery |")
    print("|---|---|---|---|---|---|---|")
    for scheme in schemes:
        for variant, config in variants.items():
            print(f"| {scheme} | {variant} | {config} | {show(perplexity(model, 'qat', scheme, variant, config))} "
                  f"| {show(perplexity(model, 'ft', config=config))} | {show(perplexity(model, 'ptq', scheme, config=config))} "
                  f"| {percent(recovery(model, scheme, variant))} |")
    for entry in skipped[model]:
        print(f"- not started (past QTRAIN_RECOVERY_BUDGET_S): {entry}")
if os.path.exists(f"{out}/settings.txt"):
    print("\n" + open(f"{out}/settings.txt").read().strip())
print(f"configs: base = the model's steps and learning rate; hilr = 3x the learning rate; long = 3x the steps. "
      "lsq: learned scales (observer minmax, initialised from the range; lsq-paper: LSQ's 2 mean|w| / sqrt(Qp)); "
      "warmup: fake quantization from a quarter of the steps.")
PY
}

if [[ "$report_only" == 1 ]]; then
  report
  exit
fi
A_path="$here/recipes/demo/tiny-llama"
B_path=""
log "build $build, out $out, device $device, quick $quick, models $models, $jobs_per_model runs at a time per model"
for model in $models; do
  steps=${model}_steps micro=${model}_micro seq=${model}_seq lr=${model}_lr
  echo "model $model: base = ${!steps} steps of ${!micro} x ${!seq} tokens, AdamW at lr ${!lr}, seed 42, fp32, $device."
done > "$out/settings.txt"
for model in $models; do
  if [[ "$model" == B ]]; then
    ( make_model_b && experiment B ) &
  else
    experiment "$model" &
  fi
done
wait
log "all runs done"
report
log "report: $out/report.md; every loss: $out/results.tsv; seconds per run: $out/timings.tsv"
