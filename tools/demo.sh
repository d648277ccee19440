#!/usr/bin/env bash
# Set-up (tools/setup.sh), then the demo: qtrain evaluates the bundled tiny Llama on a slice of
# the Brown corpus's validation split, on the CPU.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$ROOT/tools/setup.sh"
cd "$ROOT"
set -x
build/qtrain inspect --model recipes/demo/tiny-llama
build/qtrain eval --model recipes/demo/tiny-llama --data recipes/demo/brown-val.jsonl --max-seq-len 256 --device cpu
