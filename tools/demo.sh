#!/usr/bin/env bash
# Set-up (tools/setup.sh), then the demo on the CPU: QLoRA fine-tuning of the bundled tiny Llama
# on a slice of the Brown corpus (recipes/demo_tiny.yaml, about a minute), then the trained
# adapter evaluated on held-out Brown documents beside the base model.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# Only the binary the demo runs; tools/run-tests.sh builds the rest (tests, fuzzers).
QTRAIN_BUILD_TARGET=${QTRAIN_BUILD_TARGET:-qtrain} "$ROOT/tools/setup.sh"
cd "$ROOT"
set -x
build/qtrain --recipe recipes/demo_tiny.yaml
build/qtrain eval --model recipes/demo/tiny-llama --data recipes/demo/brown-val.jsonl --max-seq-len 256 --device cpu
build/qtrain eval --model recipes/demo/tiny-llama --data recipes/demo/brown-val.jsonl --max-seq-len 256 --device cpu \
  --adapter runs/demo_tiny/adapter
